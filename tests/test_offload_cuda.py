"""Hybrid offload on the real GPU (marker gpu: skipped without one)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from engine.generation import LoadedModel
from engine.kernel_warmup import warm_model
from engine.offload import OffloadConfig
from engine.writer import WriterSpec, write_model
from tests.holders import holders
from tests.test_offload import assert_mapped_as_the_cache_holds, greedy_run

pytestmark = pytest.mark.gpu

SPEC = WriterSpec(layers=3, num_experts=16, top_k=4, hidden_size=256, inter_size=256, seed=31, dense_accuracy_level=0)


# The host tier is made only where the dense part runs on the card (decode_path.py): a float16 model (onnxruntime's CUDA
# attention takes no float32 KV cache) with onnxruntime-gpu's CUDA execution provider.
needs_dense_on_gpu = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                        reason="the host tier needs the dense part on the GPU: onnxruntime here offers "
                                               "no CUDAExecutionProvider (install onnxruntime-gpu)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cuda") / "m", SPEC)


@pytest.fixture(scope="module")
def folder16(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cuda16") / "m", dataclasses.replace(SPEC, dtype="float16"))


def device_total(folder) -> int:
    """Every expert in device slots (the GPU kernels' layout: ExpertNodeInfo.device_bytes_per_expert)."""
    return sum(i.device_bytes_per_expert * i.spec.num_experts for i in LoadedModel.open(folder).folder.experts)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cpu_execution", ["auto", "disabled"])
def test_cuda_offload_matches_the_cpu(folder, fraction, cpu_execution):
    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    budget = int(fraction * device_total(folder))
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget, cpu_execution=cpu_execution),
                             device=device)
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors  # GPU tensor-core paths round activations to fp16
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    if fraction == 1.0:
        assert totals.misses == 0 and totals.device_s > 0
    assert device.memory.high_water <= device.memory.ceiling


@needs_dense_on_gpu
@pytest.mark.parametrize("fraction", [0.0, 0.5])
@pytest.mark.parametrize("path", ["tier", "both"])
def test_cuda_host_tier_matches_the_cpu(folder16, fraction, path):
    """OffloadEngine.host_tier: the GPU reads the experts in no slot from page-locked host memory. With the dense part
    on the GPU (onnxruntime-gpu) every decode step routes and computes on the device ("both": the CPU computes a
    share of the cold pairs, published to the host by the routing kernel); either way the all-CPU run's tokens.
    Switched off again, the slots are made without the tier."""
    from engine.offload.cuda_device import open_cuda_device

    folder = folder16
    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=int(fraction * device_total(folder))),
                             device=device)
    assert model.dense_device == "cuda"
    model.offload.set_decode_path(path)
    if path == "both":  # a share for the CPU whatever this machine's rates
        model.offload.cold_split_table = lambda layer: np.array([0, 1, 1, 2, 2])
    assert all(store.reads_cold and store.gpu.host0 is not None for store in model.offload.stores)
    # compiled (or loaded from Numba's cache) before the steps, as the window and the command line do before an answer:
    # a first call inside a "both" step can hold the host past a merge's gate, the likely cause of the gate check
    # below failing in two whole gpu runs (sixty-ninth and seventieth sessions), passing each time when run again
    warm_model(model)
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.routed_on_device >= 8 * SPEC.layers and totals.misses_read > 0
    if path == "both":
        assert totals.misses_cpu > 0 and model.offload.stats.phases["decode"].cpu_s > 0
        # the CPU's parts went through the merges queued at the launches (merge_gated), none of which gave up
        splits = [store._split for store in model.offload.stores]
        assert all(split.merge is not None and split.published.gate_failed() == 0 for split in splits)
    model.offload.set_decode_path("cpu")
    assert not any(store.reads_cold for store in model.offload.stores)
    assert all(store.gpu is None or store.gpu.host0 is None for store in model.offload.stores)


@needs_dense_on_gpu
def test_cuda_default_decode_path_makes_the_tier_and_switches_paths_mid_conversation(folder16):
    """The defaults (decode path auto, cpu_execution auto) at half the experts: the tier is made at load, and the
    trials (driven by given step times: the CPU path faster) move decode from the tier to the CPU path and back
    within one conversation, with the all-CPU run's tokens."""
    from engine.offload.cuda_device import open_cuda_device
    from engine.offload.decode_path import DecodePathTrials

    folder = folder16
    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=12)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_total(folder) // 2),
                             device=open_cuda_device(), decode_path="auto")
    engine = model.offload
    assert model.dense_device == "cuda" and engine.host_tier, engine.plan.statements
    assert engine.decode_path_in_force == "tier", engine.plan.statements
    engine.path_trials = DecodePathTrials(first=1, settle=1, window=2, recheck=2, margin=0.05)
    paths = []

    def end_step(seconds, tokens):
        engine.end_step((0.030 if engine.decode_path_in_force == "tier" else 0.020) if tokens == 1 else seconds,
                        tokens)
        paths.append(engine.decode_path_in_force)

    model.decoder.on_step_end = end_step
    logits, tokens = greedy_run(model, steps=12)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    assert "cpu" in paths and "tier" in paths[3:], paths
    totals = engine.stats.totals()
    assert totals.misses_cpu > 0 and totals.misses_read > 0


def test_cuda_with_the_dense_part_on_the_cpu_makes_no_host_tier(folder):
    """A float32 model's dense part runs on the CPU (the CUDA execution provider's attention takes no float32 KV cache):
    decode's expert inputs never sit on the card, so no decode step could read a host tier. None is made, the plan
    says why, decode path 'tier' is refused with it, and the answer is the all-CPU run's."""
    from engine.errors import WorkbenchError
    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_total(folder) // 2),
                             device=open_cuda_device(), decode_path="auto")
    engine = model.offload
    said = [line for line in engine.plan.statements
            if "no host tier is made, since the dense part runs on the CPU" in line]
    assert model.dense_device == "cpu" and not engine.host_tier and len(said) == 1, engine.plan.statements
    assert all(store.gpu is None or store.gpu.host0 is None for store in engine.stores)
    with pytest.raises(WorkbenchError, match="decode path 'tier': .*no host tier is made, since the dense part runs "
                                             "on the CPU"):
        engine.set_decode_path("tier")
    assert engine.decode_path_mode == "auto" and not engine.host_tier
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]


def test_cuda_mem_limit_is_a_clean_error(folder):
    import gc

    import cupy

    from engine.offload.cuda_device import open_cuda_device
    from engine.offload.device_memory import DeviceMemoryError

    # (CuPy's pool has no limit while any open device has none: conftest closes every earlier gpu test's devices)
    limit = 64 << 10  # far below one layer's experts
    device = open_cuda_device(mem_limit=limit)
    with pytest.raises(DeviceMemoryError):
        device.memory.reserve(limit + 1, "a test allocation")
    assert cupy.get_default_memory_pool().get_limit() == limit
    del device
    gc.collect()
    assert cupy.get_default_memory_pool().get_limit() == 0  # the cap went with the device: later loads are not held to it


@pytest.mark.parametrize("case", ["dense-on-cpu", pytest.param("both", marks=needs_dense_on_gpu),
                                  pytest.param("both-worker", marks=needs_dense_on_gpu)])
def test_cuda_a_dropped_model_closes_its_device_without_a_garbage_collection(folder, folder16, monkeypatch, case):
    """A model dropped takes its CUDA device with it at once: no cycle through the model, its engine, its nodes or the
    device keeps them until a collection (the simulated device's: tests/test_offload.py). A device waiting so keeps
    its cap on CuPy's pool (none: unlimited) and its slots' memory, which the next load's reading of free memory
    misses. "both": each node keeps its latest "both" step (last_split), which held the node (hybrid_node.SplitStep);
    "both-worker": the host-part worker's thread takes the steps' host parts, and ends with the model."""
    import gc
    import weakref

    import cupy

    from engine.offload.cuda_device import open_cuda_device

    both = case.startswith("both")
    if case == "both":  # every "both" step on the engine's thread, through run(), which keeps it (last_split)
        monkeypatch.setattr("engine.decoder.host_part_worker", False)
    folder = folder16 if both else folder
    budget = device_total(folder) // 2
    gc.collect()  # earlier tests' devices, where a collection has yet to find them
    pool = cupy.get_default_memory_pool()
    # (no cap under "both": onnxruntime's GPU arena, registered without one by an earlier test in this process, would
    # refuse a capped model its dense part on the GPU; the cap's going is the dense-on-cpu case's to show)
    before, limit = pool.get_limit(), 0 if both else 8 << 30
    gc.disable()
    try:
        device = open_cuda_device(mem_limit=limit)
        model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget), device=device)
        if both:
            model.offload.set_decode_path("both")
            assert model.dense_device == "cuda" and model.offload.decode_path_in_force == "both"
            model.offload.cold_split_table = lambda layer: np.array([0, 1, 1, 2, 2])  # a share for the CPU
        warm_model(model)
        greedy_run(model, steps=4)
        nodes = [runner for runner in model.decoder.steps if getattr(runner, "last_split", None) is not None]
        assert len(nodes) == (SPEC.layers if case == "both" else 0)
        assert (model.decoder.layers_beside > 0) == (case == "both-worker")
        assert pool.get_limit() == limit  # (0: none while an open device has no cap)
        thread = model.decoder._worker._thread if case == "both-worker" else None
        dropped = [weakref.ref(held) for held in (model, model.offload, device, *nodes)]
        del model, device, nodes
        alive = [ref() for ref in dropped if ref() is not None]
        assert not alive, f"{type(alive[0]).__name__} outlived its drop: {holders(alive[0], skip=(alive,))}"
        assert pool.get_limit() == before  # the device's cap went with it
        if thread is not None:  # the host-part worker's
            thread.join(10)  # (its loop returns after IDLE_S idle, then lets the worker go)
            assert not thread.is_alive()
    finally:
        gc.enable()


@pytest.fixture
def no_registration(monkeypatch):
    """Expert copies through the pinned staging ring: the experts' mapping is not page-locked (host_register.py)."""
    from engine.offload.cuda_device import CudaDevice

    monkeypatch.setattr(CudaDevice, "register_experts", lambda self, source, infos, owner: None)


def test_cuda_misses_copied_into_spare_slots_match_the_cpu(folder, no_registration):
    """A (pretended) very slow CPU: the miss policy copies misses into spare slots through the
    pinned ring on the copy stream, computed on the GPU in the same step."""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    assert device.bandwidths.cpu > 1e9  # measured at start, not the default
    device.bandwidths = replace(device.bandwidths, cpu=1e3)
    budget = device_total(folder) // 2
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget, placement="static"), device=device)
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.miss_copies > 0 and totals.misses_cpu + totals.misses_copied == totals.misses
    ring = device.pinned
    assert ring.kind == "pinned" and ring.copies > 0 and 0 < ring.high_water <= ring.capacity


def test_cuda_waves_through_a_one_expert_pinned_ring(folder, no_registration):
    """Prefill streams every cold expert through a ring that holds one expert: the CPU's logits up to fp16
    rounding. Compared per position: on the H200, 5 of these 127 positions differ by 4-16% from the CPU,
    with this ring and with the automatic one alike (the same positions, the same values): there rounding
    flips a near-tied routing choice of the random weights."""
    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    prompt = reference.tokenizer.encode(" ".join(["many tokens make the prompt long enough to stream experts"] * 6))
    expected = reference.decoder.forward(reference.new_state(), prompt)
    device = open_cuda_device()
    probe = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=device)
    one = max(device.staging_bytes_per_expert(runner) for runner in probe.offload.runners)
    probe.offload.reconfigure(probe.offload.config.updated(pinned_bytes=one, cpu_execution="disabled"))
    assert probe.offload.wave_experts == 1 and device.pinned.capacity == one
    logits = probe.decoder.forward(probe.new_state(), prompt)
    errors = np.abs(logits - expected).max(axis=1) / np.abs(expected).max()
    assert np.median(errors) < 2e-3 and np.mean(errors < 2e-2) > 0.9, np.sort(errors)[-8:]
    assert device.pinned.copies > 0 and device.pinned.high_water <= one
    assert probe.offload.stats.totals().misses_cpu == 0


def test_cuda_copies_from_the_registered_mapping_match_the_cpu(folder):
    """With the experts' mapping page-locked, misses copied into spare slots (a pretended very slow CPU) and prefill
    waves (no CPU execution) go over straight from it, converted on the GPU: the pinned ring is not used, and the
    logits are the CPU's up to fp16 rounding (per position for the prefill, as with the ring)."""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    ref_logits, ref_tokens = greedy_run(reference, steps=8)
    device = open_cuda_device()
    device.bandwidths = replace(device.bandwidths, cpu=1e3)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_total(folder) // 2,
                                                           placement="static"), device=device)
    assert model.host_registration.ready.wait(60) and model.host_registration.registered, \
        model.host_registration.describe()
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.miss_copies > 0 and device.pinned.copies == 0
    prompt = reference.tokenizer.encode(" ".join(["many tokens make the prompt long enough to stream experts"] * 6))
    expected = reference.decoder.forward(reference.new_state(), prompt)
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=0, cpu_execution="disabled"))
    waves = model.decoder.forward(model.new_state(), prompt)
    errors = np.abs(waves - expected).max(axis=1) / np.abs(expected).max()
    assert np.median(errors) < 2e-3 and np.mean(errors < 2e-2) > 0.9, np.sort(errors)[-8:]
    assert model.offload.stats.totals().misses_cpu == totals.misses_cpu and device.pinned.copies == 0


@pytest.mark.parametrize("layout", [dict(quant_type="nvfp4"), dict(bits=2, block_size=32), dict(bits=4, fc2_bits=8)],
                         ids=["nvfp4", "int2", "mixed-4-8"])
def test_cuda_converted_layouts_are_budgeted_at_their_slot_size(tmp_path, layout):
    """Layouts the kernels convert on upload: the engine's CuPy-free slot size is what GpuQMoE allocates, the
    plan holds floor(budget / slot) experts, misses copied through the ring and prefill waves work."""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    folder = write_model(tmp_path / "m", replace(SPEC, **layout))
    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=6)
    device = open_cuda_device()
    device.bandwidths = replace(device.bandwidths, cpu=1e3)  # misses are copied into spare slots
    infos = LoadedModel.open(folder).folder.experts
    slot = infos[0].device_bytes_per_expert
    assert slot > infos[0].bytes_per_expert
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=20 * slot + slot // 2,
                                                           placement="static"), device=device)
    assert sum(model.offload.plan.slots.values()) == 20
    for store, info in zip(model.offload.stores, infos):
        assert store.gpu.expert_device_bytes() == info.device_bytes_per_expert == store.expert_bytes
        assert store.gpu.expert_bytes() == info.gpu.read_bytes
    logits, tokens = greedy_run(model, steps=6)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:3] == ref_tokens[:3]
    assert model.offload.stats.totals().miss_copies > 0


def test_cuda_fp8_runs_on_the_cpu_in_auto_and_is_refused_in_required(tmp_path):
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device
    from engine.offload.planner import OffloadPlanError

    folder = write_model(tmp_path / "m", replace(SPEC, quant_type="fp8", block_size=32))
    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=4)
    device = open_cuda_device()
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=1 << 30), device=device)
    assert set(model.offload.plan.slots.values()) == {0}
    assert any("fp8" in line for line in model.offload.plan.statements)
    logits, tokens = greedy_run(model, steps=4)
    assert tokens == ref_tokens
    with pytest.raises(OffloadPlanError, match="fp8"):
        LoadedModel.open(folder, offload=OffloadConfig(mode="required"), device=open_cuda_device())


@pytest.mark.parametrize("registered", [True, False], ids=["registered-mapping", "pinned-ring"])
def test_cuda_zero_budget_streams_misses_through_the_shared_slots(folder, monkeypatch, registered):
    """A zero expert budget and a (pretended) very slow CPU: every decode miss of every layer goes through the
    shared streaming slots (engine/offload/streaming.py), one layer after another overwriting them; the logits
    are the CPU's up to fp16 rounding."""
    from dataclasses import replace

    from engine.offload.cuda_device import CudaDevice, open_cuda_device

    if not registered:
        monkeypatch.setattr(CudaDevice, "register_experts", lambda self, source, infos, owner: None)
    reference = LoadedModel.open(folder)
    ref_logits, ref_tokens = greedy_run(reference, steps=8)
    device = open_cuda_device()
    device.bandwidths = replace(device.bandwidths, cpu=1e3)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0, device_working_bytes=1 << 30),
                             device=device)
    if registered:
        assert model.host_registration.ready.wait(60) and model.host_registration.registered
    group = model.offload.streaming.groups[0]
    assert group.num_slots == SPEC.top_k
    assert device.memory.by_purpose["decode streaming slots"] == SPEC.top_k * group.slot_bytes
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.hits == 0 and totals.miss_copies > 0
    assert (device.pinned.copies == 0) == registered
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=device_total(folder)))
    assert model.offload.streaming.groups == [] and device.memory.by_purpose["decode streaming slots"] == 0


@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["streaming-slots", "spare-slots"])
def test_cuda_copies_leave_a_bounded_host_cache_bounded(folder, fraction):
    """Under host_expert_bytes, the weight file's pages that copies to the GPU read on the host (GpuQMoE.pack_expert
    into the pinned ring for misses copied into slots or the streaming slots, gather_wave for prefill waves) leave
    this process once read, unless the host cache holds the expert; the logits are the CPU's up to fp16 rounding.
    (tests/test_cuda_slots_standin.py checks the same on the CPU stand-in, whose copies do not run GpuQMoE's.)"""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    ref_logits, ref_tokens = greedy_run(reference, steps=8)
    device = open_cuda_device()
    per_expert = reference.folder.experts[0].bytes_per_expert
    model = LoadedModel.open(folder, device=device, offload=OffloadConfig(
        device_expert_bytes=int(fraction * device_total(folder)), host_expert_bytes=4 * per_expert,
        device_working_bytes=1 << 30, prefill_wave_experts=4))
    assert model.host_registration is None and device.pinned is not None  # bounded: copies go through the ring
    greedy_run(model, steps=8)  # the CPU's share of the misses fills the cache
    device.bandwidths = replace(device.bandwidths, cpu=1e3)  # from now on every miss that can be is copied
    before = model.offload.stats.totals()
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    totals = model.offload.stats.totals()
    assert totals.miss_copies > before.miss_copies and totals.copy_bytes > before.copy_bytes
    assert_mapped_as_the_cache_holds(model)


def test_cuda_a_bound_set_on_the_loaded_model_unregisters_the_experts_mapping(folder):
    """Loaded with host memory unbounded, the experts' mapping is page-locked and copies go straight from it; a
    host_expert_bytes bound set on the loaded model unregisters it first (locked pages stay in memory whatever the
    bounded cache's madvise says): copies go through the pinned ring again, the weight file's mapped pages are those
    the cache holds, and the logits are the CPU's up to fp16 rounding. (tests/test_cuda_slots_standin.py checks the
    same, and a bound set while the registration still runs, on the CPU stand-in.)"""
    from dataclasses import replace

    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    ref_logits, ref_tokens = greedy_run(reference, steps=8)
    device = open_cuda_device()
    model = LoadedModel.open(folder, device=device, offload=OffloadConfig(
        device_expert_bytes=device_total(folder) // 2, device_working_bytes=1 << 30, prefill_wave_experts=4))
    registration = model.host_registration
    assert registration.ready.wait(60) and registration.registered
    per_expert = reference.folder.experts[0].bytes_per_expert
    model.offload.reconfigure(model.offload.config.updated(host_expert_bytes=4 * per_expert))
    assert device.host_registration is None and not registration.registered
    assert model.prefault.done.is_set()
    greedy_run(model, steps=8)  # the CPU's share of the misses fills the cache
    device.bandwidths = replace(device.bandwidths, cpu=1e3)  # from now on every miss that can be is copied
    copies = device.pinned.copies
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    assert device.pinned.copies > copies
    assert_mapped_as_the_cache_holds(model)


def test_cuda_every_expert_made_resident_unregisters_the_experts_mapping(folder):
    """A budget that makes every expert resident on a model loaded hybrid: nothing reads the experts' mapping, so its
    registration is undone (its pages no longer locked in RAM), and the logits stay the CPU's up to fp16 rounding;
    back to hybrid, the mapping is page-locked again."""
    from engine.offload.cuda_device import open_cuda_device

    reference = LoadedModel.open(folder)
    ref_logits, ref_tokens = greedy_run(reference, steps=8)
    device = open_cuda_device()
    model = LoadedModel.open(folder, device=device, offload=OffloadConfig(device_expert_bytes=device_total(folder) // 2))
    registration = model.host_registration
    assert registration.ready.wait(60) and registration.registered
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=2 * device_total(folder)))
    assert model.offload.plan.placement_mode == "all_resident"
    assert device.host_registration is None and not registration.registered
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4] and model.offload.stats.totals().misses == 0
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=device_total(folder) // 2))
    again = model.host_registration  # back to hybrid: page-locked again, for the copies
    assert again is device.host_registration and again.ready.wait(60) and again.registered
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits)]
    assert max(errors) < 2e-2, errors


def test_cuda_whole_layers_and_back_match_the_cpu(folder):
    """The layer split on real CUDA slots, the dense part on the CPU: half the budget on whole layers (one layer with
    every expert, routed on the device's slots; the others all on the CPU), then spread again, on one loaded model."""
    from engine.offload.cuda_device import open_cuda_device

    reference, ref_tokens = greedy_run(LoadedModel.open(folder), steps=8)
    device = open_cuda_device()
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_total(folder) // 2),
                             device=device, layer_split="whole")
    engine = model.offload
    num_experts = SPEC.num_experts
    assert sorted(layer.num_slots for layer in engine.slots) == [0, 0, num_experts]
    for split in ("whole", "spread"):
        engine.set_layer_split(split)
        logits, tokens = greedy_run(model, steps=8)
        errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
        assert max(errors) < 2e-2, (split, errors)
        assert tokens[:4] == ref_tokens[:4]
    assert engine.whole_layers is False and all(0 < layer.num_slots < num_experts for layer in engine.slots)
    assert device.memory.high_water <= device.memory.ceiling


@needs_dense_on_gpu
@pytest.mark.parametrize("failing", ["_plan_streaming", "_make_policy"])
def test_cuda_a_replan_that_fails_after_its_stores_are_made_leaves_the_configuration_in_force(folder16, monkeypatch,
                                                                                              failing):
    """On the card, with the host tier: a re-plan that fails once its stores are made (the driver failing the
    streaming slots or the placement's copies) puts the configuration in force back whole (test_offload has the
    simulated device's cases): the same plan, residents and slot counts, the tier made again from the host rows,
    the device's bytes as before, and answers within the GPU's tolerance of the all-CPU run."""
    from engine.offload.cuda_device import open_cuda_device
    from engine.offload.engine import OffloadEngine

    reference, ref_tokens = greedy_run(LoadedModel.open(folder16), steps=8)
    device = open_cuda_device()
    model = LoadedModel.open(folder16, offload=OffloadConfig(device_expert_bytes=device_total(folder16) // 2),
                             device=device, decode_path="tier")
    engine = model.offload
    assert engine.host_tier and engine.decode_path_in_force == "tier", engine.plan.statements
    greedy_run(model, steps=4)  # (routing placed the residents)

    def state():
        return (engine.config, engine.plan, engine.host_tier, engine.decode_path_in_force,
                [layer.expert_in.tolist() for layer in engine.slots], [store.num_slots for store in engine.stores],
                device.memory.used)

    before, real, raised = state(), getattr(OffloadEngine, failing), []
    error = RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

    def fails_once(self, *args, **kwargs):
        if not raised:
            raised.append(failing)
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(OffloadEngine, failing, fails_once)
    with pytest.raises(RuntimeError) as failed:
        engine.reconfigure(engine.config.updated(device_expert_bytes=device_total(folder16) // 4), decode_path="cpu")
    assert failed.value is error and raised == [failing]
    assert state() == before
    assert all(store.reads_cold for store in engine.stores)  # (the tier's GpuQMoE made again on every node)
    read = engine.stats.totals().misses_read
    logits, tokens = greedy_run(model, steps=8)
    errors = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, reference)]
    assert max(errors) < 2e-2, errors
    assert tokens[:4] == ref_tokens[:4]
    assert engine.stats.totals().misses_read > read  # (decode read the restored tier)
    assert device.memory.high_water <= device.memory.ceiling
