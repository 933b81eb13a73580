"""Fully resident layers: routing and experts on the device, the result left there, the step's statistics taken
at its end (HybridExpertNode._run_resident / account_resident), and which cut tensors a dense part on the GPU
leaves in GPU memory (PartitionedDecoder.place_cut_tensors). On the simulated device, whose "device" arrays are
NumPy; the CUDA path is in tests/test_offload_cuda.py (marker gpu)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.dense_segment import DEVICE_ONNX_TYPES, DenseSegment
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.devices import SimulatedSlots
from engine.offload.hybrid_node import HybridExpertNode
from engine.ort_env import DenseDevice
from tests.test_offload import SPEC, STEPS, device_expert_bytes, greedy_run


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from engine.writer import write_model

    return write_model(tmp_path_factory.mktemp("resident") / "m", SPEC)


def open_model(model_folder, fraction: float, **config):
    """The model on the simulated device, the CPU kernels' rate left unmeasured: the miss policy's decisions then
    follow the device's declared bandwidths, the same in two runs whatever this machine's speed."""
    budget = int(fraction * device_expert_bytes(model_folder))
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=budget, **config),
                             device=SimulatedDevice(1 << 30))
    model.offload.cpu_rate.observe = lambda nbytes, seconds, layer=None: None
    return model


@pytest.fixture
def routed_calls(monkeypatch):
    """Every SimulatedSlots.launch_routed call's node name."""
    calls = []
    real = SimulatedSlots.launch_routed

    def spy(self, x, logits, router_weights):
        calls.append(self.name)
        return real(self, x, logits, router_weights)

    monkeypatch.setattr(SimulatedSlots, "launch_routed", spy)
    return calls


@pytest.mark.parametrize("placement", ["adaptive", "static"])
def test_fully_resident_layers_route_on_the_device_with_the_host_paths_results_and_statistics(
        model_folder, routed_calls, monkeypatch, placement):
    model = open_model(model_folder, 1.0, placement=placement)
    logits, tokens = greedy_run(model)
    assert len(routed_calls) == SPEC.layers * (1 + STEPS)  # every layer, prompt and decode steps
    assert not model.offload.deferred  # the statistics were taken at each step's end

    monkeypatch.setattr(SimulatedSlots, "holds", lambda self, x: False)  # the host path, as before
    host = open_model(model_folder, 1.0, placement=placement)
    host_logits, host_tokens = greedy_run(host)
    assert len(routed_calls) == SPEC.layers * (1 + STEPS)  # no more routed launches
    assert tokens == host_tokens
    for ours, ref in zip(logits, host_logits):
        assert np.abs(ours - ref).max() <= 1e-6 * np.abs(ref).max()
    ours, ref = model.offload.stats, host.offload.stats
    assert ours.steps == ref.steps == 1 + STEPS
    for mine, theirs, hits, ref_hits in zip(ours.layers, ref.layers, ours.expert_hits, ref.expert_hits):
        assert (mine.hits, mine.misses, mine.misses_cpu, mine.misses_copied) == \
            (theirs.hits, theirs.misses, theirs.misses_cpu, theirs.misses_copied)
        assert mine.hits > 0 and mine.misses == 0
        assert (mine.routed_on_device, theirs.routed_on_device) == (1 + STEPS, 0)
        assert mine.device_s == pytest.approx(theirs.device_s) and mine.critical_s == pytest.approx(theirs.critical_s)
        assert np.array_equal(hits, ref_hits)
    assert ours.step_splits == ref.step_splits
    for mine, theirs in zip(model.offload.policy.scores, host.offload.policy.scores):
        assert np.allclose(mine, theirs)  # placement learnt the same routing
    decode, ref_decode = ours.phase(1), ref.phase(1)
    assert decode.critical_s == pytest.approx(ref_decode.critical_s) and decode.critical_s > 0


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_decode_results_merged_on_the_device_match_the_host_merge(model_folder, monkeypatch, fraction):
    """Layers with cold experts, inputs in the device's memory: in decode the CPU's part is added to the device's
    there (merge_on_device) and the device time is read at the end of the step; the same answers and statistics as
    adding them on the host (collect)."""
    merges = []
    real = SimulatedSlots.merge_on_device

    def spy(self, pending, cpu_part, like):
        merges.append(pending is not None)
        return real(self, pending, cpu_part, like)

    monkeypatch.setattr(SimulatedSlots, "merge_on_device", spy)
    model = open_model(model_folder, fraction)
    logits, tokens = greedy_run(model)
    prompt = len(model.tokenizer.encode("The expert offload engine must be exact."))  # greedy_run's, a prefill
    assert prompt > 8 and len(merges) == SPEC.layers * STEPS
    assert any(merges) == (fraction > 0)  # with residents, the device has a part to add

    monkeypatch.setattr(SimulatedSlots, "holds", lambda self, x: False)
    host = open_model(model_folder, fraction)
    host_logits, host_tokens = greedy_run(host)
    assert len(merges) == SPEC.layers * STEPS and tokens == host_tokens
    for ours, ref in zip(logits, host_logits):
        assert np.abs(ours - ref).max() <= 1e-6 * np.abs(ref).max()
    ours, ref = model.offload.stats, host.offload.stats
    for mine, theirs in zip(ours.layers, ref.layers):
        assert (mine.hits, mine.misses, mine.misses_cpu, mine.misses_copied, mine.miss_copies) == \
            (theirs.hits, theirs.misses, theirs.misses_cpu, theirs.misses_copied, theirs.miss_copies)
        assert mine.device_s == pytest.approx(theirs.device_s)
    assert ours.step_splits == ref.step_splits and not model.offload.deferred
    if fraction:
        assert ours.totals().device_s > 0


def test_layers_with_cold_experts_and_approximate_routing_keep_the_host_path(model_folder, routed_calls):
    greedy_run(open_model(model_folder, 0.5), steps=3)
    assert routed_calls == []
    approximate = open_model(model_folder, 1.0, min_expert_weight=0.3)
    assert approximate.offload.approximating
    greedy_run(approximate, steps=3)
    assert routed_calls == []


def test_the_agreement_meters_shadow_pass_counts_nothing(model_folder, routed_calls):
    model = open_model(model_folder, 1.0)
    state = model.new_state()
    with model.offload.exact_routing():
        model.decoder.forward(state, [1, 2, 3])
    assert len(routed_calls) == SPEC.layers and not model.offload.deferred
    assert model.offload.stats.totals().hits == 0 and model.offload.stats.steps == 0


def test_a_budget_lowered_on_a_loaded_model_goes_back_to_the_host_path(model_folder, routed_calls):
    model = open_model(model_folder, 1.0)
    greedy_run(model, steps=2)
    routed = len(routed_calls)
    assert routed == 3 * SPEC.layers
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=device_expert_bytes(model_folder) // 2))
    greedy_run(model, steps=2)
    assert len(routed_calls) == routed
    assert model.offload.stats.totals().misses > 0


def _readers(decoder, name):
    return [r for r in decoder.steps
            if name in (r.segment.inputs if isinstance(r, DenseSegment) else r.info.activation_inputs.values())]


def test_cut_tensors_stay_on_the_gpu_only_where_every_reader_takes_device_arrays(model_folder):
    model = open_model(model_folder, 0.5)
    decoder = model.decoder
    segments = [r for r in decoder.steps if isinstance(r, DenseSegment)]
    nodes = [r for r in decoder.steps if isinstance(r, HybridExpertNode)]
    assert len(nodes) == SPEC.layers == 3
    decoder.place_cut_tensors()
    assert all(s.bindings.on_device == frozenset() for s in segments)  # the dense part is on the CPU here
    assert all(s.decode_bindings is None for s in segments)
    assert not decoder.keeps_cut_tensors_on_device and "round trip" not in model.dense_statement

    for node in (nodes[0], nodes[2]):  # as CUDA stores say (CudaSlots.device_inputs)
        model.offload.stores[node.layer].device_inputs = True
    assert [n.takes_device_arrays for n in nodes] == [True, False, True]
    decoder.dense = DenseDevice("cuda", "a test's stand-in")
    decoder.place_cut_tensors()
    assert decoder.keeps_cut_tensors_on_device
    on_device = set().union(*(s.bindings.on_device for s in segments))
    assert decoder.logits_name not in on_device
    # ... but in decode steps the segment that makes the logits leaves them there too (forward copies them out)
    assert [s.decode_bindings is not None for s in segments] == [False] * (len(segments) - 1) + [True]
    assert segments[-1].decode_bindings.on_device == segments[-1].bindings.on_device | {decoder.logits_name}
    for node in (nodes[0], nodes[2]):
        assert set(node.info.activation_inputs.values()) <= on_device
    assert not set(nodes[1].info.activation_inputs.values()) & on_device
    # a float tensor that only dense segments read (the residual stream past an expert node) stays too; integer
    # ones (the attention's sequence lengths, which onnxruntime reads on the CPU) and tensors no one reads do not
    only_dense = [name for s in segments for name in s.segment.outputs if name != decoder.logits_name
                  and _readers(decoder, name) and all(isinstance(r, DenseSegment) for r in _readers(decoder, name))]
    floats = {name for s in segments for name in only_dense if s.output_types.get(name) in DEVICE_ONNX_TYPES}
    assert floats and floats <= on_device
    assert set(only_dense) - floats and not (set(only_dense) - floats) & on_device
    assert all(_readers(decoder, name) for name in on_device)
    # one that a later segment's session reads in host memory (onnxruntime's input memory infos) stays there too
    read_on_host = sorted(floats)[0]
    reader = next(r for r in _readers(decoder, read_on_host) if isinstance(r, DenseSegment))
    reader.host_inputs = frozenset({read_on_host})
    decoder.place_cut_tensors()
    now = set().union(*(s.bindings.on_device for s in segments))
    assert now == on_device - {read_on_host}
