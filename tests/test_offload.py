"""Hybrid offload on the simulated device: same answers as the all-CPU run at every budget,
budgets enforced, placement that finds the hot set, re-planning without a reload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.errors import WorkbenchError
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.config import OffloadConfigError
from engine.offload.device_memory import DeviceMemoryError
from engine.offload.miss_policy import CpuRate, cpu_bytes_per_s, miss_costs
from engine.offload.placement import AdaptivePlacement, LayerSlots, make_policy
from engine.offload.planner import OffloadPlanError, plan_offload
from engine.offload.traces import hit_rate, realistic_trace
from engine.units import human_bytes
from engine.writer import WriterSpec, write_model
from tests.conftest import fixture_folder
from tests.holders import holders
from tests.test_bad_input import assert_clean_error

SPEC = WriterSpec(layers=3, num_experts=16, top_k=4, hidden_size=128, inter_size=64, seed=21, dense_accuracy_level=0)
STEPS = 12


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("offload") / "m", SPEC)


@pytest.fixture(scope="module")
def cpu_run(model_folder):
    return greedy_run(LoadedModel.open(model_folder))


def greedy_run(model: LoadedModel, prompt: str = "The expert offload engine must be exact.", steps: int = STEPS):
    state = model.new_state()
    logits = [model.decoder.forward(state, model.tokenizer.encode(prompt))]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(model.decoder.forward(state, [tokens[-1]]))
    return logits, tokens


def time_paths_as_given(model: LoadedModel) -> list[str]:
    """The decode path trials driven by given step times (the CPU path fastest, then both, then the tier) in place of
    the clock's; the list the path in force after each step is appended to, returned for the test to read."""
    engine, paths = model.offload, []

    def end_step(seconds, tokens):
        step_s = {"tier": 0.030, "cpu": 0.020, "both": 0.025}[engine.decode_path_in_force]
        engine.end_step(step_s if tokens == 1 else seconds, tokens)
        paths.append(engine.decode_path_in_force)

    model.decoder.on_step_end = end_step
    return paths


def assert_same_as_cpu(run, reference) -> None:
    """Two greedy_run results: the same tokens, logits within float32 kernel tolerance of the reference's."""
    logits, tokens = run
    ref_logits, ref_tokens = reference
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-5


def expert_bytes(model_folder) -> int:
    return LoadedModel.open(model_folder).folder.expert_bytes


def device_expert_bytes(model_folder) -> int:
    """Every expert in device slots: the GPU kernels' layout (ExpertNodeInfo.device_bytes_per_expert)."""
    from engine.model_folder import ModelFolder
    from engine.offload.planner import all_resident_bytes

    experts = ModelFolder.open(model_folder).experts
    assert all_resident_bytes(experts) == sum(i.device_bytes_per_expert * i.spec.num_experts for i in experts)
    return all_resident_bytes(experts)


@pytest.mark.parametrize("placement", ["static", "adaptive"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("cpu_execution", ["auto", "disabled"])
@pytest.mark.parametrize("decode_path", ["cpu", "tier", "both"])
def test_outputs_equal_the_all_cpu_run(model_folder, cpu_run, placement, fraction, cpu_execution, decode_path):
    budget = int(fraction * device_expert_bytes(model_folder))
    config = OffloadConfig(placement=placement, device_expert_bytes=budget, cpu_execution=cpu_execution)
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=config, device=device, decode_path=decode_path)
    assert model.offload.host_tier is (decode_path in ("tier", "both") and fraction < 1.0)
    logits, tokens = greedy_run(model)
    ref_logits, ref_tokens = cpu_run
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-5
    stats = model.offload.stats.totals()
    prompt_tokens = len(model.tokenizer.encode("The expert offload engine must be exact."))  # greedy_run's prompt
    assert stats.hits + stats.misses == (prompt_tokens + STEPS) * SPEC.top_k * SPEC.layers  # every routed pair
    if fraction == 1.0:
        assert model.offload.plan.placement_mode == "all_resident" and stats.misses == 0
    if fraction == 0.0:
        assert stats.hits == 0 and model.offload.plan.placement_mode == "hybrid"
    if cpu_execution == "disabled":
        assert stats.cpu_s == 0.0  # every cold expert went to the device
    elif decode_path == "both" and fraction < 1.0:  # the CPU took a share of the cold pairs, the GPU read others
        decode = model.offload.stats.phases["decode"]
        assert decode.cpu_s > 0.0 and stats.misses_read > 0
    # every miss is on the CPU, copied or read by the device from the host tier, in the totals and step by step
    assert stats.misses == stats.misses_cpu + stats.misses_copied + stats.misses_read
    assert [sum(column) for column in zip(*model.offload.stats.step_splits)] == [
        stats.misses_cpu, stats.misses_copied, stats.misses_read]


def test_the_simulated_device_simulates_the_host_tier(model_folder, cpu_run):
    """Decode path 'tier' on the simulated device: the tier's host bytes counted (its device mappings: the next
    test), decode steps of partly resident layers routed and computed on the "device" as fully resident ones are, with
    the all-CPU run's tokens, their cold pairs counted as read; each such step's modelled device time prices the
    experts in a slot at HBM and the others at TIER_READ_SHARE of PCIe. Without a device the path is refused by
    name."""
    from engine.offload.devices import TIER_READ_SHARE

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 2),
                             device=device, decode_path="tier")
    engine = model.offload
    used = device.memory.used
    assert engine.host_tier and engine.decode_path_in_force == "tier"
    store = engine.stores[0]
    assert engine.pinned_info()["host_tier_bytes"] == SPEC.layers * SPEC.num_experts * store.expert_bytes
    assert any(said.startswith("Instead, decode reads cold experts on the GPU from a host tier of ") and
               said.endswith("as asked (decode path 'tier').")
               for said in engine.plan.statements)
    timed = []
    real = engine.stores[1].launch_routed

    def spy(x, logits, router_weights):
        result, pending = real(x, logits, router_weights)
        timed.append((pending[0].copy(), pending[1]))
        return result, pending

    engine.stores[1].launch_routed = spy
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = engine.stats.totals()
    assert totals.misses_read > 0 and engine.stats.phases["decode"].cpu_s == 0.0
    assert len(timed) == STEPS and device.memory.used == used
    held = set(engine.slots[1].resident().tolist())
    bw = device.bandwidths
    logits, seconds = timed[-1]  # the last step: placement has not moved since it ran
    ids = np.argsort(-logits, axis=1)[:, :SPEC.top_k].ravel().tolist()
    resident, cold = len(set(ids) & held), len(set(ids) - held)
    assert seconds == pytest.approx(store.read_bytes * (resident / bw.hbm + cold / (TIER_READ_SHARE * bw.pcie)))
    engine.reconfigure(engine.config.updated(cpu_execution="enabled"))  # the path asked for wins over it
    assert engine.host_tier and engine.decode_path_in_force == "tier"
    engine.set_decode_path("auto")  # ... where under auto, enabled keeps cold experts on the CPU: no tier
    assert not engine.host_tier and engine.decode_path_in_force == "cpu"
    engine.set_decode_path("tier")
    engine.set_decode_path("cpu")
    assert not engine.host_tier and "host_tier_bytes" not in engine.pinned_info()
    with pytest.raises(WorkbenchError, match="decode path 'tier' needs a GPU"):
        engine_without_device(model_folder).set_decode_path("tier")


MIB = 1 << 20


def rounded_tier_bytes(info, slots: int) -> int:
    """What a CUDA card reserves for a node's slots with the host tier (CudaSlots.resize: TieredRows.device_bytes):
    every slot array's device rows, at least one (max(1, slots)), rounded up to the 2 MiB mapping granule."""
    assert sum(info.gpu.tier_rows) == info.device_bytes_per_expert  # one row per slot array
    return sum(-(-max(1, slots) * row // (2 * MIB)) * 2 * MIB for row in info.gpu.tier_rows)


def test_the_simulated_tier_reserves_its_granule_rounded_device_mappings(model_folder):
    """The simulated device counted the tier's slots at slots x expert bytes, where a card maps each slot array's
    device rows rounded up to the 2 MiB granule (a granule an array even at 0 slots): its high-water mark was lower
    than the card's. It reserves what the card does now, and gives it back without the tier."""
    device = SimulatedDevice(1 << 30)
    budget = device_expert_bytes(model_folder) // 2
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=budget), device=device,
                             decode_path="tier")
    engine = model.offload
    assert engine.host_tier
    tiered = sum(rounded_tier_bytes(info, engine.plan.slots[info.name]) for info in engine.infos)
    unrounded = engine.plan.device_bytes(engine.infos)
    assert tiered >= unrounded + SPEC.layers * 2 * MIB  # a tiny model: every array's rows within one granule
    slots = sum(n for purpose, n in device.memory.by_purpose.items() if purpose.startswith("expert slots"))
    assert slots == tiered and device.memory.high_water >= tiered
    engine.set_decode_path("cpu")
    assert not engine.host_tier
    assert sum(n for purpose, n in device.memory.by_purpose.items() if purpose.startswith("expert slots")) == unrounded
    engine.reconfigure(engine.config.updated(device_expert_bytes=0))
    engine.set_decode_path("tier")  # no slot at all: still a granule a slot array on a card
    assert engine.host_tier and device.memory.by_purpose[f"expert slots of {engine.infos[0].name}"] == \
        rounded_tier_bytes(engine.infos[0], 0) > 0


def test_an_automatic_budget_keeps_the_reserve_free_beside_the_host_tiers_mappings(tmp_path):
    """The automatic budget is the device's free memory less reserve_device_bytes; its slots filled it, and the host
    tier's granule-rounded mappings went on top, into the reserve kept for KV cache and workspace. The budget now
    leaves the mappings' rounding room where the tier is made, and a tier whose mappings do not fit beside the reserve
    is not made; an explicit budget is the user's, untouched."""
    # one layer of 16 experts of ~4 MiB: all of them ~66 MiB; the tier's mappings without slots ~16 MiB
    folder = write_model(tmp_path / "m", WriterSpec(layers=1, num_experts=16, top_k=4, hidden_size=2048,
                                                    inter_size=1024, seed=3, dense_accuracy_level=0))
    reserve = 64 * MIB
    for room in (40 * MIB, 10 * MIB):  # beside the reserve: room for some slots with their mappings; for no mapping
        device = SimulatedDevice(reserve + room)
        engine = LoadedModel.open(folder, device=device, decode_path="tier",
                                  offload=OffloadConfig(reserve_device_bytes=reserve, prefill_wave_experts=0)).offload
        assert device.memory.available >= reserve, (room, device.memory.by_purpose)
        if room == 40 * MIB:
            assert engine.host_tier and 0 < sum(engine.plan.slots.values()) < 16
            said = [s for s in engine.plan.statements if "host tier's device mappings" in s]
            assert len(said) == 1 and said[0].startswith("The automatic budget leaves ")
            assert said[0].endswith("so that the reserve for KV cache and workspace stays free.")
        else:  # what the reserve leaves holds no tier: cold experts on the CPU, and why
            assert not engine.host_tier and not any("host tier's device mappings" in s for s in engine.plan.statements)
            said = [s for s in engine.plan.statements if "no host tier is made" in s]
            assert len(said) == 1 and said[0].endswith(
                "the device has free for them beside the reserve for KV cache and workspace (reserve_device_bytes).")
    budget = 20 * MIB
    engine = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget), device=SimulatedDevice(1 << 30),
                              decode_path="tier").offload
    assert engine.host_tier and engine.plan.budget_bytes == budget
    assert not any("host tier's device mappings" in s for s in engine.plan.statements)


def test_a_tier_that_fits_only_unrounded_under_the_limit_is_not_made_on_the_simulated_device(model_folder, cpu_run):
    """Under a gpu_device_mem_limit that holds the tier's slots at slots x expert bytes but not its granule-rounded
    mappings, a card refuses the tier (CudaSlots.resize) and decode computes cold experts on the CPU; the simulated
    device made it and projected the tier's decode. It refuses it the same way now, and says why before trying."""
    budget = device_expert_bytes(model_folder) // 2
    plain = SimulatedDevice(1 << 30)
    LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=budget), device=plain, decode_path="cpu")
    limit = plain.memory.high_water + MIB  # the old count of a tier (slots x expert bytes) fits with room to spare
    device = SimulatedDevice(1 << 30, mem_limit=limit)
    model = LoadedModel.open(model_folder, device=device, decode_path="tier",
                             offload=OffloadConfig(device_expert_bytes=budget, gpu_device_mem_limit=limit))
    engine = model.offload
    assert not engine.host_tier and engine.decode_path_in_force == "cpu"
    said = [s for s in engine.plan.statements if "host tier" in s]
    assert len(said) == 1 and said[0].startswith("Cold experts are computed on the CPU: no host tier is made, since "
                                                 "its device mappings need "), said
    assert f"2.0 MiB mapping granule; {human_bytes(engine.plan.device_bytes(engine.infos))} without the tier)" in said[0]
    assert said[0].endswith(f"free for them under gpu_device_mem_limit={limit}.")
    assert device.memory.high_water <= limit
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_a_host_tier_the_driver_refuses_leaves_the_plan_of_no_tier(model_folder, cpu_run, tmp_path, monkeypatch):
    """A host tier whose mappings the driver refuses (HostTierError, or a DeviceMemoryError) at load: cold experts go
    to the CPU, and the plan said so beside what it had planned for the tier: the device memory its mappings take
    and, under an automatic budget, the room left to them, which the slots did not get. The plan is made again for no
    tier now: the slots and sentences of a load without one, and the sentence saying why there is none."""
    from engine.offload.devices import SimulatedSlots
    from kernels.gpu.host_tier import HostTierError

    real = SimulatedSlots.resize

    def refused(self, num_slots):
        if self.host_tier:
            raise HostTierError("cuMemCreate failed: CUresult 2")
        real(self, num_slots)

    monkeypatch.setattr(SimulatedSlots, "resize", refused)
    # one layer of 16 experts of ~4 MiB (test_an_automatic_budget_keeps_the_reserve_free_beside_the_host_tiers_mappings)
    large = write_model(tmp_path / "m", WriterSpec(layers=1, num_experts=16, top_k=4, hidden_size=2048,
                                                   inter_size=1024, seed=3, dense_accuracy_level=0))
    refusal = "Cold experts are computed on the CPU: the host tier could not be made (cuMemCreate failed: CUresult 2)."
    models = []
    for folder, config, capacity in (
            (model_folder, OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 2), 1 << 30),
            (large, OffloadConfig(reserve_device_bytes=64 * MIB, prefill_wave_experts=0), 104 * MIB)):
        device, plain_device = SimulatedDevice(capacity), SimulatedDevice(capacity)
        models.append(LoadedModel.open(folder, offload=config, device=device, decode_path="tier"))
        engine = models[-1].offload
        plain = LoadedModel.open(folder, offload=config, device=plain_device, decode_path="cpu").offload
        assert not engine.host_tier and engine.decode_path_in_force == "cpu" and refusal in engine.plan.statements
        assert [said for said in engine.plan.statements if said != refusal] == plain.plan.statements
        assert not any("host tier's device mappings" in s or "With the host tier" in s for s in engine.plan.statements)
        assert engine.plan.slots == plain.plan.slots and engine.plan.budget_bytes == plain.plan.budget_bytes
        assert [store.num_slots for store in engine.stores] == [store.num_slots for store in plain.stores]
        assert device.memory.by_purpose == plain_device.memory.by_purpose
    assert_same_as_cpu(greedy_run(models[0]), cpu_run)


def test_a_replan_whose_plan_without_the_refused_tier_fails_leaves_the_configuration_in_force(model_folder, cpu_run,
                                                                                               monkeypatch):
    """A re-plan whose host tier the driver refuses plans again without it (_plan_untiered); where that plan failed too
    (here the staging ring refused: any WorkbenchError, not only the device's memory), the error went out with every
    store released and the refused plan in force. Now the configuration in force stays, and decodes as the CPU does."""
    from engine.offload.devices import SimulatedSlots
    from engine.offload.planner import OffloadPlanError
    from kernels.gpu.host_tier import HostTierError

    quarter = device_expert_bytes(model_folder) // 4
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=quarter),
                             device=SimulatedDevice(1 << 30), decode_path="cpu")
    engine = model.offload
    plan, slots = engine.plan, [store.num_slots for store in engine.stores]
    real_resize, real_plan = SimulatedSlots.resize, type(engine)._plan

    def refused(self, num_slots):
        if self.host_tier:
            raise HostTierError("cuMemCreate failed: CUresult 2")
        real_resize(self, num_slots)

    def untiered_refused(self, config, tier=True):
        if not tier:
            raise OffloadPlanError("the staging ring's 8.0 MiB of page-locked memory was refused")
        return real_plan(self, config, tier)

    monkeypatch.setattr(SimulatedSlots, "resize", refused)
    monkeypatch.setattr(type(engine), "_plan", untiered_refused)
    with pytest.raises(WorkbenchError, match="staging ring's 8.0 MiB"):
        engine.reconfigure(engine.config.updated(device_expert_bytes=2 * quarter), decode_path="tier")
    monkeypatch.undo()
    assert engine.plan is plan and [store.num_slots for store in engine.stores] == slots
    assert engine.config.device_expert_bytes == quarter and engine.decode_path_mode == "cpu"
    assert not engine.host_tier
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_under_decode_path_both_the_cpus_share_follows_the_rates_measured_in_its_steps(model_folder, cpu_run):
    """Decode path "both" on the simulated device: the CPU's share of the cold pairs (cold_split_table) comes from the
    rates its steps measure: the CPU kernel's (CpuRate) and the GPU's reads from the tier (TierReadRate: the launch's
    time less its residents' HBM reads, here the modelled TIER_READ_SHARE of PCIe exactly)."""
    from engine.offload.devices import TIER_READ_SHARE
    from kernels.cold_split import cpu_take_table

    from engine.offload.engine import SPLIT_RATE_SKIP

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    assert engine.decode_path_in_force == "both" and engine.tier_read.value is None
    decode_steps, counted_at = [], []  # the CPU parts the split's rate counts, by the decode steps ended before them
    end_step, observe_many = model.decoder.on_step_end, engine.split_rate.observe_many
    model.decoder.on_step_end = lambda step_s, tokens: (decode_steps.append(1) if tokens == 1 else None,
                                                         end_step(step_s, tokens))
    engine.split_rate.observe_many = lambda calls: (counted_at.append(len(decode_steps)), observe_many(calls))
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert engine.tier_read.value == pytest.approx(TIER_READ_SHARE * device.bandwidths.pcie)
    # the parts of its first decode steps are not counted (their pools and pages still warming on a real machine);
    # the first counted step's parts reach the rate as that step ends (spike_gate), the step's end counted
    assert counted_at and min(counted_at) == SPLIT_RATE_SKIP + 1
    # the split's own rate, apart from the CPU path's calls (none here)
    assert engine.split_rate.value is not None and engine.cpu_rate.value is None
    assert engine.split_cpu_rate is engine.split_rate
    engine._split_tables.clear()
    info, store = engine.infos[0], engine.stores[0]
    assert engine.cold_split_table(0).tolist() == cpu_take_table(
        SPEC.top_k, info.bytes_per_expert / cpu_bytes_per_s(device.bandwidths, engine.split_rate.value),
        engine.split_rate.fixed_s, store.read_bytes / engine.tier_read.value).tolist()
    state = engine.copy_state()["decode_path"]["cold_split"]  # what records and the placement view show
    # the simulated device's dense segments are the CPU doing a card's work: no host gap is measured there
    assert engine.host_gap.value == 0.0
    # the steps' CPU parts are timed for real: on a loaded machine some run slow and the gate leaves them out (its
    # count is what the state reports; test_spike_gate.py pins down which steps it leaves out)
    # (the split's rows: none, whole pairs preferred until the row trials find a split faster; here no trial, as
    # 64 intermediate rows are one ROW_STEP, too few to split)
    assert state == {"cpu_takes": engine.cold_split_table(0).tolist(), "split_rows": None,
                     "tables": [{"layers": [0, 1, 2], "cpu_takes": engine.cold_split_table(0).tolist(),
                                 "split_rows": None, "inter_size": 64}], "inter_size": 64,  # (every layer's alike)
                     "cpu_bytes_per_s": cpu_bytes_per_s(device.bandwidths, engine.split_rate.value),
                     "cpu_measured_bytes_per_s": engine.split_rate.value, "cpu_call_s": engine.split_rate.fixed_s,
                     "cpu_measured_call_s": engine.split_rate.fixed_s, "tier_read_bytes_per_s": engine.tier_read.value,
                     "host_gap_s": 0.0, "slow_steps_left_out": engine.split_gate.left_out, "fixed": False,
                     "share": {"shift": 0, "trials": 0, "measured_ms": {}, "measuring": None},  # (none yet: 12 steps)
                     "rows": None}
    engine.set_decode_path("tier")
    assert engine.copy_state()["decode_path"]["cold_split"] is None


def clamped_rates_model(folder) -> LoadedModel:
    """The model under "both" on the simulated device (40 GB/s of streaming read assumed), its CPU path's and its
    split's rates measured at 60 GB/s + 100 µs a call, past the stream, and measuring no more (the calls of its own
    steps would be this machine's). The calls are unweighted (fit_keep 1), 11.25 MB in 287.5 µs on average: held to the
    stream's 40 GB/s the line through that mean costs 287.5 - 281.25 = 6.25 µs a call."""
    from tests.test_offload_misses import line_calls, observed

    model = LoadedModel.open(folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    for rate in (model.offload.cpu_rate, model.offload.split_rate):
        rate.fit_keep = 1.0
        observed(rate, line_calls(60e9, 100e-6))
        rate.observe = rate.observe_many = lambda *calls: None
    return model


def test_the_engine_says_the_cpu_rate_in_force_with_the_measured_one_beside_it(model_folder):
    """copy_state (records, --json, the placement view) said the CPU rates as measured, where the miss policy and the
    split's tables price a CPU miss at the rate clamped to the host's streaming read (CpuRate.priced): 60 GB/s said,
    40 priced. It says the rate in force, its fixed cost through the calls' mean (100 µs, the fitted line's, had
    priced every call 94 µs over), and the measured one beside it."""
    from tests.test_offload_misses import line_calls, observed

    from engine.offload.hybrid_node import HybridExpertNode

    model = clamped_rates_model(model_folder)
    engine = model.offload
    state = engine.copy_state()
    for said in (state, state["decode_path"]["cold_split"]):  # the CPU path's rate, the split's
        assert (said["cpu_bytes_per_s"], said["cpu_measured_bytes_per_s"], said["cpu_call_s"]) == (
            pytest.approx(40e9, rel=1e-9), pytest.approx(60e9, rel=1e-9), pytest.approx(6.25e-6, rel=1e-6))
        assert said["cpu_measured_call_s"] == pytest.approx(100e-6, rel=1e-6)  # the measured line's own
    # the miss policy prices a call so (its costs for a layer's misses), and the split's costs
    node = next(step for step in model.decoder.steps if isinstance(step, HybridExpertNode))
    assert node._miss_costs([1], 0, 0.0, None).cpu_fixed_s == pytest.approx(6.25e-6, rel=1e-6)
    assert engine._split_costs(0)[1] == pytest.approx(6.25e-6, rel=1e-6)
    slow = engine.cpu_rate_state(observed(CpuRate(), line_calls(20e9, 2e-6)))  # below the stream: the rate measured
    assert slow["cpu_bytes_per_s"] == slow["cpu_measured_bytes_per_s"] == pytest.approx(20e9)
    assert engine.cpu_rate_state(CpuRate()) == {"cpu_bytes_per_s": None, "cpu_measured_bytes_per_s": None,
                                                "cpu_call_s": 0.0, "cpu_measured_call_s": 0.0}


def test_the_split_tables_price_a_cpu_miss_as_the_miss_policy_does(model_folder):
    """Under "both" the split's costs take the CPU's a cold expert at miss_costs' rate: the measured one, no faster
    than the streaming read (the simulated device's assumed 40 GB/s), where a line past it had made the tables give the
    CPU pairs it cannot read that fast."""
    from tests.test_offload_misses import line_calls, observed

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine, info, rate = model.offload, model.offload.infos[0], model.offload.split_rate
    observed(rate, line_calls(400e9, 2e-6))  # calls measured past the streaming read (no ceiling simulated)
    assert rate.value == pytest.approx(400e9) and device.bandwidths.cpu == 40e9
    expert_s, call_s, _tier_s = engine._split_costs(0)
    assert expert_s == miss_costs(device.bandwidths, info.bytes_per_expert, [1], 0.0, cpu_rate=rate.value).cpu_s[0]
    # held to the stream, the line through the calls' mean would cost less than nothing a call: through the origin
    assert expert_s == pytest.approx(info.bytes_per_expert / 40e9) and call_s == 0.0
    # (at the 400 GB/s + 2 µs measured: [0, 0, 0, 1, 2]; at 40 GB/s beside the fitted line's 2 µs: [0, 0, 0, 0, 1])
    assert engine.cold_split_table(0).tolist() == [0, 1, 1, 2, 3]


def test_fixed_split_tables_hold_each_layer_with_no_share_or_row_trials(model_folder, cpu_run):
    """fix_split_tables (bench_offload_ab --split-table) under "both": each layer decodes with the tables given for
    it, the share and row trials neither step nor hold trials_pending, and the state says the tables are fixed, with
    no trials' shift or split reported; None gives the engine's own tables and trials back."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    given = [np.array(table) for table in ([0, 0, 0, 0, 0], [0, 1, 1, 2, 2], [0, 1, 2, 3, 4])]  # a layer's each
    engine.fix_split_tables(lambda layer: (given[layer], None))
    stepped = []
    engine.share_trials.step = engine.row_trials.step = lambda seconds, tokens: stepped.append(seconds)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert [engine.cold_split_table(layer).tolist() for layer in range(SPEC.layers)] == [t.tolist() for t in given]
    assert stepped == [] and not engine.trials_pending
    state = engine.copy_state()["decode_path"]["cold_split"]
    assert (state["fixed"], state["cpu_takes"], state["share"], state["rows"]) == (True, [0, 0, 0, 0, 0], None, None)
    # every layer's table, not the first's alone (each its own here)
    assert state["tables"] == [{"layers": [layer], "cpu_takes": table.tolist(), "split_rows": None,
                                "inter_size": SPEC.inter_size} for layer, table in enumerate(given)]
    engine.fix_split_tables(None)
    assert engine.trials_pending and engine.copy_state()["decode_path"]["cold_split"]["share"]["shift"] == 0
    assert engine.cold_split_table(2).tolist() == engine.split_tables_from_costs(2, False)[0].tolist()


def test_under_decode_path_both_a_dropped_model_takes_its_device_with_it_without_a_garbage_collection(model_folder):
    """Each node keeps its latest "both" step for the decoder (last_split), and the step held the node: node and step
    in a cycle, holding the engine and the device until a garbage collection. A CUDA device waiting so keeps its cap
    on CuPy's pool (none: unlimited) and its slots' memory, which the next load's reading of free memory misses
    (tests/test_offload_cuda.py checks the CUDA device's)."""
    import gc
    import weakref

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    greedy_run(model, steps=2)
    nodes = [runner for runner in model.decoder.steps if getattr(runner, "last_split", None) is not None]
    assert len(nodes) == SPEC.layers  # every layer's last step a "both" step, kept
    dropped = [weakref.ref(held) for held in (model, model.offload, device, *nodes)]
    gc.disable()
    try:
        del model, device, nodes
        alive = [ref() for ref in dropped if ref() is not None]
        assert not alive, f"{type(alive[0]).__name__} outlived its drop: {holders(alive[0], skip=(alive,))}"
    finally:
        gc.enable()


def test_under_decode_path_both_a_short_slowdowns_steps_leave_the_cpus_rate_as_it_was(model_folder, cpu_run):
    """The CPU parts of "both" steps reach the split's rate as each step ends, through its slow-step gate
    (spike_gate.py): two decode steps whose parts took 3x their time (other work on the machine) are left out, and the
    rate is the line the other steps' parts lie on (their seconds made exact here: 40 µs + bytes at 0.5 GB/s; at a
    real 80 GB/s this model's 16 KiB experts would leave 99% of a call to its fixed cost, a line CpuRate refuses)."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    ended, slow = [], [False]  # decode steps ended; whether the parts now observed are slowed
    end_step, observe = model.decoder.on_step_end, engine.split_gate.observe

    def on_step_end(step_s, tokens):
        ended.append(tokens == 1)
        end_step(step_s, tokens)
        slow[0] = sum(ended) in (6, 7)  # the 7th and 8th decode steps

    model.decoder.on_step_end = on_step_end
    engine.split_gate.observe = lambda nbytes, seconds: observe(
        nbytes, (3.0 if slow[0] else 1.0) * (40e-6 + nbytes / 0.5e9))
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert engine.split_gate.left_out == 2
    assert engine.split_rate.value == pytest.approx(0.5e9) and engine.split_rate.fixed_s == pytest.approx(40e-6)
    assert engine.copy_state()["decode_path"]["cold_split"]["slow_steps_left_out"] == 2


def test_under_decode_path_both_trials_shift_the_cpus_share_where_its_steps_run_faster(model_folder, cpu_run):
    """The share trials (split_share.py) time "both" steps with the table as made, with the CPU taking one cold pair
    fewer at every count and one more, and keep the fastest by their margin: here (step times given) one fewer. The
    tables are then made from the rates and shifted; the answers stay the all-CPU run's throughout."""
    from kernels.cold_split import cpu_take_table
    from engine.offload.split_share import FEWER, SplitShareTrials, shifted

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    engine.share_trials = SplitShareTrials(first=1, settle=1, window=2, recheck=100)
    step_s = {0: 0.030, -1: 0.020, 1: 0.040}  # a decode step's seconds under each shift
    # the trials compare these alone: end_step adds the wall time of the accounts each step left for it, which a
    # loaded machine stretched by 8 ms once
    engine._trial_seconds = lambda seconds: step_s[engine.share_trials.shift]
    shifts = []

    def end_step(seconds, tokens):
        if tokens == 1:  # (a prompt's step is not timed)
            shifts.append(engine.share_trials.shift)
            seconds = step_s[engine.share_trials.shift]
        engine.end_step(seconds, tokens)

    model.decoder.on_step_end = end_step
    for _ in range(2):  # 24 decode steps
        assert_same_as_cpu(greedy_run(model), cpu_run)
    # each decode step's shift: 1 skipped, 2 timed as made, then 1 settling and 2 timed with each shift and as made
    assert shifts == [0] * 3 + [-1] * 3 + [1] * 3 + [0] * 3 + [-1] * 12, shifts
    assert engine.share_trials.choice == FEWER and engine.share_trials.trials == 1
    engine._split_tables.clear()
    info, store = engine.infos[0], engine.stores[0]
    made = cpu_take_table(SPEC.top_k, info.bytes_per_expert / engine.split_rate.value, engine.split_rate.fixed_s,
                          store.read_bytes / engine.tier_read.value)
    assert engine.cold_split_table(0).tolist() == shifted(made, -1).tolist()
    assert engine.copy_state()["decode_path"]["cold_split"]["share"] == {
        "shift": -1, "trials": 1, "measuring": None,
        "measured_ms": {"as made": pytest.approx(30.0, abs=1.0), "one fewer": pytest.approx(20.0, abs=1.0),
                        "one more": pytest.approx(40.0, abs=1.0)}}


@pytest.mark.parametrize("faster", ["a pair split by rows", "whole pairs"])
def test_under_decode_path_both_trials_keep_a_pair_split_by_rows_only_where_its_steps_run_faster(tmp_path, faster):
    """The row trials (split_share.py: RowSplitTrials) time "both" steps with whole pairs (preferred) and with a pair
    split by rows, after the share trials and never beside them, and keep the split only where its steps run faster
    (step times given; the costs fixed so that the split's table splits a pair): the rows then come from split_tables,
    else none; the answers stay the all-CPU run's throughout."""
    from engine.offload.split_share import SPLIT_ROWS, WHOLE_PAIRS, RowSplitTrials, SplitShareTrials
    from kernels.cold_split import split_tables

    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)
    folder = write_model(tmp_path / "m", spec)
    reference = greedy_run(LoadedModel.open(folder), steps=30)
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    engine = model.offload
    assert engine.rows_choosable()
    engine._split_costs = lambda layer: (100e-6, 0.0, 100e-6)  # the CPU and the GPU alike: the table splits a pair
    engine.share_trials = SplitShareTrials(first=1, settle=1, window=2, recheck=1000)
    engine.row_trials = RowSplitTrials(first=1, settle=1, window=2, recheck=1000)
    step_s = {faster: 0.020, ({SPLIT_ROWS, WHOLE_PAIRS} - {faster}).pop(): 0.030}
    engine._trial_seconds = lambda seconds: step_s[engine.row_trials.choice]
    ways, rows = [], []

    def end_step(seconds, tokens):
        engine.end_step(step_s[engine.row_trials.choice], tokens)
        if tokens == 1:  # after each decode step: which trial measures, the way in force and its rows
            ways.append((engine.share_trials.measuring, engine.row_trials.measuring, engine.row_trials.choice))
            rows.append(engine.cold_split_rows(0))

    model.decoder.on_step_end = end_step
    assert_same_as_cpu(greedy_run(model, steps=30), reference)
    assert not any(share and row for share, row, _way in ways)  # never both at once
    share_ends = max(i for i, (share, _row, _way) in enumerate(ways) if share)
    row_steps = [i for i, (_share, row, _way) in enumerate(ways) if row]
    assert row_steps and min(row_steps) > share_ends  # the row trial after the share trial
    timed = [way for _share, row, way in ways if row]
    assert SPLIT_ROWS in timed and timed[0] == WHOLE_PAIRS  # whole pairs in force first, the split timed after
    assert engine.row_trials.choice == faster and engine.row_trials.trials == 1
    assert all(r is not None and r.any() for r, (_s, _r, way) in zip(rows, ways) if way == SPLIT_ROWS)
    assert all(r is None for r, (_s, _r, way) in zip(rows, ways) if way == WHOLE_PAIRS)
    info = engine.infos[0]
    _take, split_rows = split_tables(info.spec.k, info.spec.inter_size, 64, 100e-6, 0.0, 100e-6, 0.0, 2 / 3,
                                     cpu_reads_fc2_whole=not engine.runners[0].kernel.reads_rows_in_part)
    if faster == SPLIT_ROWS:
        assert rows[-1].tolist() == split_rows.tolist()
    else:
        assert rows[-1] is None
    assert engine.copy_state()["decode_path"]["cold_split"]["rows"] == {
        "splits": faster == SPLIT_ROWS, "trials": 1, "measuring": None,
        "measured_ms": {WHOLE_PAIRS: pytest.approx(step_s[WHOLE_PAIRS] * 1e3), SPLIT_ROWS: pytest.approx(
            step_s[SPLIT_ROWS] * 1e3)}}


def test_a_replan_under_both_drops_the_table_made_with_the_last_share_trials_shift(model_folder):
    """A re-plan (a budget changed on the loaded model) starts the share trials again, from the table as made. The
    table kept from before it, made with the last trial's shift, stayed in force until the next remaking (up to
    SPLIT_TABLE_EVERY decode steps), beside records that said shift 0."""
    from engine.offload.split_share import FEWER, shifted
    from kernels.cold_split import cpu_take_table

    config = OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4)
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30), decode_path="both", offload=config)
    engine = model.offload
    engine._split_costs = lambda layer: (100e-6, 0.0, 100e-6)
    made = cpu_take_table(SPEC.top_k, 100e-6, 0.0, 100e-6)
    engine.share_trials.choice = FEWER  # as a trial left it
    engine._split_tables.clear()
    assert engine.cold_split_table(0).tolist() == shifted(made, -1).tolist()
    engine.reconfigure(config.updated(device_expert_bytes=2 * config.device_expert_bytes))
    assert engine.splits_cold and engine.share_trials.shift == 0
    assert engine.cold_split_table(0).tolist() == made.tolist()
    assert engine.copy_state()["decode_path"]["cold_split"]["cpu_takes"] == made.tolist()



def test_no_row_trial_where_an_experts_rows_are_too_few_to_split(model_folder):
    """A pair is split at a multiple of ROW_STEP rows below the expert's intermediate size (kernels/cold_split.py:
    split_tables), so experts of ROW_STEP rows or fewer are never split. The row trials still ran there, timing whole
    pairs against whole pairs (trials_pending waiting for them, records saying which "won"); now they do not."""
    from engine.offload.split_share import RowSplitTrials, SplitShareTrials

    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    assert SPEC.inter_size == 64 and engine.stores[0].splits_rows  # the kernels could split: the experts cannot
    engine.share_trials = SplitShareTrials(first=1, settle=1, window=2)
    engine.row_trials = RowSplitTrials(first=1, settle=1, window=2)
    greedy_run(model)
    assert engine.share_trials.trials == 1 and engine.row_trials.trials == 0
    assert not engine.rows_choosable() and not engine.trials_pending
    assert engine.copy_state()["decode_path"]["cold_split"]["rows"] is None


def test_no_row_trial_while_the_split_tables_split_no_pair(tmp_path):
    """Where the split's tables from the costs measured split no pair at any count of cold pairs (here a CPU call
    costs more than the GPU's reads of all four cold pairs: the CPU takes no pair, nor a part of one), the split runs
    whole pairs as the other way does. A row trial still ran there, timing the same steps twice (trials_pending and a
    sweep point's settling waiting for it, records saying which way 'won'); now none starts until the costs make the
    tables split a pair."""
    from engine.offload.engine import SPLIT_TABLE_EVERY
    from engine.offload.split_share import RowSplitTrials, SplitShareTrials
    from kernels.cold_split import split_tables

    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)
    folder = write_model(tmp_path / "m", spec)
    model = LoadedModel.open(folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    engine = model.offload
    assert engine.rows_choosable()  # the kernels and the experts' rows could split a pair: the costs do not
    slow_call = (100e-6, 1e-3, 100e-6)
    assert not split_tables(spec.top_k, spec.inter_size, 64, *slow_call)[1].any()
    engine._split_costs = lambda layer: slow_call
    engine.share_trials = SplitShareTrials(first=1, settle=1, window=2, recheck=1000)
    engine.row_trials = RowSplitTrials(first=1, settle=1, window=2, recheck=1000)
    greedy_run(model, steps=30)
    assert engine.share_trials.trials == 1 and engine.row_trials.trials == 0 and not engine.row_trials.measuring
    assert not engine.trials_pending
    assert engine.copy_state()["decode_path"]["cold_split"]["rows"] is None
    engine._split_costs = lambda layer: (100e-6, 0.0, 100e-6)  # the CPU and the GPU alike: the tables split a pair
    engine._split_tables.clear()  # (as their next remaking does)
    assert engine.trials_pending  # the first row trial is to come
    greedy_run(model, steps=SPLIT_TABLE_EVERY + 12)
    assert engine.row_trials.trials == 1
    assert engine.copy_state()["decode_path"]["cold_split"]["rows"]["trials"] == 1


def splitting_model(tmp_path) -> LoadedModel:
    """A two-layer model under decode path "both" at a quarter resident, whose split tables split a pair (the CPU and
    the GPU priced alike)."""
    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)
    folder = write_model(tmp_path / "m", spec)
    model = LoadedModel.open(folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    model.offload._split_costs = lambda layer: (100e-6, 0.0, 100e-6)
    return model


def trial_steps(model: LoadedModel, first, other, steps: int = 30) -> list[tuple]:
    """Decode `steps` tokens; after each decode step, `first` trials' count and choice and whether `other` times."""
    engine, seen = model.offload, []

    def end_step(seconds, tokens):
        engine.end_step(seconds, tokens)
        if tokens == 1:
            seen.append((first.trials, first.choice, other.measuring))

    model.decoder.on_step_end = end_step
    greedy_run(model, steps=steps)
    return seen


def test_the_row_trials_first_window_settles_after_the_share_trials_last_switch(tmp_path):
    """The share trial ends switching to the share its steps found faster (here one pair fewer), its tables made again
    at once. The trials settle `settle` steps after each switch of their own before timing, but the row trial's first
    window took the very next step, the first with the new share; now it settles first."""
    from engine.offload.split_share import AS_MADE, FEWER, MORE, RowSplitTrials, SplitShareTrials

    model = splitting_model(tmp_path)
    engine = model.offload
    engine.share_trials = SplitShareTrials(first=1, settle=1, window=2, recheck=1000)
    engine.row_trials = RowSplitTrials(first=1, settle=3, window=2, recheck=1000)
    step_s = {AS_MADE: 0.030, FEWER: 0.020, MORE: 0.040}
    engine._trial_seconds = lambda seconds: step_s[engine.share_trials.choice]
    # after each decode step: the share trials finished, the share in force, whether the row trial times
    steps = trial_steps(model, engine.share_trials, engine.row_trials)
    switch = next(index for index, (trials, _share, _rows) in enumerate(steps) if trials == 1)
    assert steps[switch][1] == FEWER and steps[switch - 1][1] == AS_MADE  # the share trial's last switch
    first = next(index for index, (_trials, _share, rows) in enumerate(steps) if rows)  # the row trial's first sample
    assert first - switch == engine.row_trials.settle + 1


def test_the_share_trials_first_window_settles_after_the_row_trials_last_switch(tmp_path):
    """The share trial's wait runs out (here as the row trial starts) while the row trial times; the row trial ends
    switching to the split its steps found faster, its tables made again at once. The share trial, stepped again once
    the row trial ends, timed the very next step, the first with the split, with no settling; now it settles first."""
    from engine.offload.split_share import SPLIT_ROWS, WHOLE_PAIRS, RowSplitTrials, SplitShareTrials

    model = splitting_model(tmp_path)
    engine = model.offload
    engine.share_trials = SplitShareTrials(first=2, settle=3, window=2, recheck=1000)
    engine.row_trials = RowSplitTrials(first=1, settle=1, window=2, recheck=1000)
    step_s = {WHOLE_PAIRS: 0.030, SPLIT_ROWS: 0.020}
    engine._trial_seconds = lambda seconds: step_s[engine.row_trials.choice]
    # after each decode step: the row trials finished, the split in force, whether the share trial times
    steps = trial_steps(model, engine.row_trials, engine.share_trials)
    switch = next(index for index, (trials, _split, _share) in enumerate(steps) if trials == 1)
    assert steps[switch][1] == SPLIT_ROWS and steps[switch - 1][1] == WHOLE_PAIRS  # the row trial's last switch
    assert not any(share for _trials, _split, share in steps[:switch + 1])  # the row trial went first
    first = next(index for index, (_trials, _split, share) in enumerate(steps) if share)  # the share's first sample
    assert first - switch == engine.share_trials.settle + 1


def test_a_shifted_share_stays_within_a_tokens_cold_pairs():
    from engine.offload.split_share import shifted

    table = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4], np.int32)
    assert shifted(table, 0) is table
    assert shifted(table, -1).tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3]
    assert shifted(table, 1).tolist() == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert shifted(np.arange(5, dtype=np.int32), 1).tolist() == [0, 1, 2, 3, 4]  # never more than the c cold pairs
    assert shifted(table, 1).dtype == np.int32


def test_a_switch_to_both_makes_its_table_again_once_its_own_steps_measured_the_tiers_reads(model_folder):
    """At a switch to "both" the GPU's reads from the tier are not yet measured (the table takes TIER_READ_SHARE of
    PCIe); SPLIT_TABLE_FIRST decode steps later the table is made again from what those steps measured, and then
    every SPLIT_TABLE_EVERY steps."""
    from engine.offload.devices import TIER_READ_SHARE
    from engine.offload.engine import SPLIT_TABLE_EVERY, SPLIT_TABLE_FIRST

    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, device=device,
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    engine = model.offload
    engine.set_decode_path("both")
    made = []
    original = engine.cold_split_table

    def counted(layer):
        fresh = not engine._split_tables
        table = original(layer)
        if fresh:
            made.append(engine.tier_read.value)
        return table

    engine.cold_split_table = counted
    state = model.new_state()
    token = int(model.decoder.forward(state, model.tokenizer.encode("Tables follow the rates."))[-1][-1].argmax())
    steps = SPLIT_TABLE_FIRST + SPLIT_TABLE_EVERY + 1
    for _ in range(steps):
        token = int(model.decoder.forward(state, [token])[-1][-1].argmax())
    # made at the first step (nothing measured), after SPLIT_TABLE_FIRST steps and SPLIT_TABLE_EVERY after that, each
    # time from the tier's reads as measured by then
    assert len(made) == 3 and made[0] is None
    assert made[1] == made[2] == pytest.approx(TIER_READ_SHARE * device.bandwidths.pcie)


def engine_without_device(model_folder):
    """An offload engine planned for no device: every expert node runs on the CPU."""
    from engine.expert_node import CpuExpertNode
    from engine.offload.engine import OffloadEngine

    steps = LoadedModel.open(model_folder).decoder.steps
    runners = [step for step in steps if isinstance(step, CpuExpertNode)]
    assert len(runners) == SPEC.layers
    return OffloadEngine(runners, OffloadConfig(), None)


def test_high_water_mark_never_exceeds_the_limit(model_folder):
    total = expert_bytes(model_folder)
    limit = total // 2
    device = SimulatedDevice(1 << 30, mem_limit=limit)
    config = OffloadConfig(gpu_device_mem_limit=limit, reserve_device_bytes=0)
    model = LoadedModel.open(model_folder, offload=config, device=device)
    greedy_run(model, steps=4)
    assert 0 < device.memory.high_water <= limit
    with pytest.raises(DeviceMemoryError, match="gpu_device_mem_limit"):
        device.memory.reserve(limit, "a test allocation")
    assert device.memory.high_water <= limit


def test_required_mode_names_the_unsupported_node(copy_fixture, cli):
    import onnx

    folder = copy_fixture("gptoss")
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    node = next(n for n in proto.graph.node if n.op_type == "QMoE")
    next(a for a in node.attribute if a.name == "expert_weight_bits").i = 5
    onnx.save(proto, str(folder / "model.onnx"))
    result = cli("inspect", str(folder), "--device", "simulated", "--offload", "mode=required")
    assert_clean_error(result, "required", node.name, "bits 5")


def test_inspect_and_the_estimate_plan_the_nodes_the_engine_runs_and_name_each_left_out(tmp_path, cli):
    """A model with a node the engine cannot run: inspect planned every expert node, the unsupported one among its
    slots, while the budget estimate planned those the engine runs (the load's OffloadEngine plans its runners, and
    the load refuses the model), and neither said which node the plan left out. Both now plan the nodes the engine
    runs, name each node left out and why, in the same sentences, and refuse mode=required in the same words."""
    from app.gui.estimate import DeviceChoice, estimate, model_facts
    from app.inspect_report import inspection
    from engine.model_folder import ModelFolder
    from tests.test_bad_input import _attribute, _edit_onnx, _qmoe

    folder = write_model(tmp_path / "m", WriterSpec(layers=3, num_experts=8, top_k=2, hidden_size=64, inter_size=64,
                                                    seed=23, dense_accuracy_level=0))
    _edit_onnx(folder, lambda model: _attribute(_qmoe(model), "expert_weight_bits", 5))
    opened = ModelFolder.open(folder)
    facts = model_facts(opened, inspection(opened))
    slot = facts.experts[1].device_bytes_per_expert
    left_out = ("Expert node '/model/layers.0/moe/QMoE' (layer 0) is left out of the plan: expert weight bits 5 is "
                "invalid (supported: int2, int3, int4, int8); the load refuses the model while it has this node.")
    entries = {"device_expert_bytes": str(5 * slot), "placement": "static"}
    result = cli("inspect", str(folder), "--json", "--device", "simulated", "--simulated-vram", "1GiB",
                 *[f"--offload={key}={value}" for key, value in entries.items()])
    planned = json.loads(result.stdout)["offload"]
    est = estimate(facts, OffloadConfig.from_entries(entries), DeviceChoice("simulated", 1 << 30))
    assert planned["slots"] == est.plan.slots == {"/model/layers.1/moe/QMoE": 3, "/model/layers.2/moe/QMoE": 2}
    assert planned["statements"][:2] == [left_out, f"5 expert slots for the 16 experts on the simulated GPU, 1.0 GiB "
                                                   f"({human_bytes(5 * slot)} of a {human_bytes(5 * slot)} expert "
                                                   "budget)."]
    assert est.statements == planned["statements"] + [
        "The dense part would run on the CPU: the GPU is simulated, for the experts only."]
    refusal = ("offload mode 'required': node '/model/layers.0/moe/QMoE': expert weight bits 5 is invalid (supported: "
               "int2, int3, int4, int8)")
    assert estimate(facts, OffloadConfig(mode="required"), DeviceChoice("simulated", 1 << 30)).error == refusal
    assert_clean_error(cli("inspect", str(folder), "--device", "simulated", "--offload", "mode=required"), refusal)


def test_node_overrides_naming_a_node_left_out_of_the_plan_say_why_it_is_left_out(tmp_path, cli):
    """An override of a node the engine cannot run was refused by inspect and the budget estimate as naming "no expert
    node of this model", which it is: the plan leaves it out. The refusal says so now, and why."""
    from app.gui.estimate import DeviceChoice, estimate, model_facts
    from app.inspect_report import inspection
    from engine.model_folder import ModelFolder
    from tests.test_bad_input import _attribute, _edit_onnx, _qmoe

    folder = write_model(tmp_path / "m", WriterSpec(layers=2, num_experts=8, top_k=2, hidden_size=64, inter_size=64,
                                                    seed=23, dense_accuracy_level=0))
    _edit_onnx(folder, lambda model: _attribute(_qmoe(model), "expert_weight_bits", 5))
    opened = ModelFolder.open(folder)
    refusal = ("node_overrides names '/model/layers.0/moe/QMoE', an expert node left out of the plan: expert weight "
               "bits 5 is invalid (supported: int2, int3, int4, int8)")
    override = "/model/layers.0/moe/QMoE:max_resident_slots=1"
    assert_clean_error(cli("inspect", str(folder), "--device", "simulated", "--offload", f"node_overrides={override}"),
                       refusal)
    est = estimate(model_facts(opened, inspection(opened)), OffloadConfig.from_entries({"node_overrides": override}),
                   DeviceChoice("simulated", 1 << 30))
    assert est.error == refusal and est.plan is None


def test_required_mode_refuses_a_budget_that_holds_no_expert(model_folder):
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts
    smallest = min(info.device_bytes_per_expert for info in experts)
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(mode="required", device_expert_bytes=10), experts, SimulatedDevice(1 << 30))
    assert str(error.value) == ("offload mode 'required': the expert budget of 10 bytes holds no expert (the smallest "
                                f"needs {smallest} bytes on the device)")
    # the automatic budget: the refusal says that the reserve took the device's memory, as mode=auto's plan says
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(mode="required"), experts, SimulatedDevice(20 << 20))
    assert str(error.value) == ("offload mode 'required': the automatic expert budget of 0 bytes holds no expert (the "
                                f"smallest needs {smallest} bytes on the device): of the 20.0 MiB the device has free "
                                "it keeps 20.0 MiB for KV cache and workspace (reserve_device_bytes); set a smaller "
                                "reserve or a device_expert_bytes")


def test_disabled_mode_puts_every_expert_where_the_dense_part_runs(model_folder, cpu_run, monkeypatch):
    """As onnxruntime runs a QMoE node whole on its execution provider when offload is off: every expert on the device
    where the dense part goes there (whatever the budgets say), on the CPU where it does not, and a device too small
    for them is refused in one line that says what would run the model."""
    from engine import generation
    from engine.model_folder import ModelFolder
    from engine.offload.planner import all_resident_bytes

    experts = ModelFolder.open(model_folder).experts
    need = all_resident_bytes(experts)
    disabled = OffloadConfig(mode="disabled", device_expert_bytes=0, reserve_device_bytes=0)
    plan = plan_offload(disabled, experts, SimulatedDevice(need), dense_on_device=True)
    assert plan.placement_mode == "all_resident" and plan.budget_bytes == need
    assert plan.slots == {info.name: info.spec.num_experts for info in experts}
    assert plan.statements[0].startswith(f"All {3 * 16} of {3 * 16} experts resident on the simulated GPU")
    assert "where the dense part runs" in plan.statements[0]
    on_cpu = plan_offload(disabled, experts, SimulatedDevice(need), dense_on_device=False)
    assert on_cpu.placement_mode == "cpu_only" and set(on_cpu.slots.values()) == {0}
    assert on_cpu.statements == ["All experts run on the CPU: offload is disabled, and the dense part runs on the CPU."]
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(disabled, experts, SimulatedDevice(need - 1), dense_on_device=True)
    assert str(error.value).startswith("offload mode 'disabled' keeps every expert where the dense part runs, on the "
                                       "simulated GPU")
    assert str(error.value).endswith("mode=auto keeps the experts that do not fit on the CPU")
    # a load whose dense part goes to the device (as with onnxruntime-gpu on a CUDA GPU) plans so, and answers exactly
    monkeypatch.setattr(generation, "dense_goes_to", lambda device, dtypes: device is not None)
    model = LoadedModel.open(model_folder, offload=disabled, device=SimulatedDevice(4 * need))
    assert model.offload.plan.placement_mode == "all_resident" and model.dense_device == "cpu"
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = model.offload.stats.totals()
    assert totals.misses == 0 and totals.hits > 0


def test_a_substitution_rank_no_node_routes_is_refused_while_substitution_is_on(model_folder):
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts
    k = experts[0].spec.k
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(tail_substitution_threshold=0.1, tail_substitution_min_rank=k), experts,
                     SimulatedDevice(1 << 30))
    assert str(error.value) == (f"tail_substitution_min_rank={k}: node '{experts[0].name}' routes {k} experts a token "
                                f"(ranks 0 to {k - 1}), so no rank from {k} on is there to substitute (onnxruntime "
                                f"refuses it while tail_substitution_threshold is set)")
    plan_offload(OffloadConfig(tail_substitution_threshold=0.1, tail_substitution_min_rank=k - 1), experts,
                 SimulatedDevice(1 << 30))
    plan_offload(OffloadConfig(tail_substitution_min_rank=k), experts, SimulatedDevice(1 << 30))  # substitution off


def test_a_substitution_rank_no_node_routes_is_refused_without_a_device_too(model_folder):
    """With every expert on the CPU approximate routing still applies (it drops cold experts, and every one is cold):
    tail_substitution_min_rank=k was taken there and refused on a device, so a configuration tried on the CPU failed
    only once moved to a GPU. It is refused alike; under mode=disabled, where approximate routing does not apply, it is
    not."""
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts
    k = experts[0].spec.k
    config = OffloadConfig(tail_substitution_threshold=0.1, tail_substitution_min_rank=k)
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(config, experts, None)
    assert str(error.value).startswith(f"tail_substitution_min_rank={k}: node '{experts[0].name}' routes {k} experts")
    assert plan_offload(config.updated(mode="disabled"), experts, None).placement_mode == "cpu_only"


def test_a_top_1_model_refuses_substitution_from_the_default_rank_in_plain_words(tmp_path):
    from engine.model_folder import ModelFolder
    from engine.writer import WriterSpec, write_model

    experts = ModelFolder.open(write_model(tmp_path / "top1", WriterSpec(layers=1, top_k=1))).experts
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(tail_substitution_threshold=0.1), experts, SimulatedDevice(1 << 30))
    assert f"node '{experts[0].name}' routes 1 expert a token (ranks 0 to 0), so no rank from 1 on" in str(error.value)


def test_a_budget_bounded_by_gpu_device_mem_limit_names_the_limit_not_the_cards_free_memory(model_folder):
    """Under gpu_device_mem_limit the budget's refusals and notes said "the 33.9 KiB the device has free" of an 8 GiB
    card: the limit is what bounds it, and a smaller reserve (their advice) does not lift it."""
    from engine.model_folder import ModelFolder
    from engine.offload.planner import BudgetAboveFree

    experts = ModelFolder.open(model_folder).experts
    limit = 3 * experts[0].device_bytes_per_expert
    device = lambda: SimulatedDevice(8 << 30, mem_limit=limit)  # noqa: E731
    plan = plan_offload(OffloadConfig(), experts, device())
    assert (f"The automatic budget holds no expert: of the {human_bytes(limit)} the device has free under "
            f"gpu_device_mem_limit={limit} it keeps {human_bytes(limit)} for KV cache and workspace "
            "(reserve_device_bytes); set a smaller reserve, a device_expert_bytes or a larger gpu_device_mem_limit."
            ) in plan.statements
    plan = plan_offload(OffloadConfig(device_expert_bytes=2 * limit), experts, device())
    assert (f"device_expert_bytes={2 * limit} is more than the device has free under gpu_device_mem_limit={limit}; "
            f"the budget is {human_bytes(limit)}.") in plan.statements
    with pytest.raises(BudgetAboveFree) as error:
        plan_offload(OffloadConfig(mode="required", device_expert_bytes=2 * limit), experts, device())
    # why it is refused (auto would hold the budget to what is free), and the free memory as a size too
    assert str(error.value) == (f"offload mode 'required': device_expert_bytes={2 * limit} exceeds the "
                                f"{human_bytes(limit)} ({limit} bytes) the device has free under "
                                f"gpu_device_mem_limit={limit}")
    # without a limit that bounds it, the device's free memory as before
    plan = plan_offload(OffloadConfig(device_expert_bytes=2 << 30), experts, SimulatedDevice(1 << 30, mem_limit=4 << 30))
    assert "device_expert_bytes=2147483648 is more than the device has free; the budget is 1.0 GiB." in plan.statements


def test_a_reserve_beside_an_expert_budget_is_said_to_change_nothing(model_folder):
    """reserve_device_bytes sizes the automatic budget only: set beside a device_expert_bytes it changed nothing, and a
    change of it on the loaded model re-planned to the same slots without a word."""
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts
    budget = 3 * experts[0].device_bytes_per_expert
    plans = [plan_offload(OffloadConfig(device_expert_bytes=budget, reserve_device_bytes=reserve), experts,
                          SimulatedDevice(1 << 30)) for reserve in (0, 1 << 29)]
    assert plans[0].slots == plans[1].slots
    assert (f"reserve_device_bytes={1 << 29} does not apply: device_expert_bytes sets the expert budget (the reserve "
            "sizes the automatic one).") in plans[1].statements
    automatic = plan_offload(OffloadConfig(reserve_device_bytes=1 << 29), experts, SimulatedDevice(1 << 30))
    assert not any("does not apply" in said for said in automatic.statements)


def test_a_node_override_budget_that_holds_no_expert_is_said_and_refused_under_required(model_folder):
    """node_overrides' device_expert_bytes below one of the node's experts left it without a slot without a word, and
    mode=required, which refuses a capacity that does not fit, took it."""
    from engine.model_folder import ModelFolder
    from engine.offload.config import NodeOverride

    experts = ModelFolder.open(model_folder).experts
    node, slot = experts[0].name, experts[0].device_bytes_per_expert
    overrides = {node: NodeOverride(device_expert_bytes=10)}
    plan = plan_offload(OffloadConfig(node_overrides=overrides), experts, SimulatedDevice(1 << 30))
    assert plan.slots[node] == 0
    assert (f"node_overrides give node '{node}' device_expert_bytes=10, less than one of its experts on the device "
            f"({slot} bytes): it keeps none there.") in plan.statements
    with pytest.raises(OffloadPlanError) as error:
        plan_offload(OffloadConfig(mode="required", node_overrides=overrides), experts, SimulatedDevice(1 << 30))
    assert str(error.value) == (f"offload mode 'required': node_overrides give node '{node}' device_expert_bytes=10, "
                                f"less than one of its experts on the device ({slot} bytes)")
    roomy = plan_offload(OffloadConfig(node_overrides={node: NodeOverride(device_expert_bytes=slot)}), experts,
                         SimulatedDevice(1 << 30))
    assert roomy.slots[node] == 1 and not any("node_overrides" in said for said in roomy.statements)


def test_an_automatic_budget_that_holds_no_expert_says_why(model_folder):
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts
    plan = plan_offload(OffloadConfig(), experts, SimulatedDevice(20 << 20))  # below the automatic 512 MiB reserve
    assert plan.budget_bytes == 0 and sum(plan.slots.values()) == 0
    assert ("The automatic budget holds no expert: of the 20.0 MiB the device has free it keeps 20.0 MiB for KV cache "
            "and workspace (reserve_device_bytes); set a smaller reserve or a device_expert_bytes.") in plan.statements
    roomy = plan_offload(OffloadConfig(), experts, SimulatedDevice(1 << 30))
    assert not any("holds no expert" in said for said in roomy.statements)


def test_a_gpu_device_mem_limit_the_device_never_reaches_is_said_to_have_no_effect(model_folder):
    """gpu_device_mem_limit above the card's memory was taken without a word, so the user believed the process bounded
    by it. The plan says once that it is more than the card (or than what other processes leave it) and bounds
    nothing; a limit that bounds is not said so."""
    from engine.model_folder import ModelFolder

    experts = ModelFolder.open(model_folder).experts

    def said(device) -> list[str]:
        plan = plan_offload(OffloadConfig(gpu_device_mem_limit=device.memory.limit), experts, device)
        return [statement for statement in plan.statements if "gpu_device_mem_limit" in statement]

    assert said(SimulatedDevice(1 << 30, mem_limit=16 << 30)) == [
        "gpu_device_mem_limit=16.0 GiB is more than the card's 1.0 GiB of memory: it has no effect."]
    assert said(SimulatedDevice(1 << 30, mem_limit=768 << 20, others_bytes=512 << 20)) == [
        "gpu_device_mem_limit=768.0 MiB is more than the 512.0 MiB the card has free for this process (other "
        "processes hold 512.0 MiB): the free memory bounds the plan, not the limit."]
    assert said(SimulatedDevice(1 << 30, mem_limit=768 << 20)) == []


@pytest.mark.parametrize("judged", [True, False])
def test_adaptive_placement_reaches_the_hot_set(judged):
    """A skewed workload (a hot set of 6 of 32 experts takes 90% of routing, with recency): once
    warmed, the resident set is exactly the hot set and nearly every hit is resident, the judge of its swaps
    (swap_judge.py, the default) letting every swap that brings the hot set in be made."""
    rng = np.random.default_rng(0)
    hot = rng.choice(32, 6, replace=False)
    layer = LayerSlots(32, 6)
    policy = make_policy("adaptive", [layer]) if judged else AdaptivePlacement([layer])
    hits = total = 0
    for step in range(400):
        pool = hot if rng.random() < 0.9 else np.setdiff1d(np.arange(32), hot)
        ids = rng.choice(pool, 2, replace=False)
        if step >= 100:
            hits += np.count_nonzero(layer.slot_of[ids] >= 0)
            total += ids.size
        policy.observe(0, ids)
        policy.rebalance()
    assert set(layer.resident()) == set(hot.tolist())
    assert hits / total >= 0.85


def test_adaptive_beats_static_on_realistic_routing():
    trace = realistic_trace(600, 2, 64, 8, seed=5)
    adaptive, static = hit_rate("adaptive", trace, 64, 32), hit_rate("static", trace, 64, 32)
    assert adaptive > static + 0.2 and adaptive > 0.8


def test_budget_change_takes_effect_without_reload(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=0), device=device)
    segments_before = [id(step) for step in model.decoder.steps]
    assert sum(model.offload.plan.slots.values()) == 0
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=device_expert_bytes(model_folder)))
    assert [id(step) for step in model.decoder.steps] == segments_before  # nothing was rebuilt
    assert model.offload.plan.placement_mode == "all_resident"
    model.offload.stats.reset(len(model.offload.slots))
    logits, tokens = greedy_run(model)
    assert tokens == cpu_run[1]
    assert model.offload.stats.totals().misses == 0 and model.offload.stats.totals().hits > 0
    model.offload.reconfigure(model.offload.config.updated(device_expert_bytes=0))
    assert device.memory.by_purpose.get("expert slots of /model/layers.0/moe/QMoE") == 0


TRUNCATED_APPLY = """
import sys
from pathlib import Path
from engine.errors import ModelFileError
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
folder, budget = Path(sys.argv[1]), int(sys.argv[2])
model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=budget), device=SimulatedDevice(1 << 30))
engine = model.offload
config, plan, residents = engine.config, engine.plan, [layer.expert_in.tolist() for layer in engine.slots]
data = folder / "model.onnx.data"
data.write_bytes(data.read_bytes()[:4096])
try:
    engine.reconfigure(config.updated(device_expert_bytes=2 * budget, allow_file_backing=False))
except ModelFileError as exc:
    print(exc)
print(engine.config is config, engine.plan is plan, [layer.expert_in.tolist() for layer in engine.slots] == residents,
      any(runner.in_memory for runner in engine.runners))
"""


def test_an_apply_after_the_data_file_was_truncated_is_refused_by_name_not_a_crash(model_folder, tmp_path):
    """An Apply reads the mapped experts (here the copy into RAM allow_file_backing=0 asks; on a card the residents
    copied into the new slots, the host tier's rows): past the end of a data file cut short since the load, the read
    killed the process (SIGBUS; the GUI closed with no message). It is refused by name, the configuration in force
    kept. In a process of its own, so that a crash fails the test rather than ending pytest."""
    folder = tmp_path / "m"
    shutil.copytree(model_folder, folder)
    whole = (folder / "model.onnx.data").stat().st_size
    result = subprocess.run([sys.executable, "-c", TRUNCATED_APPLY, str(folder), str(device_expert_bytes(folder) // 4)],
                            cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines() == [
        f"{folder / 'model.onnx.data'}: truncated since the model was loaded: it has 4096 bytes of the {whole} its "
        "initializers take; load the model again", "True True True False"]


def _cut_short(data, size: int) -> str:
    """Cut `data` short by a few bytes, its last page kept (the simulated device copies nothing, and a process that
    reads on regardless lives to fail); the refusal that names it."""
    os.truncate(data, size - 4)
    return (f"{data}: truncated since the model was loaded: it has {size - 4} bytes of the {size} its initializers "
            "take; load the model again")


def _written_in_place(data, size: int) -> str:
    """Write to `data` in place at its size, its modification time past the timestamps' granularity; the refusal."""
    with open(data, "r+b") as file:
        file.write(b"\0")
    stamp = data.stat()
    os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
    return f"{data}: changed since the model was loaded (written to in place); load the model again"


@pytest.mark.parametrize("change", [_cut_short, _written_in_place], ids=["cut short", "written to in place"])
def test_a_data_file_changed_during_a_step_stops_the_answer_at_its_safe_point_before_placement_moves(model_folder,
                                                                                                     tmp_path, change):
    """The decoder checks the mapped files before each step, not after: placement's moves at the step's safe point
    copy experts from the mapped file (on a card, read by the CPU into the pinned ring). Past the end of a data file
    cut short during the step that read killed the process (SIGBUS); from one written to in place during the step it
    copied other weights than the loaded model's, since the safe point checked the sizes only (the answer stopped at
    the next step's check, those experts already moved). The safe point makes the step's check, sizes and modification
    times: the answer stops there with the refusal naming the file, placement's tables as they were, no expert
    copied."""
    from engine.errors import ModelFileError
    from engine.generation import GenerationParams, generate

    folder = tmp_path / "m"
    shutil.copytree(model_folder, folder)
    data = folder / "model.onnx.data"
    size = data.stat().st_size
    prompt = "The expert offload engine must be exact."

    def half_budget() -> LoadedModel:
        model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 2),
                                 device=SimulatedDevice(1 << 30))
        model.offload.set_layer_split("spread")  # no trial's re-plan at the safe point: placement's moves alone
        return model

    def moves(engine) -> int:
        totals = engine.stats.totals()
        return totals.fills + totals.swaps

    def first_decode_safe_point(model: LoadedModel, before) -> dict:
        """The moves and tables at the first decode step's safe point, before it and after; `before` runs first."""
        engine, safe_point, seen = model.offload, model.decoder.on_step_end, {}

        def watched(seconds, tokens) -> None:
            if tokens == 1 and not seen:
                before()
                seen["before"] = (moves(engine), [layer.expert_in.tolist() for layer in engine.slots])
                safe_point(seconds, tokens)
                seen["after"] = (moves(engine), [layer.expert_in.tolist() for layer in engine.slots])
            else:
                safe_point(seconds, tokens)

        model.decoder.on_step_end = watched
        return seen

    model = half_budget()  # the file whole: that safe point moves experts
    seen = first_decode_safe_point(model, lambda: None)
    generate(model, model.new_state(), [], model.tokenizer.encode(prompt), GenerationParams(max_new_tokens=8))
    assert seen["after"][0] > seen["before"][0]

    model = half_budget()
    said = []
    seen = first_decode_safe_point(model, lambda: said.append(change(data, size)))
    with pytest.raises(ModelFileError) as refused:
        generate(model, model.new_state(), [], model.tokenizer.encode(prompt), GenerationParams(max_new_tokens=8))
    assert said and str(refused.value) == said[0]
    assert "after" not in seen and model.decoder.profile["steps"] == 1  # the prefill's: stopped at the safe point
    assert (moves(model.offload), [layer.expert_in.tolist() for layer in model.offload.slots]) == seen["before"]


def test_adaptive_slots_are_filled_when_the_budget_changes(model_folder):
    """A partial budget on a loaded model fills every slot it wants resident at once (learnt scores first), before
    any step: left empty, slots filled one swap at a time within the swap allowance (seen on the H200: hit rate
    0.08 at 25%). The slots left to copied misses (miss_slots) stay empty."""
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))
    engine = model.offload
    greedy_run(model, steps=2)  # scores learnt without slots
    learnt = [scores.copy() for scores in engine.policy.scores]
    # the CPU rate measured on this tiny model (mostly call overhead) would leave every slot to copied misses: forgot
    engine.cpu_rate = CpuRate()
    engine.reconfigure(engine.config.updated(device_expert_bytes=device_expert_bytes(model_folder) // 4))
    for index, (layer, scores) in enumerate(zip(engine.slots, learnt)):
        assert 0 < layer.num_slots < layer.num_experts
        wanted = engine.policy.wanted_slots(index)
        assert wanted == layer.num_slots - engine.policy.miss_slots[index] > 0
        assert np.count_nonzero(layer.expert_in >= 0) == wanted  # every wanted slot filled, the miss slots empty
        best = np.argsort(-scores, kind="stable")[:wanted]
        assert set(layer.expert_in[layer.expert_in >= 0].tolist()) == set(best.tolist())
    assert engine.stats.totals().fills == sum(engine.policy.wanted_slots(i) for i in range(len(engine.slots)))
    assert engine.stats.totals().swaps == 0
    # what records and the placement view say of placement's swaps: nothing judged yet (fills are not swaps)
    assert engine.copy_state()["placement"] == {"swaps_paused": False, "net_hits_per_swap": None}


def test_a_replan_copies_its_kept_residents_back_without_counting_them_as_placements_swaps(model_folder):
    """A re-plan copies the residents it keeps into the new slots (bytes copied, as on a real device), but those are no
    placement swaps or fills: every Apply of the same budget added one 'swap' per resident expert to the placement
    view's count and the records' (and the layer split's trials re-plan by themselves)."""
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder)
                                                                 // 4), device=SimulatedDevice(1 << 30))
    engine = model.offload
    before = engine.stats.totals()
    kept = sum(int(np.count_nonzero(layer.expert_in >= 0)) for layer in engine.slots)
    assert before.fills == kept > 0 and before.swaps == 0  # placement's fills at load
    engine.reconfigure(engine.config)
    after = engine.stats.totals()
    assert (after.fills, after.swaps) == (before.fills, before.swaps)
    assert after.copy_bytes - before.copy_bytes == sum(
        int(np.count_nonzero(layer.expert_in >= 0)) * store.expert_bytes for layer, store in zip(engine.slots,
                                                                                               engine.stores))


def test_placements_fills_of_empty_slots_are_counted_apart_from_its_swaps(model_folder):
    """Filling the slots at load was counted as placement swaps: `generate --json` said swaps: 16 for a run with every
    expert resident, and the placement view '22 swaps' straight after a load, though routing had moved nothing. Fills
    (placement's copies into empty slots) have a count of their own; swaps count the residents placement replaced at
    a safe point because routing moved; the bytes copied count both."""
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder)
                                                                 // 4), device=SimulatedDevice(1 << 30))
    engine = model.offload
    resident = [int(np.count_nonzero(layer.expert_in >= 0)) for layer in engine.slots]
    said = engine.stats_dict()
    assert (said["fills"], said["swaps"]) == (sum(resident), 0) and min(resident) > 0
    assert [(layer["fills"], layer["swaps"]) for layer in said["layers"]] == [(count, 0) for count in resident]
    copied = said["copy_bytes"]
    layer = engine.slots[0]
    cold = int(np.flatnonzero(layer.slot_of < 0)[0])
    engine.policy.scores[0][cold] = 1e6  # routing made a cold expert the best: the next safe point swaps it in
    engine.end_step()
    assert layer.slot_of[cold] >= 0
    said = engine.stats_dict()
    assert (said["fills"], said["swaps"]) == (sum(resident), 1)
    assert said["copy_bytes"] == copied + engine.stores[0].expert_bytes


def test_gpu_mem_limit_cannot_change_on_a_loaded_model(model_folder):
    model = LoadedModel.open(model_folder, offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    with pytest.raises(Exception, match="gpu_device_mem_limit"):
        model.offload.reconfigure(model.offload.config.updated(gpu_device_mem_limit=1 << 20))


def test_prefill_streams_busy_cold_experts_in_waves(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)
    config = OffloadConfig(device_expert_bytes=0, prefill_wave_experts=3)
    model = LoadedModel.open(model_folder, offload=config, device=device)
    prompt = " ".join(["many tokens make the prompt long enough to stream experts"] * 6)
    state = model.new_state()
    logits = model.decoder.forward(state, model.tokenizer.encode(prompt))
    totals = model.offload.stats.totals()
    assert totals.copy_bytes > 0 and totals.device_s > 0  # experts went to the device through the ring
    assert device.memory.by_purpose["prefill staging ring"] == 2 * 3 * max(  # wave slots in the GPU layout
        i.device_bytes_per_expert for i in model.offload.infos)
    reference = LoadedModel.open(model_folder)
    expected = reference.decoder.forward(reference.new_state(), reference.tokenizer.encode(prompt))
    assert np.abs(logits - expected).max() / np.abs(expected).max() <= 1e-5


def test_a_prefill_wave_above_a_layers_experts_takes_staging_for_a_layers_experts_only(model_folder):
    """A wave streams one layer's cold experts, so at most its experts; prefill_wave_experts=100000 on a model of 16
    experts a layer reserved device staging and planned a pinned ring for 100,000 experts a wave: here 1 GiB of the
    simulated device's, which left the expert slots nothing, and a ring of 200,000 experts."""
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=0, prefill_wave_experts=100000),
                             device=device)
    engine = model.offload
    slot = max(info.device_bytes_per_expert for info in engine.infos)
    assert engine.wave_experts == SPEC.num_experts
    assert device.memory.by_purpose["prefill staging ring"] == 2 * SPEC.num_experts * slot
    assert engine.staging.pinned_experts == 2 * SPEC.num_experts
    engine.reconfigure(engine.config.updated(device_expert_bytes=None))  # the slots have the rest of the device
    assert engine.plan.placement_mode == "all_resident"


def test_static_placement_from_a_popularity_file(model_folder, tmp_path):
    from engine.model_folder import ModelFolder

    names = [info.name for info in ModelFolder.open(model_folder).experts]
    counts = {name: [0] * 16 for name in names}
    for name in names:
        counts[name][3] = counts[name][7] = 100
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps(counts))
    per_expert = device_expert_bytes(model_folder) // (16 * len(names))  # one device slot
    config = OffloadConfig(placement="static", popularity_file=str(path), device_expert_bytes=2 * len(names) * per_expert)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    assert all(set(layer.resident()) == {3, 7} for layer in model.offload.slots)


@pytest.mark.parametrize("placement", ["static", "adaptive"])
def test_a_popularity_file_set_on_the_loaded_model_places_its_residents(model_folder, cpu_run, tmp_path, placement):
    """popularity_file changes without a reload, yet set on a loaded model it placed nothing: the residents stayed as
    they were (static placement then never moves them), and adaptive placement went on from the scores it had
    learnt. Its most counted experts are now resident at once, as at a load with the file."""
    from engine.model_folder import ModelFolder

    names = [info.name for info in ModelFolder.open(model_folder).experts]
    per_expert = device_expert_bytes(model_folder) // (16 * len(names))  # one device slot
    model = LoadedModel.open(model_folder, offload=OffloadConfig(placement=placement,
                                                                 device_expert_bytes=2 * len(names) * per_expert),
                             device=SimulatedDevice(1 << 30))
    greedy_run(model, steps=4)
    engine = model.offload
    assert any(set(layer.resident()) != {12, 13} for layer in engine.slots)
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [0] * 12 + [100, 90, 1, 1] for name in names}))
    engine.reconfigure(engine.config.updated(popularity_file=str(path)))
    # (adaptive placement may leave a slot to copied misses, as its measured rates say)
    wanted = [[12, 13][:engine.policy.wanted_slots(index)] for index in range(len(names))]
    assert [sorted(layer.resident().tolist()) for layer in engine.slots] == wanted
    assert placement == "adaptive" or wanted == [[12, 13]] * len(names)
    assert_same_as_cpu(greedy_run(model), cpu_run)


@pytest.mark.parametrize("placement", ["static", "adaptive"])
def test_a_popularity_file_edited_in_place_places_its_new_residents_when_applied_again(model_folder, tmp_path,
                                                                                       placement):
    """The same configuration applied again after the popularity file was edited (same path, new counts) kept the
    residents of the old counts: only a new path placed them afresh, so static placement never took the new ones.
    Now the new counts place the residents, and the plan says the file changed; unchanged, nothing moves."""
    from engine.model_folder import ModelFolder

    names = [info.name for info in ModelFolder.open(model_folder).experts]
    per_expert = device_expert_bytes(model_folder) // (16 * len(names))  # one device slot
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [100, 90] + [0] * 14 for name in names}))
    model = LoadedModel.open(model_folder, offload=OffloadConfig(placement=placement, popularity_file=str(path),
                                                                 device_expert_bytes=2 * len(names) * per_expert),
                             device=SimulatedDevice(1 << 30))
    engine = model.offload
    engine.reconfigure(engine.config)  # unchanged: nothing said
    assert not any("changed since" in statement for statement in engine.plan.statements)
    path.write_text(json.dumps({name: [0] * 12 + [100, 90, 1, 1] for name in names}))
    engine.reconfigure(engine.config)
    wanted = [[12, 13][:engine.policy.wanted_slots(index)] for index in range(len(names))]
    assert [sorted(layer.resident().tolist()) for layer in engine.slots] == wanted
    assert placement == "adaptive" or wanted == [[12, 13]] * len(names)
    assert f"{path} changed since it was read: its new counts placed the residents afresh." in engine.plan.statements


def test_adaptive_placement_starts_from_a_popularity_file_of_shares_as_from_one_of_counts(model_folder, tmp_path):
    """Adaptive placement starts each layer from the file's counts scaled to 1.0 for the most counted expert, as a hit
    scores (placement.adaptive_scores). Shares (0.25), which a popularity file may hold, were divided by 1.0 where
    their largest was below it: the file's experts started at a fraction of one hit, so the first routed steps
    outscored the file's ranking, as counts with the same ranking are not outscored."""
    from engine.model_folder import ModelFolder

    names = [info.name for info in ModelFolder.open(model_folder).experts]
    per_expert = device_expert_bytes(model_folder) // (16 * len(names))  # one device slot
    scores = []
    for file, row in (("counts", [0] * 12 + [50, 30, 20, 0]), ("shares", [0] * 12 + [0.5, 0.3, 0.2, 0])):
        path = tmp_path / f"{file}.json"
        path.write_text(json.dumps({name: row for name in names} | {names[-1]: [0] * 16}))
        model = LoadedModel.open(model_folder, offload=OffloadConfig(placement="adaptive", popularity_file=str(path),
                                                                     device_expert_bytes=2 * len(names) * per_expert),
                                 device=SimulatedDevice(1 << 30))
        scores.append([layer.tolist() for layer in model.offload.policy.scores])
    assert scores[1] == scores[0] == [[0.0] * 12 + [1.0, 0.6, 0.4, 0.0]] * (len(names) - 1) + [[0.0] * 16]


def test_static_placement_set_on_the_loaded_model_places_the_popularity_files_experts(model_folder, tmp_path):
    """placement=static applied on a model loaded under adaptive placement with the same popularity file kept the
    residents adaptive placement had moved to, for good (static never moves), where static placement keeps the
    file's most counted experts resident, as a load with these settings does."""
    from engine.model_folder import ModelFolder

    names = [info.name for info in ModelFolder.open(model_folder).experts]
    per_expert = device_expert_bytes(model_folder) // (16 * len(names))  # one device slot
    path = tmp_path / "popularity.json"
    path.write_text(json.dumps({name: [0] * 12 + [100, 90, 1, 1] for name in names}))
    model = LoadedModel.open(model_folder, offload=OffloadConfig(placement="adaptive", popularity_file=str(path),
                                                                 device_expert_bytes=2 * len(names) * per_expert),
                             device=SimulatedDevice(1 << 30))
    greedy_run(model, steps=12)
    engine = model.offload
    assert any(set(layer.resident()) != {12, 13} for layer in engine.slots)  # adaptive placement followed routing
    engine.reconfigure(engine.config.updated(placement="static"))
    assert [sorted(layer.resident().tolist()) for layer in engine.slots] == [[12, 13]] * len(names)


def test_a_replan_refused_for_its_popularity_file_leaves_the_old_plan_in_force(model_folder, tmp_path):
    """The popularity file was read once the new plan was in force: a re-plan refused for it (a saved configuration
    naming a file since moved) said so, yet left the new budget and settings in force under the old placement."""
    per_expert = device_expert_bytes(model_folder) // (16 * SPEC.layers)  # one device slot
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=2 * per_expert),
                             device=SimulatedDevice(1 << 30))
    engine = model.offload
    before = (engine.config, [layer.num_slots for layer in engine.slots])
    asked = OffloadConfig(placement="static", popularity_file=str(tmp_path / "moved.json"),
                          device_expert_bytes=8 * per_expert)
    with pytest.raises(WorkbenchError, match="cannot read the popularity file"):
        engine.reconfigure(asked)
    assert (engine.config, [layer.num_slots for layer in engine.slots]) == before


def test_a_replan_refused_with_a_new_layer_split_and_decode_path_keeps_the_ones_in_force(model_folder, tmp_path):
    """A refused re-plan (here, for its popularity file) that also asked for whole layers and the host tier left the
    old plan in force under the new split and path: whole_layers said whole layers of a spread plan (the window then
    reported it as "Measured faster"), and the tier's path was in force without a tier."""
    per_expert = device_expert_bytes(model_folder) // (16 * SPEC.layers)  # one device slot
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=16 * per_expert),
                             device=SimulatedDevice(1 << 30), layer_split="spread", decode_path="cpu")
    engine = model.offload
    before = (engine.layer_split_mode, engine.whole_layers, engine.decode_path_mode, engine.decode_path_in_force)
    asked = engine.config.updated(placement="static", popularity_file=str(tmp_path / "moved.json"))
    with pytest.raises(WorkbenchError, match="cannot read the popularity file"):
        engine.reconfigure(asked, layer_split="whole", decode_path="tier")
    assert (engine.layer_split_mode, engine.whole_layers, engine.decode_path_mode,
            engine.decode_path_in_force) == before == ("spread", False, "cpu", "cpu")


def test_a_replan_to_whole_layers_refused_under_required_mode_leaves_the_spread_plan_whole(model_folder):
    """mode=required refuses whole layers where the budget holds none: putting the spread plan back planned again with
    the refused split, was refused again midway, and left the stores released under the old plan's slot counts."""
    per_expert = device_expert_bytes(model_folder) // (16 * SPEC.layers)  # one device slot
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(mode="required", device_expert_bytes=2 * per_expert),
                             device=device, layer_split="spread", decode_path="cpu")
    engine = model.offload
    before = (dict(engine.plan.slots), [store.num_slots for store in engine.stores], device.memory.used)
    with pytest.raises(OffloadPlanError, match="holds no whole layer"):
        engine.reconfigure(engine.config, layer_split="whole")
    assert (dict(engine.plan.slots), [store.num_slots for store in engine.stores], device.memory.used) == before
    assert not engine.whole_layers and engine.layer_split_mode == "spread"


def model_with_two_slots(model_folder):
    """The model on a simulated device with two expert slots a layer; one slot's bytes; and a function giving what a
    re-plan that fails must leave as it was: config, plan, residents, slots, device memory and its purposes."""
    per_expert = device_expert_bytes(model_folder) // (16 * SPEC.layers)  # one device slot
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=2 * per_expert), device=device)
    engine = model.offload

    def state():
        return (engine.config, engine.plan, [layer.expert_in.tolist() for layer in engine.slots],
                [store.num_slots for store in engine.stores], device.memory.used,
                {k: v for k, v in device.memory.by_purpose.items() if v})

    return model, per_expert, state


def test_a_replan_the_device_cannot_hold_leaves_the_old_plan_in_force(model_folder, cpu_run, monkeypatch):
    """The device may hold less when the slots are made than the plan counted on (another process took memory since):
    the re-plan is refused in one line and the configuration in force stays, with its slots, residents, device
    memory and answers. The first slots made went, the plan was the new one and the config the old."""
    from engine.offload.device_memory import DeviceMemoryError
    from engine.offload.devices import SimulatedSlots

    model, per_expert, state = model_with_two_slots(model_folder)
    engine = model.offload
    before = state()
    real_resize, taken = SimulatedSlots.resize, []

    def short_of_memory(self, num_slots):
        if num_slots > self.num_slots and not taken:  # the new plan's first slots; the old ones fit again after
            taken.append(self.name)
            raise DeviceMemoryError(f"{self.name}: the device has no room for {num_slots} expert slots")
        real_resize(self, num_slots)

    monkeypatch.setattr(SimulatedSlots, "resize", short_of_memory)
    with pytest.raises(DeviceMemoryError, match="no room for"):
        engine.reconfigure(engine.config.updated(device_expert_bytes=8 * per_expert))
    assert taken and state() == before
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_a_replan_the_device_cannot_hold_leaves_the_sentence_on_the_host_tier_in_force(model_folder, monkeypatch):
    """A re-plan works out what its plan will say of the host tier (tier_statement) before the stores are made. Where
    the device then refused the slots, the old plan came back in force but tier_statement stayed the refused plan's:
    here '' for the tier it would have made, where the plan in force says approximate routing keeps the tier off."""
    from engine.offload.devices import SimulatedSlots

    model = LoadedModel.open(model_folder, decode_path="tier", device=SimulatedDevice(1 << 30),
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4,
                                                   min_expert_weight=0.3))
    engine = model.offload
    said = engine.tier_statement
    assert said.startswith("Cold experts are computed on the CPU: no host tier is made, since approximate routing")
    assert said in engine.plan.statements and not engine.host_tier
    plan, real_resize = engine.plan, SimulatedSlots.resize

    def short_of_memory(self, num_slots):
        if num_slots > self.num_slots:  # the new plan's slots, with the tier or without it
            raise DeviceMemoryError(f"{self.name}: the device has no room for {num_slots} expert slots")
        real_resize(self, num_slots)

    monkeypatch.setattr(SimulatedSlots, "resize", short_of_memory)
    with pytest.raises(DeviceMemoryError, match="no room for"):
        engine.reconfigure(engine.config.updated(min_expert_weight=0.0,
                                                 device_expert_bytes=device_expert_bytes(model_folder) // 2))
    assert engine.plan is plan and not engine.host_tier
    assert engine.tier_statement == said and said in engine.plan.statements


@pytest.mark.parametrize("failing, error", [
    ("_plan_streaming", RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")),
    ("_apply_file_backing", OSError(12, "Cannot allocate memory")),
    ("_make_policy", DeviceMemoryError("the pinned staging ring (286720 bytes) cannot hold a copy of 294912 bytes"))])
def test_a_replan_that_fails_after_its_stores_are_made_leaves_the_configuration_in_force(model_folder, cpu_run,
                                                                                         monkeypatch, failing, error):
    """A re-plan put back the configuration in force only where the plan or its stores failed. A failure after the
    stores were made (the decode streaming slots, the file backing, the placement's copies: the driver, the host's
    memory) left the engine half re-planned: the new plan and stores under the new config or the old, the old
    placement over emptied slots, the experts copied into RAM. Now the configuration in force stays, whole."""
    model, per_expert, state = model_with_two_slots(model_folder)
    engine = model.offload
    greedy_run(model, steps=4)  # (routing placed the residents)
    before, policy, path = state(), engine.policy, (engine.decode_path_mode, engine.decode_path_in_force)
    real, raised = getattr(type(engine), failing), []

    def fails_once(self, *args, **kwargs):
        if not raised:
            raised.append(failing)
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(engine), failing, fails_once)
    asked = engine.config.updated(device_expert_bytes=4 * per_expert, allow_file_backing=False, placement="static")
    with pytest.raises(type(error)) as failed:
        engine.reconfigure(asked, decode_path="cpu")
    assert failed.value is error and raised == [failing]
    assert state() == before and engine.policy is policy
    assert (engine.decode_path_mode, engine.decode_path_in_force) == path
    assert not any(runner.in_memory for runner in engine.runners)  # (the copies into RAM dropped)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    engine.reconfigure(asked, decode_path="cpu")  # the same re-plan, nothing failing
    assert sum(store.num_slots for store in engine.stores) == 4 and engine.config == asked
    assert all(runner.in_memory for runner in engine.runners) and engine.policy is not policy


# --- configuration in onnxruntime's vocabulary ---------------------------------------------------

def test_config_accepts_full_and_short_names_and_the_alias():
    config = OffloadConfig.from_entries({
        "session.moe.offload.mode": "required", "placement": "static", "gpu_budget_bytes": "1000",
        "node_overrides": "/model/layers.0/moe/QMoE:max_resident_slots=4,device_expert_bytes=2048;n2:max_resident_slots=1",
        "min_expert_weight": "0.05", "allow_file_backing": "0"})
    assert config.mode == "required" and config.placement == "static" and config.device_expert_bytes == 1000
    assert config.node_overrides["/model/layers.0/moe/QMoE"].max_resident_slots == 4
    assert config.node_overrides["n2"].device_expert_bytes is None
    entries = config.to_entries()
    assert entries["session.moe.offload.device_expert_bytes"] == "1000"
    assert OffloadConfig.from_entries(entries) == config
    assert OffloadConfig.from_entries({"device_expert_bytes": "auto"}).device_expert_bytes is None


@pytest.mark.parametrize("key, value, message", [
    ("mode", "sometimes", "expected one of disabled, auto, required"),
    ("device_expert_bytes", "-5", ">= 0"),
    ("min_expert_weight", "1.5", "[0.0, 1.0]"),
    ("allow_file_backing", "yes", "'yes': expected 0, 1, true or false"),  # (the words it takes said too)
    ("prefill_wave_experts", "0", ">= 1"),
    ("node_overrides", "n:slots=3", "max_resident_slots=N"),
    ("session.moe.offload.turbo", "1", "unknown offload key"),
    ("session.moe.offload.placment", "static", "unknown offload key 'session.moe.offload.placment': did you mean "
                                               "'placement'?"),
])
def test_config_rejects_what_onnxruntime_rejects(key, value, message):
    with pytest.raises(OffloadConfigError) as error:
        OffloadConfig.from_entries({key: value})
    assert message in str(error.value) and (key in str(error.value))


# --- approximate routing -------------------------------------------------------------------------

def test_approximate_routing_is_measured_and_changes_only_cold_tail_experts(model_folder):
    from engine.generation import GenerationParams, generate

    config = OffloadConfig(device_expert_bytes=expert_bytes(model_folder) // 4, min_expert_weight=0.3,
                           skip_tail_cold_only=True)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    result = generate(model, model.new_state(), [], model.tokenizer.encode("Approximate routing on"),
                      GenerationParams(max_new_tokens=10))
    assert result.routing_agreement is not None and 0.0 <= result.routing_agreement <= 1.0
    assert model.offload.approximation.dropped > 0
    exact = LoadedModel.open(model_folder, offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    plain = generate(exact, exact.new_state(), [], exact.tokenizer.encode("Approximate routing on"),
                     GenerationParams(max_new_tokens=10))
    assert plain.routing_agreement is None


def test_approximate_routing_makes_no_host_tier_and_says_cold_experts_run_on_the_cpu(model_folder):
    """Approximate routing picks each token's experts on the host, and a step that reads the tier routes on the GPU, so
    under it every cold expert ran on the CPU; yet the tier was made (its page-locked memory held for nothing), decode
    path 'tier' was in force, and the plan said "decode reads cold experts on the GPU ..., as asked". No tier is made
    now and the plan says why; asked for on the loaded model, 'tier' is refused saying so; routing exact again, the
    tier is made again."""
    half = device_expert_bytes(model_folder) // 2
    said = ("Cold experts are computed on the CPU: no host tier is made, since approximate routing "
            "(min_expert_weight=0.3) picks each token's experts on the host, where decode from the tier routes on "
            "the GPU.")
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=half, min_expert_weight=0.3),
                             device=SimulatedDevice(1 << 30), decode_path="tier")
    engine = model.offload
    assert not engine.host_tier and engine.decode_path_in_force == "cpu" and said in engine.plan.statements
    assert not any("as asked (decode path 'tier')" in s for s in engine.plan.statements)
    greedy_run(model, steps=4)
    assert engine.stats.totals().misses_read == 0
    engine.set_decode_path("auto")
    with pytest.raises(WorkbenchError, match=r"decode path 'tier': Cold experts are computed on the CPU: no host tier "
                                             r"is made, since approximate routing"):
        engine.set_decode_path("tier")
    engine.reconfigure(engine.config.updated(min_expert_weight=0.0), decode_path="tier")
    assert engine.host_tier and engine.decode_path_in_force == "tier"


def test_a_refused_tier_whose_old_path_cannot_be_put_back_still_says_why_it_was_refused(model_folder, monkeypatch):
    """'tier' refused puts the old decode path back with a second re-plan; where that one failed too (here the host's
    memory, for its streaming slots), its error replaced the refusal, and the user never learnt why the tier was not
    made. The error is the refusal, saying the old path could not be put back and why; the path asked stays in force."""
    half = device_expert_bytes(model_folder) // 2
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=half, min_expert_weight=0.3),
                             device=SimulatedDevice(1 << 30), decode_path="auto")
    engine = model.offload
    real, calls = type(engine)._plan_streaming, []

    def second_fails(self, *args, **kwargs):  # the re-plan for 'tier' makes them, the one putting 'auto' back fails
        calls.append(len(calls))
        if len(calls) == 2:
            raise OSError(12, "Cannot allocate memory")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(engine), "_plan_streaming", second_fails)
    with pytest.raises(WorkbenchError) as refused:
        engine.set_decode_path("tier")
    said = ("Cold experts are computed on the CPU: no host tier is made, since approximate routing "
            "(min_expert_weight=0.3) picks each token's experts on the host, where decode from the tier routes on "
            "the GPU.")
    assert str(refused.value) == (f"decode path 'tier': {said} Decode path 'auto' could not be put back "
                                  "(OSError: [Errno 12] Cannot allocate memory), so 'tier' stays, without the tier.")
    assert isinstance(refused.value.__cause__, OSError) and len(calls) == 3  # (the third: _restore_plan's)
    assert engine.decode_path_mode == "tier" and engine.decode_path_in_force == "cpu" and not engine.host_tier


def test_async_max_tokens_0_makes_no_host_tier_and_says_why(model_folder):
    """async_max_tokens=0 runs no step with the CPU and the GPU at once, and only such a decode step reads the host tier
    (HybridExpertNode): the tier was made all the same (its page-locked memory and device mappings held for nothing),
    decode path 'tier' was said to be in force and every cold expert ran on the CPU. No tier is made now and the plan
    says why; asked for on the loaded model, 'tier' is refused saying so; async_max_tokens raised, the tier is made."""
    half = device_expert_bytes(model_folder) // 2
    said = ("Cold experts are computed on the CPU: no host tier is made, since async_max_tokens=0 runs no step with "
            "the CPU and the GPU at once, and only such a decode step reads the tier.")
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=half, async_max_tokens=0),
                             device=SimulatedDevice(1 << 30), decode_path="tier")
    engine = model.offload
    assert not engine.host_tier and engine.decode_path_in_force == "cpu" and said in engine.plan.statements
    greedy_run(model, steps=4)
    assert engine.stats.totals().misses_read == 0 and engine.stats.totals().misses > 0
    engine.set_decode_path("auto")
    with pytest.raises(WorkbenchError, match=r"decode path 'tier': Cold experts are computed on the CPU: no host tier "
                                             r"is made, since async_max_tokens=0"):
        engine.set_decode_path("tier")
    engine.reconfigure(engine.config.updated(async_max_tokens=8), decode_path="tier")
    assert engine.host_tier and engine.decode_path_in_force == "tier"
    greedy_run(model, steps=4)
    assert engine.stats.totals().misses_read > 0


def test_disabled_mode_routes_exactly_and_says_its_approximate_routing_settings_do_not_apply(model_folder, cpu_run,
                                                                                              monkeypatch):
    """Approximate routing is part of hybrid offload: under mode=disabled (no offload, every expert where the dense
    part runs) min_expert_weight and tail substitution drop and substitute nothing, the answers are exact routing's
    (no agreement meter, no approximation in the record), and the plan says once which settings did not apply."""
    from engine import generation
    from engine.generation import GenerationParams, generate
    from engine.records.scenarios import run_turns

    approximate = OffloadConfig(mode="disabled", min_expert_weight=0.5, skip_tail_cold_only=True,
                                tail_substitution_threshold=0.5, reserve_device_bytes=0)
    said = ("Routing is exact: offload is disabled, so approximate routing's min_expert_weight=0.5, "
            "skip_tail_cold_only=1, tail_substitution_threshold=0.5 do not apply.")
    for on_device in (False, True):  # every expert on the CPU, or every one resident where the dense part runs
        monkeypatch.setattr(generation, "dense_goes_to", lambda device, dtypes, on=on_device: on)
        model = LoadedModel.open(model_folder, offload=approximate, device=SimulatedDevice(1 << 30))
        assert model.offload.plan.placement_mode == ("all_resident" if on_device else "cpu_only")
        assert not model.offload.config.approximate_routing and not model.offload.approximating
        assert model.offload.plan.statements.count(said) == 1
        assert_same_as_cpu(greedy_run(model), cpu_run)
        result = generate(model, model.new_state(), [], model.tokenizer.encode("Exact"), GenerationParams(4))
        assert result.routing_agreement is None
        record = run_turns(model, ["Exact"], GenerationParams(max_new_tokens=4))
        assert (record.approximate_routing, record.approximation, record.routing_agreement) == (False, {}, None)
        assert vars(model.offload.approximation) == {"dropped": 0, "substituted": 0}
    # under auto the same settings do apply, and the plan says nothing of them
    model = LoadedModel.open(model_folder, offload=approximate.updated(mode="auto", device_expert_bytes=0),
                             device=SimulatedDevice(1 << 30))
    assert model.offload.approximating and not any("Routing is exact" in s for s in model.offload.plan.statements)
    # a re-plan to mode=disabled on the loaded model routes exactly from then on
    model.offload.reconfigure(model.offload.config.updated(mode="disabled"))
    assert not model.offload.approximating and said in model.offload.plan.statements
    before = vars(model.offload.approximation).copy()
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert vars(model.offload.approximation) == before


def test_approximation_rules():
    from engine.offload.approximate import ApproximationCounts, approximate_routing

    ids = np.array([[0, 1, 2], [3, 4, 5]])
    weights = np.array([[0.6, 0.3, 0.1], [0.5, 0.45, 0.05]], np.float32)
    slot_of = np.array([0, -1, -1, 1, 2, -1, 3, -1])  # resident: 0, 3, 4, 6
    logits = np.arange(16, dtype=np.float32).reshape(2, 8)
    counts = ApproximationCounts()
    dropped = approximate_routing(ids, weights, logits, slot_of, OffloadConfig(min_expert_weight=0.2), counts)
    assert dropped.tolist() == [[0, 1, -1], [3, 4, -1]] and counts.dropped == 2
    cold_only = approximate_routing(ids, weights, logits, slot_of,
                                    OffloadConfig(min_expert_weight=0.5, skip_tail_cold_only=True), counts)
    assert cold_only.tolist() == [[0, -1, -1], [3, 4, -1]]  # 4 is resident: kept despite its weight
    substituted = approximate_routing(ids, weights, logits, slot_of,
                                      OffloadConfig(tail_substitution_threshold=0.2, tail_substitution_min_rank=2),
                                      counts)
    assert substituted.tolist() == [[0, 1, 6], [3, 4, 6]]  # rank-2 cold tails -> best free resident (6)


def test_tail_substitution_from_rank_0_may_replace_the_top_ranked_expert():
    """tail_substitution_min_rank is the lowest rank that may be substituted, 0 included (onnxruntime takes 0 <= r < k)."""
    from engine.offload.approximate import ApproximationCounts, approximate_routing

    ids = np.array([[1, 0]])
    weights = np.array([[0.15, 0.1]], np.float32)  # a flat routing: the top expert's weight is below the threshold too
    slot_of = np.array([0, -1, -1, 1])  # resident: 0 and 3
    logits = np.array([[0.0, 0.0, 0.0, 1.0]], np.float32)
    counts = ApproximationCounts()
    substituted = approximate_routing(ids, weights, logits, slot_of, OffloadConfig(
        tail_substitution_threshold=0.2, tail_substitution_min_rank=0), counts)
    assert substituted.tolist() == [[3, 0]] and counts.substituted == 1


def test_tail_substitution_never_brings_back_an_expert_min_expert_weight_dropped():
    """A substitute is a resident expert the router did not choose: the resident tail expert dropped below
    min_expert_weight came back in the cold expert's place, computed with that higher rank's weight."""
    from engine.offload.approximate import ApproximationCounts, approximate_routing

    ids = np.array([[0, 1, 2]])
    weights = np.array([[0.6, 0.3, 0.1]], np.float32)
    slot_of = np.array([0, -1, 1, 2])  # resident: 0, 2 and 3; 1 is cold
    logits = np.array([[4.0, 3.0, 2.0, 1.0]], np.float32)
    counts = ApproximationCounts()
    approximated = approximate_routing(ids, weights, logits, slot_of, OffloadConfig(
        min_expert_weight=0.2, tail_substitution_threshold=0.5), counts)
    assert approximated.tolist() == [[0, 3, -1]] and (counts.dropped, counts.substituted) == (1, 1)


def test_an_answer_resumed_from_its_prompts_snapshot_has_every_token_compared_with_exact_routing(model_folder):
    """A reasoning model's regenerate answers from the prompt's snapshot, with no prompt fed (prompt_logits). Where
    approximate routing was turned on after the snapshot (Apply on the loaded model), the meter compared every token
    but the first: the agreement was of one token fewer than the answer's, which the text says it is of. Each token
    is compared, as a teacher-forced run with exact routing (NumPy argmax) finds."""
    from engine.generation import GenerationParams, generate

    config = OffloadConfig(device_expert_bytes=expert_bytes(model_folder) // 4)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    prompt = model.tokenizer.encode("An answer given again")
    state = model.new_state()
    prompt_logits = model.decoder.forward(state, prompt)[-1]  # the snapshot's, taken with exact routing
    model.offload.reconfigure(config.updated(min_expert_weight=0.3))
    result = generate(model, state, list(prompt), [], GenerationParams(max_new_tokens=8), prompt_logits=prompt_logits)
    exact = LoadedModel.open(model_folder)
    exact_state = exact.new_state()
    logits = exact.decoder.forward(exact_state, prompt)[-1]
    agreed = []
    for token in result.tokens:
        agreed.append(int(np.argmax(logits)) == token)
        logits = exact.decoder.forward(exact_state, [token])[-1]
    assert len(result.tokens) == 8 and not all(agreed)
    assert result.routing_agreement == sum(agreed) / len(agreed)


def test_the_agreement_compares_the_tokens_greedy_choice_takes_under_a_repetition_penalty():
    """The meter compared the two routings' raw argmax: on the LFM2-MoE fixture both always rank token 85 first, so it
    said 100%, while greedy decoding with a repetition penalty writes other tokens, one of which exact routing would
    not have chosen. It compares the choices greedy decoding makes from each routing's logits, the penalty applied to
    the tokens fed so far (computed here in NumPy on a teacher-forced run with exact routing)."""
    from engine.generation import GenerationParams, generate
    from engine.sampling import SamplingParams

    folder, penalty = fixture_folder("lfm2moe"), 3.0
    config = OffloadConfig(device_expert_bytes=100_000, tail_substitution_threshold=0.45)
    model = LoadedModel.open(folder, offload=config, device=SimulatedDevice(1 << 30))
    prompt = model.tokenizer.encode("The quick brown fox jumps")
    result = generate(model, model.new_state(), [], prompt,
                      GenerationParams(max_new_tokens=24, sampling=SamplingParams(repetition_penalty=penalty)))

    def greedy(logits: np.ndarray, history: list[int]) -> int:
        scores = logits.astype(np.float64)
        seen = np.unique(history)
        scores[seen] = np.where(scores[seen] > 0, scores[seen] / penalty, scores[seen] * penalty)
        return int(np.argmax(scores))

    exact = LoadedModel.open(folder)
    exact_state = exact.new_state()
    logits, history, agreed = exact.decoder.forward(exact_state, prompt)[-1], list(prompt), []
    for token in result.tokens:
        agreed.append(greedy(logits, history) == token)
        history.append(token)
        logits = exact.decoder.forward(exact_state, [token])[-1]
    assert not all(agreed) and result.routing_agreement == sum(agreed) / len(agreed)


def test_cpu_threads_change_on_a_loaded_model(model_folder):
    model = LoadedModel.open(model_folder, offload=OffloadConfig(cpu_threads=1), device=SimulatedDevice(1 << 30))
    assert all(r.kernel.num_threads == 1 for r in model.offload.runners)
    model.offload.reconfigure(model.offload.config.updated(cpu_threads=2))
    assert all(r.kernel.num_threads == 2 for r in model.offload.runners)
    greedy_run(model, steps=2)


# --- host memory: the bounded cache and file backing -----------------------------------------------

def test_host_cache_stays_within_its_budget_and_releases_pages(model_folder, cpu_run, monkeypatch):
    per_expert = expert_bytes(model_folder) // (16 * 3)
    config = OffloadConfig(device_expert_bytes=0, host_expert_bytes=5 * per_expert)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    released = []
    real = model.folder.onnx.release_pages
    monkeypatch.setattr(model.folder.onnx, "release_pages",
                        lambda name, start, length: (released.append((name, start, length)), real(name, start, length)))
    logits, tokens = greedy_run(model)
    assert tokens == cpu_run[1]  # dropping pages never changes what is computed
    cache = model.offload.host_cache
    assert cache.cached_bytes <= 5 * per_expert and cache.evictions > 0
    info = model.offload.infos[0]
    weights = info.weight_inputs["fc1_experts_weights"]
    stride = model.folder.onnx.nbytes(weights) // 16
    assert any(name == weights and start % stride == 0 and length == stride for name, start, length in released)


def test_experts_read_for_a_copy_leave_with_their_reach_unless_the_cache_holds_them():
    """HostExpertCache.release_after_read: nothing while unbounded; else the pages of the experts read, and of those
    within SPILL of them (what the reads' fault-around may have mapped), each run released once, less what the cache
    holds."""
    from engine.offload.host_cache import SPILL, HostExpertCache

    released = []
    per_expert = SPILL // 2  # a read's reach: 2 experts either side
    source = SimpleNamespace(nbytes=lambda name: 16 * per_expert,
                             release_pages=lambda name, start, length: released.append(
                                 (start // per_expert, length // per_expert)))
    info = SimpleNamespace(spec=SimpleNamespace(num_experts=16), weight_inputs={"fc1_experts_weights": "w"},
                           bytes_per_expert=per_expert)
    cache = HostExpertCache(source, [info], budget_bytes=None)
    cache.release_after_read(0, [5])
    assert released == []
    cache.set_budget(4 * per_expert)
    cache.touch(0, [7])
    released.clear()
    cache.release_after_read(0, [6, 5, 12, 7])
    assert released == [(3, 4), (8, 1), (10, 5)]  # [3, 9) less expert 7, [10, 15)
    released.clear()
    cache.release_after_read(0, [7])
    assert released == []


def test_a_lower_host_bound_on_the_loaded_model_releases_the_experts_beyond_it_at_once():
    """host_expert_bytes lowered on a loaded model left the cache at the old bound (199.8 MB held under 20 MB) until
    the CPU next computed an expert, which a model left idle, or one whose experts are now all on the device, never
    does: the least recent experts beyond the new bound leave when it is set."""
    from engine.offload.host_cache import HostExpertCache

    released = []
    per_expert = 1 << 20
    source = SimpleNamespace(nbytes=lambda name: 16 * per_expert,
                             release_pages=lambda name, start, length: released.append(
                                 (start // per_expert, length // per_expert)))
    info = SimpleNamespace(spec=SimpleNamespace(num_experts=16), weight_inputs={"fc1_experts_weights": "w"},
                           bytes_per_expert=per_expert)
    cache = HostExpertCache(source, [info], budget_bytes=8 * per_expert)
    cache.touch(0, [1, 2, 3, 4, 5, 6])
    released.clear()
    cache.set_budget(2 * per_expert)
    assert cache.cached_bytes == 2 * per_expert and list(cache._lru) == [(0, 5), (0, 6)]
    assert released == [(1, 1), (2, 1), (3, 1), (4, 1)] and cache.evictions == 4


def test_without_file_backing_experts_are_copied_into_ram(model_folder, cpu_run):
    config = OffloadConfig(device_expert_bytes=0, allow_file_backing=False)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    tensor = model.offload.runners[0].tensors["fc1_experts_weights"]
    assert tensor.flags.owndata and tensor.flags.writeable  # a RAM copy, not a view of the file
    assert greedy_run(model)[1] == cpu_run[1]
    model.offload.reconfigure(model.offload.config.updated(allow_file_backing=True))
    assert not model.offload.runners[0].tensors["fc1_experts_weights"].flags.owndata
    with pytest.raises(OffloadPlanError, match="host_expert_bytes"):
        model.offload.reconfigure(model.offload.config.updated(allow_file_backing=False, host_expert_bytes=1000))


def test_a_replan_whose_copy_into_ram_fails_midway_leaves_the_old_configuration_in_force(model_folder, cpu_run,
                                                                                         monkeypatch):
    """allow_file_backing=0 set on the loaded model copies its experts into host RAM. A copy that fails midway (the
    host ran short of memory since the check, a read of the file failed) is refused in one line, and the configuration
    in force stays: its plan, slots, residents and device memory, every node reading the mapped file again (none left
    half copied, none marked copied without its copy), and the same answers."""
    from engine.expert_node import CpuExpertNode

    model, per_expert, state = model_with_two_slots(model_folder)
    engine = model.offload

    def copied():  # per node: marked in RAM, and its tensors RAM copies (not views of the file)
        return [(runner.in_memory, any(t.flags.owndata for t in runner.tensors.values() if t is not None))
                for runner in engine.runners]

    before = state()
    assert copied() == [(False, False)] * SPEC.layers
    real_build, builds = CpuExpertNode._build, []

    def short_of_memory(self, threads):
        if self.in_memory:
            builds.append(self.info.name)
            if len(builds) == 2:  # the second node's copy: the first is in RAM by then
                raise MemoryError("Unable to allocate 1.00 MiB for an array with shape (16, 65536) and data type uint8")
        real_build(self, threads)

    monkeypatch.setattr(CpuExpertNode, "_build", short_of_memory)
    with pytest.raises(WorkbenchError) as error:
        engine.reconfigure(engine.config.updated(allow_file_backing=False, device_expert_bytes=4 * per_expert))
    assert str(error.value) == ("allow_file_backing=0: copying the experts into host memory failed (Unable to allocate "
                                "1.00 MiB for an array with shape (16, 65536) and data type uint8); the configuration "
                                "in force stays")
    assert len(builds) == 2 and state() == before and copied() == [(False, False)] * SPEC.layers
    assert_same_as_cpu(greedy_run(model), cpu_run)
    # the copies made, then a plan refused: they are dropped with it
    monkeypatch.setattr(CpuExpertNode, "_build", real_build)
    before = state()  # (the run placed experts in the slots)
    with pytest.raises(OffloadPlanError):
        engine.reconfigure(engine.config.updated(allow_file_backing=False, mode="required", device_expert_bytes=10))
    assert state() == before and copied() == [(False, False)] * SPEC.layers
    # with the memory there, the same re-plan copies every node
    engine.reconfigure(engine.config.updated(allow_file_backing=False, device_expert_bytes=4 * per_expert))
    assert copied() == [(True, True)] * SPEC.layers and not engine.config.allow_file_backing
    assert_same_as_cpu(greedy_run(model), cpu_run)


def test_a_refused_reconfiguration_leaves_the_old_one_in_force(model_folder, cpu_run):
    device = SimulatedDevice(1 << 30)
    half = expert_bytes(model_folder) // 2
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=half, prefill_wave_experts=2),
                             device=device)
    used, slots = device.memory.used, dict(model.offload.plan.slots)
    with pytest.raises(OffloadPlanError):
        model.offload.reconfigure(model.offload.config.updated(mode="required", device_expert_bytes=10))
    assert device.memory.used == used and model.offload.plan.slots == slots
    assert model.offload.config.device_expert_bytes == half
    model.offload.reconfigure(model.offload.config.updated(prefill_wave_experts=4))
    assert device.memory.by_purpose["prefill staging ring"] == 2 * 4 * max(i.device_bytes_per_expert
                                                                       for i in model.offload.infos)
    assert greedy_run(model)[1] == cpu_run[1]


def test_per_expert_counts_add_up_to_the_layer_totals(model_folder):
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=expert_bytes(model_folder) // 3),
                             device=SimulatedDevice(1 << 30))
    greedy_run(model, steps=6)
    stats = model.offload.stats
    for index, layer in enumerate(stats.layers):
        assert stats.expert_hits[index].sum() == layer.hits and stats.expert_misses[index].sum() == layer.misses
        assert layer.hits > 0 and layer.misses > 0
    record_layer = stats.as_dict()["layers"][0]
    assert len(record_layer["expert_hits"]) == 16 and sum(record_layer["expert_misses"]) == stats.layers[0].misses


def test_buffers_reused_across_decode_steps_are_not_aliased(model_folder, cpu_run):
    """Decode steps reuse buffers (the hybrid node's output, the dense segments' within-step outputs, bindings
    of unchanged inputs): what a caller keeps of a step (the logits) stays that step's, and every step is
    right, while the reuse is in effect."""
    from engine.dense_segment import DenseSegment
    from engine.offload.hybrid_node import HybridExpertNode

    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 2),
                             device=SimulatedDevice(1 << 30))
    nodes = [r for r in model.decoder.steps if isinstance(r, HybridExpertNode)]
    first_segment = next(r for r in model.decoder.steps if isinstance(r, DenseSegment) and not r.segment.on_host)
    for node in nodes:  # record what each node returns, by identity
        run = node.run
        node.run = lambda values, run=run, seen=[]: seen.append(run(values)) or seen[-1]
    ref_logits, ref_tokens = cpu_run
    state = model.new_state()
    logits = [model.decoder.forward(state, model.tokenizer.encode("The expert offload engine must be exact."))]
    segment_outputs = []
    for step in range(4):
        logits.append(model.decoder.forward(state, [ref_tokens[step]]))
        segment_outputs.append(first_segment.bindings._by_state[state]._results)
    kept = [lg.copy() for lg in logits]
    for node in nodes:
        seen = node.run.__defaults__[1]
        decode = seen[1:]  # after the prefill
        assert all(out is decode[0] for out in decode), "the decode steps' expert outputs share one buffer"
    assert segment_outputs[1] is not None and all(
        segment_outputs[-1][name] is segment_outputs[1][name] for name in segment_outputs[1])  # first segment too
    assert len({id(lg) for lg in logits}) == len(logits)  # the logits are new arrays at every step
    for step, (ours, copy, ref) in enumerate(zip(logits, kept, ref_logits)):
        assert np.array_equal(ours, copy), f"step {step}'s logits changed after later steps"
        assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-5, f"step {step}"


def test_fp16_decode_steps_return_one_kept_fp16_buffer(tmp_path):
    """A float16 model's hybrid node returns the same fp16 array at every decode step (so the next dense segment
    does not bind a new one), holding that step's result: greedy tokens equal the all-CPU run's."""
    from engine.offload.hybrid_node import HybridExpertNode

    folder = write_model(tmp_path / "m16", WriterSpec(layers=2, num_experts=8, top_k=2, hidden_size=64, inter_size=64,
                                                      seed=22, dtype="float16", dense_accuracy_level=0))
    ref_logits, ref_tokens = greedy_run(LoadedModel.open(folder), steps=6)
    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 2),
                             device=SimulatedDevice(1 << 30))
    node = next(r for r in model.decoder.steps if isinstance(r, HybridExpertNode))
    run, seen = node.run, []
    node.run = lambda values: seen.append(run(values)) or seen[-1]
    logits, tokens = greedy_run(model, steps=6)
    assert tokens == ref_tokens
    decode = seen[1:]
    assert decode[0].dtype == np.float16 and all(out is decode[0] for out in decode)
    for ours, ref in zip(logits, ref_logits):
        assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-2


def test_cpu_node_output_reused_across_decode_steps_is_not_aliased(model_folder):
    """Device cpu: each expert node returns one output buffer at every decode step (the next dense segment then
    binds nothing new); what a caller keeps of a step (the logits) stays that step's, and every step equals the
    run with a new array per call (CpuQMoE.forward, the node's former path)."""
    from engine.dense_segment import DenseSegment
    from engine.expert_node import CpuExpertNode

    class Forward:  # the kernel's own forward(): a new output array per call
        def __init__(self, kernel):
            self.kernel = kernel

        def forward(self, *args):
            return self.kernel.forward(*args)

    def decode(model):
        state = model.new_state()
        logits = [model.decoder.forward(state, model.tokenizer.encode("The expert offload engine must be exact."))]
        segment_outputs = []
        for _ in range(4):
            logits.append(model.decoder.forward(state, [int(logits[-1][-1].argmax())]))
            first = next(r for r in model.decoder.steps if isinstance(r, DenseSegment) and not r.segment.on_host)
            segment_outputs.append(first.bindings._by_state[state]._results)
        return logits, segment_outputs

    model = LoadedModel.open(model_folder)
    nodes = [r for r in model.decoder.steps if isinstance(r, CpuExpertNode)]
    assert nodes
    for node in nodes:  # record what each node returns, by identity
        run = node.run
        node.run = lambda values, run=run, seen=[]: seen.append(run(values)) or seen[-1]
    logits, segment_outputs = decode(model)
    kept = [lg.copy() for lg in logits]
    for node in nodes:
        decode_outputs = node.run.__defaults__[1][1:]  # after the prefill
        assert all(out is decode_outputs[0] for out in decode_outputs), "the decode steps' outputs share one buffer"
    assert segment_outputs[1] is not None and all(
        segment_outputs[-1][name] is segment_outputs[1][name] for name in segment_outputs[1])
    assert len({id(lg) for lg in logits}) == len(logits)

    reference = LoadedModel.open(model_folder)
    for node in reference.decoder.steps:
        if isinstance(node, CpuExpertNode):
            node.kernel = Forward(node.kernel)
    ref_logits, _ = decode(reference)
    for step, (ours, copy, ref) in enumerate(zip(logits, kept, ref_logits)):
        assert np.array_equal(ours, copy), f"step {step}'s logits changed after later steps"
        assert np.array_equal(ours, ref), f"step {step}"


def test_bounding_an_unbounded_host_cache_drops_the_pages_it_did_not_count(model_folder, cpu_run, monkeypatch):
    model = LoadedModel.open(model_folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))
    greedy_run(model, steps=3)
    cache = model.offload.host_cache
    assert cache.budget is None and cache.cached_bytes == 0  # unbounded: nothing accounted
    released = []
    monkeypatch.setattr(model.folder.onnx, "release_pages", lambda name, start, length: released.append(name))
    per_expert = expert_bytes(model_folder) // (16 * 3)
    model.offload.reconfigure(model.offload.config.updated(host_expert_bytes=5 * per_expert))
    tensors_per_node = len(model.offload.infos[0].weight_inputs)
    assert len(released) == 3 * 16 * tensors_per_node  # every expert of every node, each of its tensors
    logits, tokens = greedy_run(model)
    assert tokens == cpu_run[1] and 0 < cache.cached_bytes <= 5 * per_expert


def test_the_tier_paths_statistics_count_each_routed_pair_by_its_expert_and_residency(model_folder):
    """Decode path 'tier', half the experts resident: each decode step of a partly resident layer counts every routed
    pair as a hit of its expert where the expert has a slot, else as a miss read from the tier (account_resident),
    by the routing of the logits that step launched with."""
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30), decode_path="tier",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 2))
    engine = model.offload
    launched = []  # (layer, router logits, the experts in a slot then) of every routed launch
    for layer, store in enumerate(engine.stores):
        def spy(x, logits, router_weights, layer=layer, real=store.launch_routed):
            result, pending = real(x, logits, router_weights)
            router_logits = np.array(logits, np.float32).reshape(-1, SPEC.num_experts)
            launched.append((layer, router_logits, engine.slots[layer].slot_of >= 0))
            return result, pending

        store.launch_routed = spy
    state = model.new_state()
    logits = model.decoder.forward(state, model.tokenizer.encode("The expert offload engine must be exact."))
    stats = engine.stats
    before = [(stats.expert_hits[layer].copy(), stats.expert_misses[layer].copy(), stats.layers[layer].hits,
               stats.layers[layer].misses_read) for layer in range(SPEC.layers)]
    launched.clear()
    for _ in range(STEPS):
        logits = model.decoder.forward(state, [int(logits[-1].argmax())])
    assert len(launched) == STEPS * SPEC.layers
    expected = [(np.zeros(SPEC.num_experts, np.int64), np.zeros(SPEC.num_experts, np.int64))
                for _ in range(SPEC.layers)]
    for layer, router_logits, held in launched:
        for expert in np.argsort(-router_logits, axis=1)[:, :SPEC.top_k].ravel():
            expected[layer][0 if held[expert] else 1][expert] += 1
    for layer, (hits, misses) in enumerate(expected):
        hits_before, misses_before, layer_hits, layer_read = before[layer]
        assert 0 < hits.sum() and 0 < misses.sum()  # partly resident: both kinds of pairs
        np.testing.assert_array_equal(stats.expert_hits[layer] - hits_before, hits)
        np.testing.assert_array_equal(stats.expert_misses[layer] - misses_before, misses)
        assert stats.layers[layer].hits - layer_hits == hits.sum()
        assert stats.layers[layer].misses_read - layer_read == misses.sum()


def test_under_decode_path_both_a_table_that_gives_the_cpu_nothing_leaves_the_steps_to_the_tier(model_folder,
                                                                                                cpu_run):
    """Where the split's table gives the CPU no pair at any count of cold pairs (a CPU far slower than the tier), a
    "both" step would only make the host wait for the routing: the layer takes the tier's step instead."""
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 2))
    engine = model.offload
    engine.cold_split_table = lambda layer: np.zeros(SPEC.top_k + 1, np.int32)
    split = []
    real = engine.stores[1].launch_split
    engine.stores[1].launch_split = lambda *args: split.append(1) or real(*args)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = engine.stats.totals()
    assert not split and totals.routed_on_device == STEPS * SPEC.layers and totals.misses_read > 0
    assert engine.stats.phases["decode"].cpu_s == 0.0



def test_under_decode_path_both_a_split_pair_runs_where_the_table_gives_the_cpu_no_whole_pair(tmp_path):
    """With a pair split by rows in force, the split's table may give the CPU no whole pair at any count of cold pairs
    and only the rows of a split one (a CPU slower than the tier an expert, yet faster on a part): the layer still
    takes the "both" step, where the CPU computes those rows. It took the tier's step, the split never ran."""
    from engine.offload.split_share import SPLIT_ROWS, RowSplitTrials, SplitShareTrials

    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)
    folder = write_model(tmp_path / "m", spec)
    reference = greedy_run(LoadedModel.open(folder))
    model = LoadedModel.open(folder, device=SimulatedDevice(1 << 30), decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    engine = model.offload
    engine._split_costs = lambda layer: (500e-6, 0.0, 100e-6)  # the CPU 5x slower than the tier an expert
    engine.share_trials = SplitShareTrials(first=10 ** 6)  # no trial in these steps: the split in force throughout
    engine.row_trials = RowSplitTrials(first=10 ** 6)
    engine.row_trials.choice = SPLIT_ROWS
    assert not engine.cold_split_table(0).any() and engine.cold_split_rows(0).any()
    split = []
    real = engine.stores[1].launch_split
    engine.stores[1].launch_split = lambda *args: split.append(args[-1]) or real(*args)
    assert_same_as_cpu(greedy_run(model), reference)
    assert len(split) == STEPS and all(rows is not None and rows.any() for rows in split)
    assert engine.stats.totals().misses_cpu > 0 and engine.stats.phases["decode"].cpu_s > 0



def test_the_simulated_device_prices_a_split_pair_as_the_gpu_reads_only_its_rows(tmp_path):
    """A pair split by rows: the GPU's decode kernels read its first r rows of FC1 and FC2 alone (cuda_device.py:
    launch_split), and the engine counts r / inter of the expert as read from the tier (account_split). The simulated
    device priced the split pair's read whole, so the tier's measured rate there fell below the card's with every
    split, and the split's table and the row trials' projected steps took the GPU for slower than it is."""
    from engine.offload.devices import TIER_READ_SHARE
    from engine.offload.split_share import SPLIT_ROWS, RowSplitTrials, SplitShareTrials

    spec = WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=128, inter_size=256, seed=5,
                      dense_accuracy_level=0)
    folder = write_model(tmp_path / "m", spec)
    reference = greedy_run(LoadedModel.open(folder))
    device = SimulatedDevice(1 << 30)
    model = LoadedModel.open(folder, device=device, decode_path="both",
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(folder) // 4))
    engine = model.offload
    engine._split_costs = lambda layer: (100e-6, 0.0, 100e-6)  # the CPU and the GPU alike: the table splits a pair
    engine.share_trials = SplitShareTrials(first=10 ** 6)  # no trial in these steps: the split in force throughout
    engine.row_trials = RowSplitTrials(first=10 ** 6)
    engine.row_trials.choice = SPLIT_ROWS
    split = []
    real = engine.stores[1].launch_split
    engine.stores[1].launch_split = lambda *args: split.append(real(*args)) or split[-1]
    assert_same_as_cpu(greedy_run(model), reference)
    assert any((pending[2] > 1).any() for pending in split)  # steps with a split pair (its code: rows + 1)
    assert engine.tier_read.value == pytest.approx(TIER_READ_SHARE * device.bandwidths.pcie)


def mapped_pages(array: np.ndarray) -> int:
    """Pages of `array`'s memory mapped into this process now (/proc/self/pagemap's present bit)."""
    first, end = array.ctypes.data // 4096, -(-(array.ctypes.data + array.nbytes) // 4096)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((end - first) * 8), np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


def assert_mapped_as_the_cache_holds(model) -> None:
    """The experts' pages mapped into this process are those of the experts the host cache holds, each held one's
    whole rows (the first and last page of a held expert's rows may be a neighbour's too)."""
    cache, onnx, infos = model.offload.host_cache, model.folder.onnx, model.offload.infos
    assert cache.cached_bytes > 0
    mapped = sum(mapped_pages(onnx.array(name)) for info in infos for name in info.weight_inputs.values())
    assert mapped * 4096 <= cache.cached_bytes + len(cache._lru) * len(infos[0].weight_inputs) * 2 * 4096
    for layer, expert in cache._lru:
        for name in infos[layer].weight_inputs.values():
            rows = onnx.array(name)[expert]
            spanned = -(-(rows.ctypes.data + rows.nbytes) // 4096) - rows.ctypes.data // 4096
            assert mapped_pages(rows) == spanned, (layer, expert, name)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_the_host_cache_bounds_the_pages_the_simulated_devices_stand_in_reads(tmp_path):
    """The simulated device computes its resident experts and prefill waves with the CPU kernel, reading them from the
    mapped file, where a card reads its own memory (and a real copy's pages leave once read: release_after_read). Those
    pages stayed mapped: 424 MB of a 483 MiB model's experts under host_expert_bytes=50000000, so records' RSS peaks
    on the simulated device said nothing of the bound."""
    folder = write_model(tmp_path / "m", WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=256, inter_size=256,
                                                    seed=5, dense_accuracy_level=0))
    per_expert = LoadedModel.open(folder).folder.expert_bytes // (2 * 16)
    config = OffloadConfig(device_expert_bytes=2 * 12 * per_expert, host_expert_bytes=2 * per_expert,
                           placement="static")
    model = LoadedModel.open(folder, offload=config, device=SimulatedDevice(1 << 30))
    assert all(layer.num_slots >= 8 for layer in model.offload.slots)  # most experts read by the stand-in
    greedy_run(model)
    assert_mapped_as_the_cache_holds(model)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_without_file_backing_the_files_pages_leave_this_process_once_copied(model_folder):
    """allow_file_backing=0 copies the experts into RAM; the file's pages the copy read were left mapped, so the
    process held the experts twice (1.28 GB peak RSS for 483 MiB of experts, 0.78 GB with the file backing them)."""
    config = OffloadConfig(device_expert_bytes=0, allow_file_backing=False)
    model = LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    onnx = model.folder.onnx
    names = [name for info in model.offload.infos for name in info.weight_inputs.values()]
    assert sum(mapped_pages(onnx.array(name)) for name in names) == 0
    assert sum(onnx.nbytes(name) for name in names) > 100 * 4096  # (pages enough to tell)


def test_a_pinned_ring_beyond_the_memory_available_is_refused(model_folder, monkeypatch):
    """An explicit pinned_bytes was page-locked whatever the host had: on a CUDA device a ring of more than the memory
    available starves every other process (page-locked memory is neither swapped nor reclaimed) or fails as an
    internal error. It is refused before the load takes it, naming the key and the sizes, and so is it by the estimate
    (the budget panel, inspect)."""
    import psutil

    from app.gui.estimate import staged_nodes, staging_for
    from engine.model_folder import ModelFolder

    # (total: the sliding window's check at open reads it)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 10**9, "total": 16 * 10**9}))
    config = OffloadConfig(pinned_bytes=2 * 10**9)
    said = ("session.moe.offload.pinned_bytes=2000000000 page-locks more than the 1000000000 bytes of host memory "
            "available")
    with pytest.raises(OffloadPlanError) as refused:
        LoadedModel.open(model_folder, offload=config, device=SimulatedDevice(1 << 30))
    assert str(refused.value) == said
    with pytest.raises(OffloadPlanError) as refused:
        staging_for(config, staged_nodes(ModelFolder.open(model_folder)), SimulatedDevice(1 << 30))
    assert str(refused.value) == said
    model = LoadedModel.open(model_folder, offload=OffloadConfig(pinned_bytes=10**9 // 2),
                             device=SimulatedDevice(1 << 30))
    with pytest.raises(OffloadPlanError, match="pinned_bytes=2000000000 page-locks more"):
        model.offload.reconfigure(config)
    assert model.offload.pinned_info()["bytes"] == 10**9 // 2  # the ring in force stays


def test_without_file_backing_experts_beyond_the_memory_available_are_refused(model_folder, monkeypatch):
    """allow_file_backing=0 under host_expert_bytes=auto copied the experts into RAM whatever the host had: a model
    larger than the memory available ended in the OOM killer. It is refused, naming the key and the sizes."""
    import psutil

    total = expert_bytes(model_folder)
    monkeypatch.setattr(psutil, "virtual_memory",  # (total: the sliding window's check at open reads it)
                        lambda: type("Memory", (), {"available": total - 1, "total": 16 * 10**9}))
    with pytest.raises(OffloadPlanError) as refused:
        LoadedModel.open(model_folder, offload=OffloadConfig(allow_file_backing=False), device=None)
    assert str(refused.value) == (f"allow_file_backing=0 keeps all {total} bytes of experts in host memory, more than "
                                  f"the {total - 1} bytes of host memory available")
    # experts already copied into RAM count as available to the same setting on a re-plan
    monkeypatch.undo()
    model = LoadedModel.open(model_folder, offload=OffloadConfig(allow_file_backing=False), device=None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 0}))
    model.offload.reconfigure(model.offload.config.updated(cpu_threads=1))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux's pagemap")
def test_the_host_cache_bounds_the_experts_pages_mapped_into_this_process(tmp_path):
    """Reading an expert maps the pages around those it faults on (fault-around; a whole large folio of the page cache
    on Linux 6.18), which spill into the neighbouring experts: the cache counted 15 MiB under host_expert_bytes=16 MiB
    while 38 MB of experts were mapped. What it does not hold now leaves the process: mapped pages = its bytes (each
    held expert's first and last pages may be shared with a neighbour's range)."""
    folder = write_model(tmp_path / "m", WriterSpec(layers=2, num_experts=16, top_k=4, hidden_size=256, inter_size=256,
                                                    seed=5, dense_accuracy_level=0))
    per_expert = LoadedModel.open(folder).folder.expert_bytes // (2 * 16)
    model = LoadedModel.open(folder, offload=OffloadConfig(host_expert_bytes=6 * per_expert), device=None)
    greedy_run(model)
    cache, onnx = model.offload.host_cache, model.folder.onnx
    assert cache.evictions > 0 and 0 < cache.cached_bytes <= 6 * per_expert
    tensors = [name for info in model.offload.infos for name in info.weight_inputs.values()]
    mapped = sum(mapped_pages(onnx.array(name)) for name in tensors) * 4096
    held = len(cache._lru)
    assert mapped <= cache.cached_bytes + held * len(model.offload.infos[0].weight_inputs) * 2 * 4096


def test_placement_counts_the_routers_choice_not_approximate_routings_substitutes(model_folder, monkeypatch):
    """With tail substitution on, a cold tail expert is computed by a resident in its place (approximate.py); placement
    counts the expert the router chose. Counting the substitute, always a resident, kept whatever was resident: static
    placement's opening chose the copied misses it had substituted with (half of its counted pairs on a 3-layer model)."""
    from engine.offload import hybrid_node

    exact, computed, observed = [], [], []
    approximate = hybrid_node.approximate_routing

    def approximate_spy(ids, *args):
        out = approximate(ids, *args)
        exact.append(ids.copy())
        computed.append(out.copy())
        return out

    monkeypatch.setattr(hybrid_node, "approximate_routing", approximate_spy)
    model = LoadedModel.open(model_folder, device=SimulatedDevice(1 << 30),
                             offload=OffloadConfig(device_expert_bytes=device_expert_bytes(model_folder) // 4,
                                                   tail_substitution_threshold=1.0, tail_substitution_min_rank=1))
    observe = model.offload.policy.observe
    model.offload.policy.observe = lambda layer, ids: (observed.append(ids.copy()), observe(layer, ids))
    greedy_run(model, steps=3)
    assert model.offload.approximation.substituted > 0  # substitutes computed ...
    assert any((a != b).any() for a, b in zip(exact, computed))
    assert len(observed) == len(exact)  # ... and what placement counted in each layer's step is the router's choice
    assert all(np.array_equal(seen, ids.reshape(-1)) for seen, ids in zip(observed, exact))
