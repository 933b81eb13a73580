"""onnxruntime's GPU arena for the dense parts: one per GPU for the life of the process
(ort_env.register_shared_cuda_arena), registered at the first model's size. Models loaded later (a reload, side-by-side's B) under gpu_device_mem_limit use
it where their limit leaves them at least that much, and count that much against their limit; otherwise their dense
part stays on the CPU, saying that the arena registered earlier is the reason.

onnxruntime here has no CUDA execution provider: a stand-in for its registration call keeps the arenas registered
and refuses a second one for a device, as onnxruntime's env does (no Python call removes or replaces one).
"""

from __future__ import annotations

from types import SimpleNamespace

import onnxruntime as ort
import pytest

import engine.array_backend as array_backend
import engine.ort_env as ort_env
from engine.offload.device_memory import DeviceMemory

GIB, MIB = 1 << 30, 1 << 20
STATE, WEIGHTS = 256 * MIB, 768 * MIB  # the KV cache and state at full context, the dense weights
LIMIT = 8 * GIB


@pytest.fixture
def onnxruntime_env(monkeypatch):
    """{device id: max_mem} of the arenas registered with the stand-in of onnxruntime's env, and each call made."""
    env = SimpleNamespace(arenas={}, calls=[])

    def create_and_register_allocator_v2(provider, info, provider_options, arena_cfg):
        device = int(provider_options["device_id"])
        env.calls.append((provider, device, arena_cfg.max_mem))
        if device in env.arenas:  # onnxruntime's Environment::RegisterAllocatorImpl
            raise RuntimeError("Error when creating and registering allocator in create_and_register_allocator_v2: "
                               "An allocator for this device has already been registered for sharing.")
        env.arenas[device] = arena_cfg.max_mem

    monkeypatch.setattr(ort, "create_and_register_allocator_v2", create_and_register_allocator_v2)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort_env, "cuda_libraries_missing", lambda: None)
    monkeypatch.setattr(ort_env, "_shared_arenas", {})  # a fresh process
    monkeypatch.setattr(array_backend, "cupy_backend", lambda index: SimpleNamespace(stream_pointer=0))
    return env


def load(limit: int, slots: int, index: int = 0) -> tuple[ort_env.DenseDevice, DeviceMemory]:
    """What LoadedModel does on a GPU: the expert slots (the plan) first, then the dense part's device, and under a
    limit the dense part counted against it (arena included)."""
    device = SimpleNamespace(kind="cuda", index=index, name="fake GPU",
                             memory=DeviceMemory(capacity=80 * GIB, limit=limit))
    device.memory.reserve(slots, "expert slots")
    dense = ort_env.choose_dense_device(device, STATE, WEIGHTS)
    if dense.kind == "cuda" and limit:
        device.memory.reserve(STATE + WEIGHTS + dense.arena_limit, "dense part")
    return dense, device.memory


def test_a_later_model_whose_limit_leaves_more_shares_the_arena_registered_first(onnxruntime_env):
    """Side by side at one gpu_device_mem_limit: A keeps 6 GiB of experts (its limit leaves the arena 1 GiB), B 4 GiB
    (3 GiB). B's dense part goes to the GPU on A's arena, capped at 1 GiB, and B counts 1 GiB for it: its other 2 GiB
    stay free for its experts."""
    a, _ = load(LIMIT, 6 * GIB)
    b, b_memory = load(LIMIT, 4 * GIB)
    assert (a.kind, a.arena_limit) == ("cuda", 1 * GIB)
    assert (b.kind, b.arena_limit) == ("cuda", 1 * GIB), b.reason
    assert onnxruntime_env.calls == [("CUDAExecutionProvider", 0, 1 * GIB)]  # registered once, A's size
    assert b.providers()[0][1]["gpu_mem_limit"] == str(1 * GIB)
    assert b_memory.used == 4 * GIB + STATE + WEIGHTS + 1 * GIB and b_memory.available == 2 * GIB
    assert "onnxruntime's arena is capped at 1.0 GiB" in b.statement
    assert b.arena_left == 3 * GIB
    assert "registered at that size by a model loaded earlier in this process" in b.statement
    assert "gpu_device_mem_limit left 3.0 GiB for it" in b.statement
    again, _ = load(LIMIT, 6 * GIB)  # A reloaded as it was: the arena is its own size
    assert (again.kind, again.arena_limit, again.arena_left) == ("cuda", 1 * GIB, None)
    assert "earlier" not in again.statement


def test_a_later_model_whose_limit_leaves_less_keeps_its_dense_part_on_the_cpu_and_says_why(onnxruntime_env):
    """A keeps 4 GiB of experts (arena 3 GiB), B 6 GiB: B's limit leaves 1 GiB, less than the arena it would share, so
    onnxruntime could take more of the GPU for B than B's limit allows. B's reason names the arena and both sizes, not
    another gpu_device_mem_limit (B's is A's)."""
    load(LIMIT, 4 * GIB)
    b, b_memory = load(LIMIT, 6 * GIB)
    assert b.kind == "cpu"
    assert b.reason == (
        "onnxruntime's GPU arena on device 0 was registered at 3.0 GiB by a model loaded earlier in this process, and "
        "onnxruntime keeps it at that size until the process ends; this model's gpu_device_mem_limit=8589934592 leaves "
        "it 1.0 GiB after the expert slots, staging, state and dense weights, 2.0 GiB short (lower "
        "device_expert_bytes, or restart and load this model first)")
    assert b_memory.used == 6 * GIB  # nothing counted for a dense part on the CPU
    assert len(onnxruntime_env.calls) == 1


def test_an_arena_registered_without_a_cap_cannot_hold_a_capped_model(onnxruntime_env):
    """A model without gpu_device_mem_limit registers the arena without a cap: a capped model after it would have no
    bound on what onnxruntime takes, so its dense part stays on the CPU, saying so."""
    first, _ = load(0, 6 * GIB)
    assert (first.kind, first.arena_limit) == ("cuda", 0) and onnxruntime_env.arenas == {0: 0}
    capped, _ = load(LIMIT, 4 * GIB)
    assert capped.kind == "cpu"
    assert capped.reason == (
        "onnxruntime's GPU arena on device 0 was registered without a cap by a model loaded earlier in this process "
        "without gpu_device_mem_limit, and onnxruntime keeps it until the process ends; it cannot hold this model to "
        "gpu_device_mem_limit=8589934592 (restart and load this model first)")


def test_a_model_without_a_limit_uses_a_capped_arena_and_says_so(onnxruntime_env):
    load(LIMIT, 6 * GIB)
    plain, _ = load(0, 6 * GIB)
    assert (plain.kind, plain.arena_limit) == ("cuda", 1 * GIB)
    assert "capped at 1.0 GiB (registered at that size by a model loaded earlier in this process" in plain.statement
    assert "this model has no gpu_device_mem_limit" in plain.statement


def test_each_gpu_has_its_own_arena(onnxruntime_env):
    load(LIMIT, 6 * GIB, index=0)
    other, _ = load(LIMIT, 4 * GIB, index=1)
    assert (other.kind, other.arena_limit) == ("cuda", 3 * GIB)
    assert onnxruntime_env.arenas == {0: 1 * GIB, 1: 3 * GIB}


def test_a_registration_onnxruntime_refuses_is_one_line_and_registers_nothing(onnxruntime_env, monkeypatch):
    def refuse(*args):
        raise RuntimeError("CUDA failure 2: out of memory\nGPU=0 file=cuda_call.cc")

    monkeypatch.setattr(ort, "create_and_register_allocator_v2", refuse)
    dense, _ = load(LIMIT, 6 * GIB)
    assert dense.kind == "cpu"
    assert dense.reason == "onnxruntime cannot make its GPU arena on device 0: CUDA failure 2: out of memory"
    assert ort_env._shared_arenas == {}


def test_loaded_models_count_the_arena_in_force_against_their_limit(onnxruntime_env, monkeypatch):
    """Two LoadedModels of one model at one limit, the second with 300 MiB less taken on its device (a smaller expert
    plan): both dense parts go to the GPU, and each counts the arena in force (the first's) with its state and dense
    weights, so the second's limit keeps 300 MiB free for its experts. (The fixtures' KV caches are fp32, which
    onnxruntime's CUDA attention refuses, and onnxruntime here cannot make CUDA sessions: both are stood in for.)"""
    from engine.decoder import PartitionedDecoder
    from engine.generation import LoadedModel
    from tests.conftest import fixture_folder

    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)
    monkeypatch.setattr(PartitionedDecoder, "open_dense", lambda self, dense: setattr(self, "dense", dense))
    models = []
    for taken in (600 * MIB, 300 * MIB):
        device = SimpleNamespace(kind="cuda", index=0, name="fake GPU", memory=DeviceMemory(80 * GIB, 1 * GIB))
        device.memory.reserve(taken, "expert slots")
        models.append((LoadedModel.open(fixture_folder("gptoss"), device=device), device.memory))
    (first, first_memory), (second, second_memory) = models
    assert (first.dense_device, second.dense_device) == ("cuda", "cuda"), second.dense_reason
    arena = first.dense.arena_limit
    assert second.dense.arena_limit == arena and second.dense.arena_left == arena + 300 * MIB
    assert onnxruntime_env.arenas == {0: arena}
    assert first_memory.available == 0 and second_memory.available == 300 * MIB
    dense_part = second_memory.by_purpose["dense part (onnxruntime arena, dense weights, KV cache and state)"]
    assert dense_part == second.dense.state_bytes + second.folder.dense_bytes + arena


def test_the_budget_estimate_names_an_arena_registered_earlier_that_would_keep_the_dense_part_on_the_cpu(
        onnxruntime_env, monkeypatch):
    """The budget panel's estimate, before a load, for a capped configuration: where a model loaded earlier in this
    process registered the GPU's arena at more than this configuration's limit leaves it, the load keeps the dense part
    on the CPU, which the estimate said only as "would run on the GPU". Now it says so with the load's own reason (the
    same sums: ort_env.dense_arena) and shows the dense part in host memory, registering nothing itself; so too where
    the limit leaves the dense part too little whatever the arena. The loads
    here are the fixture model's on a simulated GPU that says it is a CUDA one (onnxruntime here cannot make CUDA
    sessions; its fp32 KV caches, which the CUDA EP refuses, are stood in for)."""
    from app.gui.estimate import DeviceChoice, estimate, model_facts
    from app.inspect_report import inspection
    from engine.decoder import PartitionedDecoder
    from engine.generation import LoadedModel
    from engine.model_folder import ModelFolder
    from engine.offload import OffloadConfig, SimulatedDevice
    from tests.conftest import fixture_folder

    monkeypatch.setattr(ort_env, "kv_dtype_reason", lambda kv_dtypes: None)
    monkeypatch.setattr(PartitionedDecoder, "open_dense", lambda self, dense: setattr(self, "dense", dense))
    folder = ModelFolder.open(fixture_folder("gptoss"))
    facts = model_facts(folder, inspection(folder))
    slot = facts.experts[0].device_bytes_per_expert
    card = DeviceChoice("cuda", 1 * GIB, name="test card")
    limit = 80 * MIB

    def config(experts: int, limit: int = limit) -> OffloadConfig:
        return OffloadConfig(device_expert_bytes=experts * slot, gpu_device_mem_limit=limit, placement="static")

    def loaded(experts: int, limit: int = limit) -> LoadedModel:
        device = SimulatedDevice(card.capacity, mem_limit=limit, name=card.label)
        device.kind, device.index = "cuda", 0
        return LoadedModel.open(fixture_folder("gptoss"), offload=config(experts, limit), device=device,
                                decode_path="cpu")

    def dense_said(experts: int, limit: int = limit, card: DeviceChoice = card) -> tuple[str, dict]:
        est = estimate(facts, config(experts, limit), card)
        said = [s for s in est.statements if "dense part" in s]
        assert len(said) == 1 and not est.error
        return said[0], {p.key: p.bytes for p in est.host_parts}

    on_gpu = ("The dense part would run on the GPU with onnxruntime's CUDA execution provider, its KV cache and state "
              "in GPU memory.")
    assert dense_said(10)[0] == on_gpu  # no arena yet: the load registers one at what this limit leaves it
    assert onnxruntime_env.calls == []  # the estimate registered nothing
    first = loaded(2)  # a model loaded earlier (Side by side's A, or this one before a reload): its arena stays
    assert first.dense_device == "cuda" and len(onnxruntime_env.calls) == 1
    assert dense_said(2)[0] == on_gpu  # as loaded: the arena is its size
    busy = DeviceChoice("cuda", 1 * GIB, others_bytes=4 * MIB, name="test card")  # other processes' memory is not
    assert dense_said(2, card=busy)[0] == on_gpu                                    # the limit's (CudaDevice counts)
    said, host = dense_said(10)  # eight more experts leave the arena 8 slots less than registered
    later = loaded(10)
    assert later.dense_device == "cpu"
    assert said == f"Loaded with these settings, the dense part would stay on the CPU: {later.dense_reason}."
    assert said.startswith("Loaded with these settings, the dense part would stay on the CPU: onnxruntime's GPU arena "
                           "on device 0 was registered at ")
    assert f"{ort_env.human_bytes(8 * slot)} short" in said
    assert host["dense"] == facts.dense_bytes and host["kv"] == facts.kv_cache_bytes()  # in host memory, as loaded
    # a limit that leaves the dense part too little whatever the arena: the load's other reason, said as well
    said, _ = dense_said(2, 64 * MIB)
    tight = loaded(2, 64 * MIB)
    assert tight.dense_device == "cpu"
    assert said == f"Loaded with these settings, the dense part would stay on the CPU: {tight.dense_reason}."
    assert "gpu_device_mem_limit=67108864 leaves " in said
    assert len(onnxruntime_env.calls) == 1
