"""Where decode computes cold experts (engine/offload/decode_path.py): when a host tier is wanted, made or refused
and what the user is told, and the trials between the tier and the CPU path. The engine's use of them: the stand-in
CUDA tests (test_cuda_slots_standin.py) and the GPU tests (test_offload_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.errors import WorkbenchError
from engine.offload import OffloadConfig
from engine.offload import decode_path as paths
from engine.offload.decode_path import (DecodePathTrials, HostGap, checked_path, tier_bytes, tier_verdict,
                                        tier_wanted)

GIB = 1 << 30


def node(name: str, experts: int = 8, slot_bytes: int = GIB // 8, gpu: bool = True):
    """An expert node's facts as the decode path reads them (ExpertNodeInfo's name, spec and gpu footprint)."""
    return SimpleNamespace(name=name, spec=SimpleNamespace(num_experts=experts),
                           gpu=SimpleNamespace(slot_bytes=slot_bytes) if gpu else None)


NODES = [node("a"), node("b"), node("c", gpu=False)]  # c: a layout the GPU kernels do not run (no tier row)
HALF = {"a": 4, "b": 4, "c": 0}


@pytest.mark.parametrize("mode, mode_key, cpu_execution, wanted", [
    ("auto", "auto", "auto", True), ("auto", "auto", "disabled", True), ("auto", "auto", "enabled", False),
    ("auto", "disabled", "auto", False), ("cpu", "auto", "auto", False), ("tier", "auto", "enabled", True),
    ("both", "auto", "enabled", True)])
def test_a_tier_is_wanted_from_the_decode_path_and_cpu_execution(mode, mode_key, cpu_execution, wanted):
    assert tier_wanted(mode, OffloadConfig(mode=mode_key, cpu_execution=cpu_execution)) is wanted


def test_a_tier_holds_every_expert_of_the_nodes_the_gpu_runs():
    assert tier_bytes(NODES) == 2 * 8 * (GIB // 8) == 2 * GIB


def test_the_verdict_makes_a_tier_where_the_host_spares_it_and_says_why_not_elsewhere():
    auto = OffloadConfig()
    assert tier_verdict("auto", auto, NODES, HALF, "cuda", 5 * GIB) == (True, "")
    made, said = tier_verdict("auto", auto, NODES, HALF, "cuda", 3 * GIB)  # 2 GiB > half of 3
    assert not made and said == ("Cold experts are computed on the CPU: no host tier is made, since its 2.0 GiB of "
                                 "page-locked experts exceed 50% of the host memory available (3.0 GiB).")
    assert tier_verdict("tier", auto, NODES, HALF, "cuda", 3 * GIB) == (True, "")  # asked for: the memory alone
    assert tier_verdict("both", OffloadConfig(pinned_bytes=64 << 20), NODES, HALF, "cuda", 3 * GIB) == (True, "")
    made, said = tier_verdict("tier", auto, NODES, HALF, "cuda", GIB)
    assert not made and said.endswith("its 2.0 GiB of page-locked experts exceed the host memory available "
                                      "(1.0 GiB).")
    made, said = tier_verdict("auto", OffloadConfig(pinned_bytes=64 << 20), NODES, HALF, "cuda", 100 * GIB)
    assert not made and "pinned_bytes=67108864 bounds page-locked memory to the staging ring, and the tier pins " \
                        "2.0 GiB" in said
    # every expert resident, or no device, or a tier not wanted: nothing made and nothing said
    assert tier_verdict("auto", auto, NODES, {"a": 8, "b": 8, "c": 0}, "cuda", 100 * GIB) == (False, "")
    assert tier_verdict("auto", auto, NODES, HALF, None, 100 * GIB) == (False, "")
    assert tier_verdict("cpu", auto, NODES, HALF, "cuda", 100 * GIB) == (False, "")
    # the simulated device simulates a tier by the same rule (its bytes counted, its reads priced)
    assert tier_verdict("auto", auto, NODES, HALF, "simulated", 5 * GIB) == (True, "")
    assert tier_verdict("auto", auto, NODES, HALF, "simulated", 3 * GIB)[0] is False


def test_a_bounded_host_cache_refuses_a_tier_that_pins_more_than_its_bound():
    """host_expert_bytes bounds the experts' share of host memory (RAM smaller than the model): a tier pinning every
    expert there was made all the same (531 MiB under host_expert_bytes=50000000). Asked for, the tier is the user's
    own choice, as beside an explicit pinned_bytes."""
    bounded = OffloadConfig(host_expert_bytes=GIB)
    made, said = tier_verdict("auto", bounded, NODES, HALF, "cuda", 100 * GIB)
    assert not made and said == ("Cold experts are computed on the CPU: no host tier is made, since "
                                 "host_expert_bytes=1073741824 bounds the experts' host memory, and the tier pins "
                                 "2.0 GiB.")
    assert tier_verdict("auto", OffloadConfig(host_expert_bytes=2 * GIB), NODES, HALF, "cuda", 100 * GIB) == (True, "")
    assert tier_verdict("tier", bounded, NODES, HALF, "cuda", 100 * GIB) == (True, "")


def test_a_tier_refused_under_cpu_execution_disabled_says_cold_experts_are_copied_in():
    """Under cpu_execution=disabled the CPU computes no expert: without the tier the misses are copied to the device.
    A refused tier said "Cold experts are computed on the CPU" beside the plan's "copied to the device before they
    run"."""
    made, said = tier_verdict("auto", OffloadConfig(cpu_execution="disabled"), NODES, HALF, "cuda", 3 * GIB)
    assert not made and said == ("Cold experts are copied to the device before they run: no host tier is made, since "
                                 "its 2.0 GiB of page-locked experts exceed 50% of the host memory available (3.0 GiB).")
    assert paths.without_tier(OffloadConfig()) == "Cold experts are computed on the CPU"


def test_the_preview_says_the_host_memory_a_tier_would_pin(monkeypatch):
    monkeypatch.setattr(paths, "host_available", lambda: 100 * GIB)
    assert paths.tier_preview("auto", OffloadConfig(), NODES, HALF, "cuda") == (True,
        "Decode can also read cold experts on the GPU from a host tier of 2.0 GiB of page-locked host memory: while "
        "decoding the engine times that against the CPU and against both at once, and keeps the fastest.")
    assert paths.tier_preview("auto", OffloadConfig(cpu_execution="disabled"), NODES, HALF, "cuda") == (True,
        "Instead, decode reads cold experts on the GPU from a host tier of 2.0 GiB of page-locked host memory "
        "(cpu_execution=disabled).")
    assert paths.tier_preview("both", OffloadConfig(), NODES, HALF, "cuda") == (True,
        "Instead, decode reads cold experts on the GPU from a host tier of 2.0 GiB of page-locked host memory while "
        "the CPU computes a share of them, as asked (decode path 'both').")
    monkeypatch.setattr(paths, "host_available", lambda: GIB)
    made, said = paths.tier_preview("auto", OffloadConfig(), NODES, HALF, "cuda")
    assert not made and said.startswith("Cold experts are computed on the CPU: no host tier is made, since its 2.0 GiB")


def test_the_trials_keep_the_tier_unless_another_path_is_the_fastest_by_the_margin():
    trials = DecodePathTrials(first=0, settle=0, window=2, recheck=100, margin=0.05)
    asked = [trials.step(seconds, 1) for seconds in (0.020, 0.020, 0.0195, 0.0195, 0.0192, 0.0192, 0.021, 0.021)]
    # tier, cpu, both, tier again: neither the CPU path nor both 5% faster than the tier's faster window
    assert asked == [None, "cpu", None, "both", None, "tier", None, None]
    assert trials.choice == "tier" and trials.measured == {
        "tier": pytest.approx(0.020), "cpu": pytest.approx(0.0195), "both": pytest.approx(0.0192)}
    trials = DecodePathTrials(first=0, settle=0, window=1, recheck=100, margin=0.05)
    asked = [trials.step(seconds, 1) for seconds in (0.030, 0.020, 0.025, 0.030)]
    assert asked == ["cpu", "both", "tier", "cpu"] and trials.choice == "cpu" and trials.trials == 1  # the fastest
    assert trials.step(0.5, 12) is None  # a prefill step is not timed
    trials.wait = trials._skip = 0  # the next trial at once, from the CPU path: cpu, tier, both, cpu
    asked = [trials.step(seconds, 1) for seconds in (0.020, 0.030, 0.010, 0.021)]
    assert asked == ["tier", "both", "cpu", "both"] and trials.choice == "both"


def test_an_unknown_decode_path_is_named():
    with pytest.raises(WorkbenchError, match="decode path 'gpu': one of auto, cpu, tier, both"):
        checked_path("gpu")


def test_an_empty_moe_decode_path_is_unset(monkeypatch):
    """`MOE_DECODE_PATH=` (empty, as a shell leaves a variable cleared so) was taken as the path '' and refused as an
    unknown one; it is unset: auto, as with no variable at all."""
    monkeypatch.setenv("MOE_DECODE_PATH", "")
    assert checked_path(paths.default_decode_path()) == "auto"
    monkeypatch.delenv("MOE_DECODE_PATH")
    assert paths.default_decode_path() == "auto"
    monkeypatch.setenv("MOE_DECODE_PATH", "tier")
    assert paths.default_decode_path() == "tier"


def test_the_host_gap_is_timed_between_consecutive_layers_of_one_step_only():
    gap = HostGap()
    assert gap.value == 0.0
    gap.left(3, 10.0)
    gap.arrived(4, 10.5)    # layer 3's CPU part to layer 4's launch: 0.5 s
    gap.left(4, 11.0)
    gap.arrived(6, 20.0)    # a layer between them took another step: no gap
    gap.left(6, 21.0)
    gap.step_ended()
    gap.arrived(7, 30.0)    # across the step's end: no gap
    assert gap.value == 0.5
    for seconds in (0.1, 0.2, 0.3, 4.0):  # the lower quartile: a gap that waited for the GPU does not count
        gap.left(0, 0.0)
        gap.arrived(1, seconds)
    assert gap.value == pytest.approx(0.2)
    gap.left(1, 5.0)
    gap.clear()             # forgotten, and a CPU part before the clear starts no gap after it
    gap.arrived(2, 6.0)
    assert gap.value == 0.0
    simulated = HostGap(measured=False)
    simulated.left(0, 0.0)
    simulated.arrived(1, 1.0)
    assert simulated.value == 0.0


def test_under_launch_ahead_a_host_that_waited_for_the_routing_left_no_gap():
    gap = HostGap()
    for layer, (arrived, waited) in enumerate([(0.3, True), (0.2, False), (0.4, True), (0.1, True)], start=1):
        gap.left(layer - 1, 0.0)
        gap.arrived(layer, arrived, waited)
    assert sorted(gap._gaps) == [0.0, 0.0, 0.0, 0.2] and gap.value == 0.0


def test_both_under_cpu_execution_disabled_says_the_cpu_takes_no_share(monkeypatch):
    """cpu_execution=disabled keeps every expert off the CPU, so the engine runs the decode path 'both' as 'tier'
    (decode_path_in_force). The sentence the plan and the budget panel gave said the CPU computes a share of them."""
    monkeypatch.setattr(paths, "host_available", lambda: 100 * GIB)
    assert paths.tier_preview("both", OffloadConfig(cpu_execution="disabled"), NODES, HALF, "cuda") == (True,
        "Instead, decode reads cold experts on the GPU from a host tier of 2.0 GiB of page-locked host memory; "
        "decode path 'both' was asked, but cpu_execution=disabled leaves the CPU no share of them.")
