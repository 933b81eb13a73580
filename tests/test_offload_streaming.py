"""Decode streaming slots (engine/offload/streaming.py) on the simulated device: layers without an expert slot copy
the misses the cost model picks into a few shared device slots and compute them there, with the same answers as the
all-CPU run; the slots are working memory, counted, bounded by device_working_bytes, and re-planned with budgets."""

from __future__ import annotations

import pytest

from engine.errors import WorkbenchError
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.config import NodeOverride
from engine.offload.decode_path import DecodePathTrials
from engine.offload.devices import Bandwidths
from engine.units import human_bytes
from tests.test_offload import (SPEC, assert_same_as_cpu, cpu_run, device_expert_bytes, greedy_run,  # noqa: F401
                                model_folder, time_paths_as_given)

PURPOSE = "decode streaming slots"
STREAMING = dict(device_expert_bytes=0, device_working_bytes=1 << 30)  # a zero budget, streaming slots asked for


def slot_bytes(model) -> int:
    return model.offload.infos[0].device_bytes_per_expert


def decode_split(model) -> tuple[int, int, int]:
    """(missed pairs on the CPU, missed pairs copied, experts copied) over the run."""
    totals = model.offload.stats.totals()
    return totals.misses_cpu, totals.misses_copied, totals.miss_copies


def test_streaming_slots_are_off_unless_device_working_bytes_asks(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(device_expert_bytes=0))
    assert model.offload.streaming.groups == [] and device.memory.by_purpose.get(PURPOSE, 0) == 0
    assert any("device_working_bytes would let" in s for s in model.offload.plan.statements)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert decode_split(model)[2] == 0


def test_a_zero_budget_streams_decode_misses_with_the_same_answers(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)  # the default bandwidths: a copy over PCIe beside the CPU pays
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING))
    assert_same_as_cpu(greedy_run(model), cpu_run)
    groups = model.offload.streaming.groups
    assert len(groups) == 1 and groups[0].num_slots == SPEC.top_k  # one layout: one set of top-k slots for all layers
    assert device.memory.by_purpose[PURPOSE] == SPEC.top_k * slot_bytes(model)
    on_cpu, copied, copies = decode_split(model)
    assert copies > 0 and copied >= copies and on_cpu > 0  # both at once: some misses copied, the rest on the CPU
    assert model.offload.stats.totals().hits == 0  # nothing stays resident
    assert model.offload.stats_dict()["streaming_slots"] == [SPEC.top_k]  # in records and --json
    assert any("streaming slots" in s for s in model.offload.plan.statements)


def test_a_slow_link_copies_nothing(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30, bandwidths=Bandwidths(pcie=1e3))  # a copy takes longer than any CPU kernel
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING))
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert decode_split(model)[2] == 0  # no decode copy (prefill waves may copy)


def test_device_working_bytes_bounds_the_slots(model_folder, cpu_run):
    one = SimulatedDevice(1 << 30)
    probe = LoadedModel.open(model_folder, device=one, offload=OffloadConfig(**STREAMING))
    size = slot_bytes(probe)
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device,
                             offload=OffloadConfig(device_expert_bytes=0, device_working_bytes=2 * size + size // 2))
    assert [g.num_slots for g in model.offload.streaming.groups] == [2]
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert max(step.miss_copies for step in model.offload.stats.layers) > 0
    single = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30),
                              offload=OffloadConfig(device_expert_bytes=0, device_working_bytes=size))
    layers = len(single.offload.stores)
    assert (f"Where decode computes cold experts on the CPU (not from a host tier), the misses of {layers} layers "
            f"without expert slots may also be copied to the device, through 1 shared "
            f"streaming slot ({human_bytes(size)} of working memory), while the CPU computes the rest."
            in single.offload.plan.statements)
    off = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=off, offload=OffloadConfig(device_expert_bytes=0,
                                                                            device_working_bytes=size - 1))
    assert model.offload.streaming.groups == [] and off.memory.by_purpose.get(PURPOSE, 0) == 0
    assert any("run there only" in s for s in model.offload.plan.statements)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert decode_split(model)[2] == 0  # no decode copy (prefill waves may copy)


def test_no_streaming_slot_says_whether_device_working_bytes_or_the_device_left_none(model_folder):
    """Both said "no room for a streaming slot": device_working_bytes below one slot (the user's value to raise) and a
    device with less than a slot free under gpu_device_mem_limit."""
    size = slot_bytes(LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30),
                                       offload=OffloadConfig(**STREAMING)))
    layers = SPEC.layers
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30),
                             offload=OffloadConfig(device_expert_bytes=0, device_working_bytes=size - 1))
    assert (f"Where decode computes cold experts on the CPU (not from a host tier), the misses of {layers} layers "
            f"without expert slots run there only: device_working_bytes="
            f"{size - 1} holds no streaming slot of {human_bytes(size)}.") in model.offload.plan.statements
    limit = 2 * size + size // 2  # the staging ring's two one-expert waves, and half a slot
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30, mem_limit=limit),
                             offload=OffloadConfig(device_expert_bytes=0, device_working_bytes=1 << 30,
                                                   prefill_wave_experts=1, gpu_device_mem_limit=limit))
    assert (f"Where decode computes cold experts on the CPU (not from a host tier), the misses of {layers} layers "
            f"without expert slots run there only: the device has "
            f"{human_bytes(size // 2)} free under gpu_device_mem_limit={limit}, less than a streaming slot of "
            f"{human_bytes(size)}.") in model.offload.plan.statements


def test_only_layers_without_slots_stream_and_budgets_replan_them(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING))
    engine = model.offload
    assert all(group is not None for group in engine.streaming.by_layer)
    # a budget that gives every layer slots: no streaming slots, their memory given back
    engine.reconfigure(engine.config.updated(device_expert_bytes=device_expert_bytes(model_folder) // 2))
    assert engine.streaming.by_layer == [None] * SPEC.layers and device.memory.by_purpose[PURPOSE] == 0
    # slots for the first layer only (node_overrides): the other layers stream
    no_slots = {info.name: NodeOverride(max_resident_slots=0) for info in engine.infos[1:]}
    engine.reconfigure(engine.config.updated(device_expert_bytes=SPEC.num_experts * slot_bytes(model),
                                             node_overrides=no_slots))
    with_slots = [layer.num_slots > 0 for layer in engine.slots]
    assert [group is None for group in engine.streaming.by_layer] == with_slots and not all(with_slots)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert device.memory.high_water <= device.memory.ceiling


def test_cpu_execution_disabled_takes_no_streaming_slots(model_folder):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device,
                             offload=OffloadConfig(**STREAMING, cpu_execution="disabled"))
    assert model.offload.streaming.groups == [] and device.memory.by_purpose.get(PURPOSE, 0) == 0


def test_a_streaming_launch_carries_only_the_copied_misses(model_folder, monkeypatch):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING))
    store_type = type(model.offload.stores[0])
    launched = []
    real_launch = store_type.launch

    def spy(self, x2d, ids, weights, streamed=None):
        launched.append((streamed, ids.copy()))
        return real_launch(self, x2d, ids, weights, streamed=streamed)

    monkeypatch.setattr(store_type, "launch", spy)
    greedy_run(model, steps=3)
    group = model.offload.streaming.groups[0]
    streamed = [ids for by, ids in launched if by is not None]
    assert streamed and all(by is group for by, _ in launched if by is not None)
    # at most one expert per slot, each a miss of that step (no slots: every routed expert is one)
    assert all(0 < len(set(ids[ids >= 0].tolist())) <= group.num_slots for ids in streamed)
    assert sum(len(set(ids[ids >= 0].tolist())) for ids in streamed) == decode_split(model)[2]


@pytest.mark.parametrize("path, words", [
    ("tier", "read by the GPU from host memory"),
    ("both", "read by the GPU from host memory, a share computed on the CPU at once")])
def test_under_the_host_tiers_paths_no_streaming_slot_is_made(model_folder, cpu_run, path, words):
    """Decode paths 'tier' and 'both' read every cold expert of a layer without slots from the host tier (the CPU
    computing a share under 'both'): no decode step copies a miss, so the streaming slots device_working_bytes asked
    for took device memory for nothing, and the plan said misses went over PCIe. None is made now, the plan says why;
    under the CPU path they are made again and take the copies."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING), decode_path=path)
    engine = model.offload
    assert engine.host_tier and engine.decode_path_in_force == path
    assert engine.streaming.groups == [] and engine.streaming.by_layer == [None] * SPEC.layers
    assert device.memory.by_purpose.get(PURPOSE, 0) == 0 and engine.copy_state()["streaming_slots"] == []
    assert (f"device_working_bytes={1 << 30} makes no decode streaming slots: under decode path '{path}' the cold "
            f"experts of {SPEC.layers} layers without expert slots are {words}, none copied to the device."
            in engine.plan.statements)
    assert not any("Where decode computes cold experts on the CPU" in s for s in engine.plan.statements)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert decode_split(model)[2] == 0 and engine.stats.totals().misses_read > 0
    engine.set_decode_path("cpu")  # no tier: decode's misses on the CPU, some copied into the slots
    assert not engine.host_tier and [group.num_slots for group in engine.streaming.groups] == [SPEC.top_k]
    assert device.memory.by_purpose[PURPOSE] == SPEC.top_k * slot_bytes(model)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert decode_split(model)[2] > 0


def test_the_streaming_slots_stay_while_trials_may_bring_the_cpu_path(model_folder, cpu_run):
    """Decode path auto under cpu_execution=auto: the tier is made and trials time it against the CPU path, which a
    trial may keep (or come back to time at any later trial): the streaming slots are made with the tier and kept
    through the switches, and the CPU path's steps copy misses into them, with the all-CPU run's tokens. A re-plan
    to 'tier' that fails leaves them as the path put back (auto) wants them."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, offload=OffloadConfig(**STREAMING), decode_path="auto")
    engine = model.offload
    assert engine.host_tier and engine.path_trials_run() and engine.decode_path_in_force == "tier"
    groups = engine.streaming.groups
    assert [group.num_slots for group in groups] == [SPEC.top_k]
    assert device.memory.by_purpose[PURPOSE] == SPEC.top_k * slot_bytes(model)
    assert any(said.startswith("Where decode computes cold experts on the CPU (not from a host tier), the misses of "
                               f"{SPEC.layers} layers without expert slots may also be copied")
               for said in engine.plan.statements)
    engine.path_trials = DecodePathTrials(first=1, settle=1, window=2, recheck=100)
    paths = time_paths_as_given(model)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert "cpu" in paths and {"tier", "both"} <= set(paths) and engine.streaming.groups == groups  # kept throughout
    assert decode_split(model)[2] > 0  # the CPU path's steps copied misses into them
    with pytest.raises(WorkbenchError, match="node_overrides names 'nowhere'"):
        engine.reconfigure(engine.config.updated(node_overrides={"nowhere": NodeOverride(max_resident_slots=0)}),
                           decode_path="tier")
    assert engine.decode_path_mode == "auto" and engine.host_tier
    assert [group.num_slots for group in engine.streaming.groups] == [SPEC.top_k]
    assert device.memory.by_purpose[PURPOSE] == SPEC.top_k * slot_bytes(model)
