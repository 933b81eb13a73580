"""benchmarks/trace_routing.py: decode steps routed by a trace, for the offload benchmark's real-like routing."""
import numpy as np
import pytest

from benchmarks.trace_routing import TraceRouting
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.traces import realistic_trace
from engine.writer import write_model
from tests.test_offload import SPEC


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_model(tmp_path_factory.mktemp("trace") / "m", SPEC)
    return LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))


def decode_under_trace(model, trace: np.ndarray, prompt: str) -> TraceRouting:
    """The prompt, then one decode step per trace token under TraceRouting, statistics counted from the first decode
    step; the routing, for its counts."""
    state = model.new_state()
    with TraceRouting(trace, SPEC.layers) as routing:
        logits = model.decoder.forward(state, model.tokenizer.encode(prompt))
        model.offload.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
        for _ in range(trace.shape[0]):
            logits = model.decoder.forward(state, [int(logits[-1].argmax())])
    return routing


def assert_counted_as_traced(engine, trace: np.ndarray) -> None:
    """Every layer's counted experts are the trace's, token by token."""
    for layer in range(SPEC.layers):
        counted = engine.stats.expert_hits[layer] + engine.stats.expert_misses[layer]
        assert counted.tolist() == np.bincount(trace[:, layer].ravel(), minlength=SPEC.num_experts).tolist()


def test_decode_steps_route_to_the_traces_experts_and_prompts_to_the_models(model):
    trace = realistic_trace(6, SPEC.layers, SPEC.num_experts, SPEC.top_k, seed=2)
    routing = decode_under_trace(model, trace, "A prompt routes as the model routes.")
    assert routing.calls == 6 * SPEC.layers
    assert_counted_as_traced(model.offload, trace)
    import engine.offload.hybrid_node as hybrid_node
    from kernels.cpu.routing import route
    assert hybrid_node.route is route  # put back on leaving


def test_a_trace_too_short_or_of_other_layers_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"\[tokens, 3 layers, k\] is needed, not \[4, 2, 4\]"):
        TraceRouting(np.zeros((4, 2, 4), np.int32), SPEC.layers)
    state = model.new_state()
    with TraceRouting(np.zeros((1, SPEC.layers, SPEC.top_k), np.int32) + np.arange(SPEC.top_k), SPEC.layers):
        logits = model.decoder.forward(state, [5, 6, 7])
        logits = model.decoder.forward(state, [int(logits[-1].argmax())])
        with pytest.raises(IndexError, match="holds 1 tokens; decode asked for more"):
            model.decoder.forward(state, [int(logits[-1].argmax())])


def test_with_whole_layers_every_layer_takes_the_trace_the_resident_one_on_the_device(tmp_path, monkeypatch):
    from benchmarks.bench_overhead import instrument, wrapped_module_functions
    from tests.test_offload import device_expert_bytes

    for module, name, _bucket in wrapped_module_functions():  # wrapped for good by instrument(): put back after
        monkeypatch.setattr(module, name, getattr(module, name))

    folder = write_model(tmp_path / "m", SPEC)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 2),
                             device=SimulatedDevice(1 << 30))
    engine = model.offload
    engine.set_layer_split("whole")
    whole = [layer for layer, slots in enumerate(engine.slots) if slots.all_resident]
    assert whole == [0]  # 3 layers: half the budget holds the first whole
    trace = realistic_trace(5, SPEC.layers, SPEC.num_experts, SPEC.top_k, seed=4)
    state = model.new_state()
    with TraceRouting(trace, SPEC.layers) as routing:
        instrument(model)  # timing wrappers around route, as bench_offload's decode puts them
        logits = model.decoder.forward(state, model.tokenizer.encode("Whole layers under a trace."))
        engine.stats.reset(SPEC.layers, [SPEC.num_experts] * SPEC.layers)
        for _ in range(5):
            logits = model.decoder.forward(state, [int(logits[-1].argmax())])
    assert routing.calls == 5 * SPEC.layers and routing.device_calls == 5  # layer 0 routes on the device
    for layer in (0, 1, 2):  # each step's token of the trace, at its own layer
        counted = engine.stats.expert_hits[layer] + engine.stats.expert_misses[layer]
        assert counted.tolist() == np.bincount(trace[:, layer].ravel(), minlength=SPEC.num_experts).tolist()


@pytest.mark.parametrize("path", ["tier", "both"])
def test_steps_routed_on_the_device_take_the_trace_under_the_host_tier(tmp_path, path):
    """With the host tier every decode step of a partly resident layer routes on the device (tier: _run_resident;
    both: _run_split, whose routing kernel also gives the CPU its share): each takes the trace's experts, steered in
    its logits, and the wrapped methods are put back on leaving."""
    import engine.offload.hybrid_node as hybrid_node
    from tests.test_offload import device_expert_bytes

    folder = write_model(tmp_path / "m", SPEC)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 2),
                             device=SimulatedDevice(1 << 30), decode_path=path)
    engine = model.offload
    originals = {name: getattr(hybrid_node.HybridExpertNode, name) for name in ("_run_resident", "_run_split")}
    trace = realistic_trace(5, SPEC.layers, SPEC.num_experts, SPEC.top_k, seed=6)
    routing = decode_under_trace(model, trace, "Cold experts under a trace.")
    assert routing.calls == routing.device_calls == 5 * SPEC.layers
    assert_counted_as_traced(engine, trace)
    if path == "both":
        assert engine.stats.totals().misses_cpu > 0
    assert {name: getattr(hybrid_node.HybridExpertNode, name) for name in originals} == originals
