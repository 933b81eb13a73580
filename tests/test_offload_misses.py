"""Decode misses split between the CPU and spare device slots by the cost model (miss_policy.py),
and the bounded pinned staging ring (pinned_bytes), on the simulated device."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import engine.offload.hybrid_node as hybrid_node
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.devices import Bandwidths, SimulatedSlots
from engine.offload.miss_policy import (CopyReuse, CpuRate, MissCosts, choose, copying_pays, cpu_bytes_per_s,
                                        cpu_rate_words, decode_costs, miss_costs, miss_slots)
from engine.offload.placement import LayerSlots, make_policy
from engine.offload.planner import OffloadPlanError
from engine.writer import write_model
from tests.test_offload import SPEC, assert_same_as_cpu, greedy_run

# CPU FLOP/s high enough that decode misses cost their bytes / B_cpu (memory-bound, as on real machines)
FAST_PCIE = Bandwidths(pcie=1e15, hbm=1e15, cpu=1e6, cpu_flops=1e18)     # copying always pays
SLOW_PCIE = Bandwidths(pcie=1e3, hbm=1e15, cpu=1e15, cpu_flops=1e18)     # the CPU always wins
BALANCED = Bandwidths(pcie=4e9, hbm=4e9, cpu=1e9, cpu_flops=1e18)        # copy = device = CPU / 4 per expert
MIXES = {"fast_pcie": FAST_PCIE, "slow_pcie": SLOW_PCIE, "balanced": BALANCED}


def decide(bandwidths, expert_bytes, tokens, spare_slots, resident_s, **costs):
    """The miss policy's decision for one step: the hybrid node's miss_costs, then choose."""
    return choose(miss_costs(bandwidths, expert_bytes, tokens, resident_s, **costs), spare_slots)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("misses") / "m", SPEC)


@pytest.fixture(scope="module")
def cpu_run(model_folder):
    return greedy_run(LoadedModel.open(model_folder))


@pytest.fixture(scope="module")
def per_expert(model_folder):
    """One expert as stored (what a prefill wave gathers into the pinned ring)."""
    return LoadedModel.open(model_folder).folder.experts[0].bytes_per_expert


@pytest.fixture(scope="module")
def slot_bytes(model_folder):
    """One device slot: the expert in the GPU kernels' layout (what budgets count)."""
    return LoadedModel.open(model_folder).folder.experts[0].device_bytes_per_expert


@pytest.fixture(scope="module")
def staged(model_folder):
    """One expert in the pinned ring (the larger of the stored rows and the packed kernel layout)."""
    model = LoadedModel.open(model_folder, offload=OffloadConfig(mode="disabled"), device=SimulatedDevice(1 << 30))
    return max(SimulatedDevice().staging_bytes_per_expert(runner) for runner in model.offload.runners)


@pytest.fixture
def decisions(monkeypatch):
    """Every decision the miss policy takes: (spare slots offered, misses, MissDecision)."""
    seen = []

    def recording(costs, spare_slots):
        decision = choose(costs, spare_slots)
        seen.append((spare_slots, costs.cpu_s.size, decision))
        return decision

    monkeypatch.setattr(hybrid_node, "choose", recording)
    return seen


def open_model(model_folder, bandwidths, measure_cpu_rate=False, **config):
    """The model on a simulated device with these bandwidths. The CPU kernels' measured rate (CpuRate) is left
    unmeasured unless asked for: it depends on the machine's speed, and with it the miss policy's decisions; the
    CI machine's rate once turned a test's decisions into ones this machine never took."""
    device = SimulatedDevice(1 << 30, bandwidths=bandwidths)
    model = LoadedModel.open(model_folder, offload=OffloadConfig(**config), device=device)
    if not measure_cpu_rate:
        model.offload.cpu_rate.observe = lambda nbytes, seconds, layer=None: None
    return model, device


# --- the cost function ----------------------------------------------------------------------------

def test_the_cost_model_finds_the_best_split_of_every_random_case():
    rng = np.random.default_rng(4)
    for _ in range(400):
        n = int(rng.integers(0, 7))
        costs = MissCosts(cpu_s=rng.uniform(0.1, 3.0, n) * rng.choice([1e-4, 1e-3]), copy_s=float(rng.uniform(0, 2e-3)),
                          device_s=float(rng.uniform(0, 1e-3)), resident_s=float(rng.uniform(0, 3e-3)),
                          prepare_s=float(rng.choice([0.0, rng.uniform(0, 1e-3)])),
                          credit_s=float(rng.choice([0.0, rng.uniform(0, 1e-3)])),  # later hits' credit
                          launch_s=float(rng.choice([0.0, rng.uniform(0, 2e-3)])),  # a launch of the copies' own
                          cpu_fixed_s=float(rng.choice([0.0, rng.uniform(0, 2e-3)])))  # the CPU kernels' per call
        spares = int(rng.integers(0, n + 2))
        decision = choose(costs, spares)
        best = min(costs.worth(np.array(subset, dtype=np.int64))
                   for size in range(min(n, spares) + 1) for subset in itertools.combinations(range(n), size))
        assert decision.worth_s == pytest.approx(best, rel=1e-9, abs=1e-15)
        assert costs.worth(decision.copied) == pytest.approx(decision.worth_s, rel=1e-9, abs=1e-15)
        assert costs.step_seconds(decision.copied) == pytest.approx(decision.predicted_s, rel=1e-9, abs=1e-15)
        assert decision.num_copied <= min(n, spares)
        if costs.credit_s == 0.0:  # without credit, W is the step's time: never above all-CPU or all-copied
            assert decision.predicted_s <= decision.all_cpu_s + 1e-15
            assert decision.predicted_s <= decision.most_copied_s + 1e-15
        assert decision.all_cpu_s == pytest.approx(costs.step_seconds(np.empty(0, np.int64)), rel=1e-9, abs=1e-15)


def test_copying_pays_exactly_when_the_policy_would_copy_something():
    rng = np.random.default_rng(5)
    for case in range(2000):
        n = int(rng.integers(0, 9))
        scale = rng.choice([1e-4, 1e-3])
        cpu = rng.uniform(0.1, 3.0, n) * scale
        if case % 3 == 0:  # equal costs and round numbers: ties between T(0), T(1), T(2) ...
            cpu = np.full(n, float(rng.choice([1e-4, 2.5e-4, 1e-3])))
        costs = MissCosts(cpu_s=cpu, copy_s=float(rng.choice([0.0, 1e-4, rng.uniform(0, 2e-3)])),
                          device_s=float(rng.choice([0.0, 1e-4, rng.uniform(0, 1e-3)])),
                          resident_s=float(rng.choice([0.0, 3e-4, rng.uniform(0, 3e-3)])),
                          prepare_s=float(rng.choice([0.0, rng.uniform(0, 1e-3)])),
                          credit_s=float(rng.choice([0.0, 1e-4, rng.uniform(0, 1e-3)])),
                          launch_s=float(rng.choice([0.0, 0.0, 2e-4, rng.uniform(0, 2e-3)])),
                          cpu_fixed_s=float(rng.choice([0.0, 0.0, 1e-4, rng.uniform(0, 3e-3)])))
        assert copying_pays(costs) == (choose(costs, n).num_copied > 0), costs


def test_a_launch_of_their_own_must_be_earned_by_the_copies():
    """The streaming slots' copies need a launch and a merge of their own: its host time is paid once, so a
    single copy may not pay where two do, and a dear enough launch stops all copies."""
    cpu = np.full(4, 1e-3)  # four misses, 1 ms each on the CPU
    cheap = MissCosts(cpu_s=cpu, copy_s=0.4e-3, device_s=0.0, resident_s=0.0, prepare_s=0.0, launch_s=0.5e-3)
    # m = 1: 0.5 + max(3, 0.4) = 3.5 ms; m = 2: 0.5 + max(2, 0.8) = 2.5; m = 3: 0.5 + max(1, 1.2) = 1.7 ms
    assert choose(cheap, 4).num_copied == 3 and choose(cheap, 4).predicted_s == pytest.approx(1.7e-3)
    assert copying_pays(cheap)
    dear = MissCosts(cpu_s=cpu, copy_s=0.4e-3, device_s=0.0, resident_s=0.0, prepare_s=0.0, launch_s=3e-3)
    assert choose(dear, 4).num_copied == 0 and not copying_pays(dear)  # 3 + max(1, 1.2) = 4.2 > 4 ms at best
    # m = 1 alone does not pay (1.05 + max(3, 0.2) = 4.05 > 4 ms) but two do (1.05 + 2 = 3.05): every m is tried
    jump = MissCosts(cpu_s=np.full(4, 1e-3), copy_s=0.2e-3, device_s=0.0, resident_s=0.0, prepare_s=0.0,
                     launch_s=1.05e-3)
    assert jump._time(1, 3e-3) > jump._time(0, 4e-3) > jump._time(2, 2e-3)
    assert copying_pays(jump) and choose(jump, 4).num_copied >= 2


def test_the_cpu_cost_per_call_is_saved_only_when_no_miss_stays_on_the_cpu():
    # three misses of 0.1 ms each on the CPU plus 0.5 ms per call; a copy costs 0.15 ms of host time (prep) and
    # 0.05 ms of PCIe + device: one or two copies only add host time (0.5 + 0.2 + 0.15 = 0.85 ms against 0.8), all
    # three remove the call: max(3 x 0.15, 3 x 0.2) = 0.6 ms
    costs = MissCosts(cpu_s=np.full(3, 0.1e-3), copy_s=0.05e-3, device_s=0.0, resident_s=0.0, prepare_s=0.15e-3,
                      cpu_fixed_s=0.5e-3)
    assert [costs._time(m, (3 - m) * 0.1e-3) for m in range(4)] == pytest.approx([0.8e-3, 0.85e-3, 0.9e-3, 0.6e-3])
    assert choose(costs, 3).num_copied == 3 and choose(costs, 3).predicted_s == pytest.approx(0.6e-3)
    assert choose(costs, 2).num_copied == 0  # two slots cannot take every miss: the call stays, copies don't pay
    assert copying_pays(costs)
    # averaged over the call, a miss would look 0.27 ms dear and one copy would pay: 0.15 + 2 x 0.27 < 0.8 ms
    average = MissCosts(cpu_s=np.full(3, 0.8e-3 / 3), copy_s=0.05e-3, device_s=0.0, resident_s=0.0, prepare_s=0.15e-3)
    assert choose(average, 2).num_copied == 2
    # no miss: no call, nothing to save
    assert MissCosts(cpu_s=np.empty(0), copy_s=0.0, device_s=0.0, resident_s=1e-3,
                     cpu_fixed_s=0.5e-3).step_seconds(np.empty(0, np.int64)) == pytest.approx(1e-3)


def test_the_cpu_cost_fit_separates_a_cost_per_call_from_the_rate():
    rng = np.random.default_rng(3)
    expert = 2_960_000  # Qwen3-30B-A3B-like's expert; the H200 Xeon's calls: ~180 µs + bytes / 66 GB/s
    rate = CpuRate()
    calls = []
    for _ in range(60):
        nbytes = int(rng.integers(1, 9)) * expert
        seconds = (180e-6 + nbytes / 66e9) * float(rng.uniform(0.95, 1.05))
        calls.append((nbytes, seconds))
        rate.observe(nbytes, seconds)
    assert rate.fixed_s == pytest.approx(180e-6, rel=0.15) and rate.value == pytest.approx(66e9, rel=0.1)
    average = None
    for nbytes, seconds in calls:
        average = nbytes / seconds if average is None else 0.9 * average + 0.1 * nbytes / seconds
    assert rate.average == pytest.approx(average) and rate.average < 0.7 * rate.value
    # every call on the same bytes (0% resident: every token's k misses): no line, the average rate alone
    same = CpuRate()
    for _ in range(20):
        same.observe(8 * expert, 540e-6)
    assert same.fixed_s == 0.0 and same.value == pytest.approx(8 * expert / 540e-6)
    # too few calls, or the fit switched off (bench_offload --cpu-average-rate): the average rate
    few, off = CpuRate(), CpuRate(fit=False)
    for nbytes, seconds in calls[:7]:
        few.observe(nbytes, seconds)
    for nbytes, seconds in calls:
        off.observe(nbytes, seconds)
    assert few.fixed_s == 0.0 and few.value == few.average
    assert off.fixed_s == 0.0 and off.value == pytest.approx(average)
    # a line through negative seconds per call (calls on more bytes disproportionately slower): fitted through the
    # origin instead, where it still explains the calls (R² ~0.89 of 50 and 450 µs a call, within the warm-up
    # window's 10x of one another): 10 experts in 1.4 ms
    steep = CpuRate()
    for n in [1, 3] * 6:
        steep.observe(n * expert, n * n * 50e-6)
    assert steep.fixed_s == 0.0 and steep.value == pytest.approx(10 * expert / 1.4e-3, rel=2e-3)


def test_the_cost_model_on_plain_numbers():
    # four single-token misses of 1 MB; CPU 1 GB/s (1 ms each), PCIe and HBM 4 GB/s (0.25 ms each)
    decision = decide(BALANCED, 1_000_000, np.ones(4), spare_slots=8, resident_s=0.0)
    assert decision.num_copied == 3 and decision.predicted_s == pytest.approx(1.5e-3)  # max(1 ms, 0.75 + 0.75 ms)
    assert decision.all_cpu_s == pytest.approx(4e-3) and decision.most_copied_s == pytest.approx(2e-3)
    assert decide(BALANCED, 1_000_000, np.ones(4), spare_slots=1, resident_s=0.0).num_copied == 1
    assert decide(BALANCED, 1_000_000, np.ones(4), spare_slots=0, resident_s=0.0).num_copied == 0
    busy = decide(BALANCED, 1_000_000, np.ones(4), spare_slots=8, resident_s=10e-3)  # the device is busy anyway
    assert busy.num_copied == 0
    # the misses with the most tokens are the ones copied when the CPU is compute-bound on them
    skewed = decide(Bandwidths(pcie=4e9, hbm=4e9, cpu=1e9, cpu_flops=1e9), 1_000_000, np.array([1, 50, 2]),
                    spare_slots=1, resident_s=0.0, flops_per_token=1e5)
    assert skewed.copied.tolist() == [1]


def test_the_measured_cpu_rate_makes_copies_pay_when_the_kernels_fall_short_of_streaming():
    # BALANCED: the CPU streams at 1 GB/s (1 ms per 1 MB miss), copy and device 0.25 ms each; with prep 1.2 ms a copy
    # costs the CPU more than computing the miss, unless the kernels reach only 0.25 GB/s (4 ms per miss): then both
    # are copied, max(2 x 1.2, 2 x (1.2 + 0.25) + 2 x 0.25) = 3.4 ms against 8 ms
    assert decide(BALANCED, 1_000_000, np.ones(2), spare_slots=2, resident_s=0.0, prepare_s=1.2e-3).num_copied == 0
    slow = decide(BALANCED, 1_000_000, np.ones(2), spare_slots=2, resident_s=0.0, prepare_s=1.2e-3, cpu_rate=0.25e9)
    assert slow.num_copied == 2 and slow.predicted_s == pytest.approx(3.4e-3) and slow.all_cpu_s == pytest.approx(8e-3)
    fast = decide(BALANCED, 1_000_000, np.ones(2), spare_slots=2, resident_s=0.0, prepare_s=1.2e-3, cpu_rate=50e9)
    assert fast.all_cpu_s == pytest.approx(2e-3)  # never faster than the streaming bandwidth
    rate = CpuRate(keep=0.5)
    rate.observe(100, 0.0)  # nothing measured
    assert rate.value is None
    rate.observe(1000, 1.0)
    rate.observe(3000, 1.0)
    assert rate.value == pytest.approx(2000.0)


def test_copies_reused_by_later_steps_earn_a_credit_that_can_make_copying_pay():
    # BALANCED with prep 1.2 ms: one 1 MB miss costs the CPU 1 ms; copying it costs the CPU 1.2 ms of host time, so
    # this step alone never copies. Each later hit saves read - dev = 1 - 0.25 ms: with 0.5 reuses per copy the
    # credit is 0.375 ms and W(1) = max(1.2, 1.2 + 0.25 + 0.25) - 0.375 = 1.325 ms > 1 ms: still no copy; with 1
    # reuse, W(1) = 1.7 - 0.75 = 0.95 ms < 1 ms: copied, though this step takes longer (T = 1.7 ms)
    args = dict(spare_slots=1, resident_s=0.0, prepare_s=1.2e-3)
    assert decide(BALANCED, 1_000_000, np.ones(1), **args).num_copied == 0
    assert decide(BALANCED, 1_000_000, np.ones(1), reuse=0.5, **args).num_copied == 0
    reused = decide(BALANCED, 1_000_000, np.ones(1), reuse=1.0, **args)
    assert reused.num_copied == 1 and reused.predicted_s == pytest.approx(1.7e-3)
    assert reused.worth_s == pytest.approx(0.95e-3)
    # a credit is never negative: when the device reads an expert slower than the CPU, later hits save nothing
    slow_device = Bandwidths(pcie=4e9, hbm=0.5e9, cpu=1e9, cpu_flops=1e18)
    assert miss_costs(slow_device, 1_000_000, [1], 0.0, reuse=3.0).credit_s == 0.0


def _all_resident(ids):
    """(ids, resident mask) of a step whose routed experts were all found resident."""
    return np.array(ids), np.ones(len(ids), bool)


def test_copy_reuse_counts_later_hits_on_copied_experts_within_its_window():
    reuse = CopyReuse([8, 8], window=2, keep=1.0, min_copies=2)
    reuse.copied(0, [3, 5])
    assert reuse.value == 0.0
    reuse.hit(0, *_all_resident([3, 3, 5]))  # the copy's own step: not a later hit
    assert reuse.value == 0.0
    reuse.end_step()
    reuse.hit(0, *_all_resident([3, 3, 1]))  # one step later: expert 3 once (two tokens), expert 1 was never copied
    reuse.hit(1, *_all_resident([3, 5]))     # another layer: nothing copied there
    assert reuse.value == pytest.approx(0.5)
    reuse.end_step()
    reuse.hit(0, *_all_resident([3, 5]))
    assert reuse.value == pytest.approx(1.5)
    reuse.end_step()
    reuse.hit(0, *_all_resident([3, 5]))     # three steps after the copy: outside the window
    assert reuse.value == pytest.approx(1.5)
    assert CopyReuse([8], min_copies=4).value is None  # nothing measured yet
    decayed = CopyReuse([8], keep=0.5, min_copies=1)
    decayed.copied(0, [1])
    decayed.end_step()
    decayed.hit(0, *_all_resident([1]))
    decayed.end_step()
    decayed.copied(0, [2])  # the first copy two steps ago weighs a quarter, its hit one step ago half
    assert decayed.value == pytest.approx(0.5 / (0.25 + 1))


def test_decode_misses_on_the_cpu_measure_its_rate(model_folder, slot_bytes):
    """Each decode step's CPU misses are observed once per layer with slots: their distinct experts' bytes over
    the CPU kernel's seconds; the rate is the running average of those."""
    model, _device = open_model(model_folder, BALANCED, measure_cpu_rate=True, device_expert_bytes=4 * 3 * slot_bytes)
    rate = model.offload.cpu_rate
    assert rate.value is None
    seen, observe = [], rate.observe
    rate.observe = lambda nbytes, seconds, layer: seen.append((nbytes, seconds, layer)) or observe(nbytes, seconds,
                                                                                                  layer)
    greedy_run(model, steps=4)
    per_expert = model.folder.experts[0].bytes_per_expert
    k = model.folder.experts[0].spec.k
    assert model.offload.stats.totals().misses_cpu > 0 and seen
    assert all(nbytes % per_expert == 0 and 0 < nbytes <= k * per_expert and seconds > 0 for nbytes, seconds, _ in seen)
    expected, layers = None, set()
    for nbytes, seconds, layer in seen:
        if layer in layers:  # each layer's first call is left out
            expected = nbytes / seconds if expected is None else 0.9 * expected + 0.1 * nbytes / seconds
        layers.add(layer)
    assert len(layers) == len(model.offload.infos) and rate.average == pytest.approx(expected)
    refit = CpuRate()
    for nbytes, seconds, layer in seen:
        refit.observe(nbytes, seconds, layer)
    assert (rate.value, rate.fixed_s) == (refit.value, refit.fixed_s)
    state = model.offload.stats_dict()  # records, --json and the placement view's copies line carry the pricing
    # (the rate in force: the measured one held to the device's streaming read, which a fast host passes here)
    in_force = cpu_bytes_per_s(model.offload.device.bandwidths, rate.value)
    assert (state["cpu_bytes_per_s"], state["cpu_call_s"]) == (in_force, rate.fixed_s)


# --- on the simulated device ------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["static", "adaptive"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_outputs_equal_the_all_cpu_run_for_every_decision_mix(model_folder, cpu_run, slot_bytes, decisions,
                                                             placement, mix):
    model, device = open_model(model_folder, MIXES[mix], placement=placement,
                               device_expert_bytes=8 * 3 * slot_bytes)  # 8 of 16 experts per layer
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = model.offload.stats.totals()
    assert totals.misses_cpu + totals.misses_copied == totals.misses > 0
    for _spares, _n, decision in decisions:
        # the policy minimises W = T - copies' credit; the credit (CopyReuse) depends on which misses earlier
        # steps copied, and so on the measured CPU rate: a credited copy may lengthen this step's T beyond T(0)
        assert decision.worth_s <= decision.all_cpu_s * (1 + 1e-9)
        assert decision.worth_s <= decision.most_copied_s * (1 + 1e-9)
        assert decision.predicted_s >= decision.worth_s
        if decision.num_copied == 0:
            assert decision.predicted_s == decision.worth_s == decision.all_cpu_s
    if placement != "static":
        return
    # static placement without a popularity file chooses nothing in its opening (StaticPlacement), nearly all of
    # this run: every slot is spare for misses; with slow PCIe no copy can pay, and the node does not even ask
    # (miss_policy.copying_pays)
    assert bool(decisions) == (mix != "slow_pcie")
    copied = [d.num_copied for _s, _n, d in decisions]
    if mix == "fast_pcie":
        assert all(d.num_copied == min(n, spares) for spares, n, d in decisions)
        assert totals.miss_copies == sum(copied) > 0
    elif mix == "slow_pcie":
        assert sum(copied) == 0 and totals.misses_copied == 0 and totals.misses_cpu == totals.misses
    else:
        both = [(n, d) for _s, n, d in decisions if 0 < d.num_copied < n]
        assert both, "balanced bandwidths should split some step between the CPU and the device"
        for n, d in both:
            assert d.worth_s < d.all_cpu_s and d.worth_s <= d.most_copied_s
    splits = model.offload.stats.step_splits
    assert len(splits) == model.offload.stats.steps and sum(c for c, _, _ in splits) == totals.misses_cpu
    record = model.offload.stats.as_dict()
    assert record["misses_copied"] == totals.misses_copied and len(record["step_splits"]) == len(splits)


def test_copied_misses_stay_resident_and_placement_is_told(model_folder, slot_bytes, decisions):
    model, _device = open_model(model_folder, FAST_PCIE, placement="static", device_expert_bytes=8 * 3 * slot_bytes)
    state = model.new_state()
    model.decoder.forward(state, model.tokenizer.encode("Copied misses stay"))
    model.offload.stats.reset(len(model.offload.slots))
    logits = model.decoder.forward(state, [int(model.tokenizer.encode("x")[0])])
    policy = model.offload.policy
    assert policy.opening and policy.admissions > 0
    for index, layer in enumerate(model.offload.slots):
        resident = layer.resident()
        # static placement, in its opening, wants none of them
        assert set(resident) <= set(np.flatnonzero(policy.admitted[index]))
        assert np.all(layer.slot_of[resident] >= 0)
    hits_before = model.offload.stats.totals().hits
    model.decoder.forward(state, [int(logits[-1].argmax())])
    assert model.offload.stats.totals().hits >= hits_before


def test_copies_that_would_be_a_steps_only_device_work_are_charged_its_launch(model_folder, cpu_run, slot_bytes,
                                                                            monkeypatch):
    """A step whose routing hits no resident expert has no device part unless misses are copied: the copies are
    charged the slots' launch and merge (the store's launch_s), and a launch dearer than the CPU's work keeps every
    miss of such steps on the CPU. With residents routed the launch happens anyway and costs the copies nothing."""
    def run(launch_s):
        monkeypatch.setattr(SimulatedSlots, "launch_s", launch_s, raising=False)
        asked = []  # (the costs of a step's misses, whether copying any can pay)

        def recording(costs):
            pays = copying_pays(costs)
            asked.append((costs, pays))
            return pays

        monkeypatch.setattr(hybrid_node, "copying_pays", recording)
        # 5 of 16 experts a layer resident: some steps route to none of them
        model, _device = open_model(model_folder, FAST_PCIE, device_expert_bytes=5 * 3 * slot_bytes)
        assert_same_as_cpu(greedy_run(model), cpu_run)
        return asked

    cheap = run(0.0)
    alone = [pays for costs, pays in cheap if costs.resident_s == 0.0]
    assert alone and all(alone) and len(alone) < len(cheap)  # fast PCIe: copies pay, also as the only device work
    dear = run(1.0)
    assert {costs.resident_s == 0.0 for costs, _pays in dear} == {True, False}
    assert all(costs.launch_s == (1.0 if costs.resident_s == 0.0 else 0.0) for costs, _pays in dear)
    assert not any(pays for costs, pays in dear if costs.resident_s == 0.0)


def test_miss_slots_on_plain_numbers():
    # BALANCED: a 1 MB miss costs the CPU 1 ms, a copy 0.25 ms and the device 0.25 ms (a resident too). 8 experts,
    # top-2, 4 slots: 0 left to misses: 1 hit, 1 miss on the CPU = 1 ms; 1 left: 1.25 misses, a step of one hit and
    # one miss, copied (0.75 ms) three times in four, of two misses, one copied (1 ms), once: 0.8125 ms; 2 left:
    # 1.5 misses: 0.5 x 0.75 + 0.5 x 1 = 0.875 ms (two misses cost at least 1 ms whichever way)
    assert miss_slots(BALANCED, 1_000_000, 4, 8, 2) == 1
    # the steps of two misses have no resident routed: the node charges their copy the launch and merge (launch_s),
    # 1 ms here: 1 left costs 0.75 x 0.75 + 0.25 x 2 = 1.0625 ms, more than none left
    assert miss_slots(BALANCED, 1_000_000, 4, 8, 2, launch_s=1e-3) == 0
    # the CPU computing a token through an expert in 2 ms, not reading it in 1: 2 left costs 0.5 x 0.75 + 0.5 x 1
    # (both copied) = 0.875 ms, against 0.75 x 0.75 + 0.25 x 2 = 1.0625 for 1 left, 2 for none
    compute_bound = Bandwidths(pcie=4e9, hbm=4e9, cpu=1e9, cpu_flops=1e9)
    assert miss_slots(compute_bound, 1_000_000, 4, 8, 2) == 1
    assert miss_slots(compute_bound, 1_000_000, 4, 8, 2, flops_per_token=2e6) == 2
    assert miss_slots(SLOW_PCIE, 1_000_000, 4, 8, 2) == 0  # copies never pay: every slot holds a resident
    assert miss_slots(FAST_PCIE, 1_000_000, 4, 8, 2) == 2  # copies are free: enough slots for every miss, no more
    assert miss_slots(BALANCED, 1_000_000, 4, 8, 2, prepare_s=2e-3) == 0  # a copy's host time dearer than the CPU
    assert miss_slots(BALANCED, 1_000_000, 4, 8, 2, cpu_rate=0.25e9) == 2  # the kernels read slower: copies pay more
    assert miss_slots(BALANCED, 1_000_000, 0, 8, 2) == 0


def test_miss_slots_minimise_the_expected_step_of_random_cases():
    """Against a brute force: every split of the slots, every subset of a token's misses copied (worth), each step
    priced as the hybrid node prices it (decode_costs: its hits resident, the launch where there are none)."""
    rng = np.random.default_rng(11)
    for _ in range(150):
        experts = int(rng.integers(2, 17))
        top_k = int(rng.integers(1, min(experts, 6) + 1))
        slots = int(rng.integers(0, experts))
        bandwidths = Bandwidths(pcie=float(rng.uniform(1e9, 8e9)), hbm=float(rng.uniform(1e10, 1e12)),
                                cpu=float(rng.uniform(0.5e9, 8e9)), cpu_flops=1e9)
        prepare = float(rng.choice([0.0, rng.uniform(0, 5e-4)]))
        cpu_rate = float(rng.choice([np.nan, rng.uniform(0.2e9, 4e9)]))
        cpu_rate = None if np.isnan(cpu_rate) else cpu_rate
        reuse = float(rng.choice([np.nan, rng.uniform(0.0, 3.0)]))
        reuse = None if np.isnan(reuse) else reuse
        fixed = float(rng.choice([0.0, rng.uniform(0, 2e-3)]))
        launch = float(rng.choice([0.0, rng.uniform(0, 1e-3)]))
        flops = float(rng.choice([0.0, rng.uniform(0, 2e6)]))

        def expected(spare):
            misses = top_k - top_k * min(slots - spare, experts) / experts
            total = 0.0
            for count, share in ((int(misses), 1 - misses % 1), (int(misses) + 1, misses % 1)):
                if share > 0:
                    costs = decode_costs(bandwidths, 1_000_000, [1] * count, top_k - count, launch_s=launch,
                                         prepare_s=prepare, cpu_rate=cpu_rate, reuse=reuse, cpu_fixed_s=fixed,
                                         flops_per_token=flops)
                    total += share * min(costs.worth(np.array(c, dtype=np.int64))
                                         for size in range(min(count, spare) + 1)
                                         for c in itertools.combinations(range(count), size))
            return total

        times = [expected(spare) for spare in range(slots + 1)]
        chosen = miss_slots(bandwidths, 1_000_000, slots, experts, top_k, prepare_s=prepare, cpu_rate=cpu_rate,
                            reuse=reuse, cpu_fixed_s=fixed, flops_per_token=flops, launch_s=launch)
        assert times[chosen] == pytest.approx(min(times), rel=1e-9, abs=1e-15)
        assert all(t > times[chosen] * (1 - 1e-9) for t in times[:chosen])  # the fewest among equals


def test_the_engine_leaves_miss_slots_and_copies_misses_into_them(model_folder, cpu_run, slot_bytes, decisions):
    """Adaptive placement at half the experts with balanced bandwidths: the engine leaves the slots the cost model
    asks for empty, decode copies misses into them, and the outputs equal the all-CPU run."""
    model, _device = open_model(model_folder, BALANCED, device_expert_bytes=8 * 3 * slot_bytes)
    engine = model.offload
    info, store = engine.infos[0], engine.stores[0]
    expected = miss_slots(BALANCED, info.bytes_per_expert, 8, 16, 4, copy_bytes=store.expert_bytes,
                          read_bytes=store.read_bytes)
    assert expected > 0 and engine.policy.miss_slots == [expected] * 3
    assert [int(np.count_nonzero(layer.expert_in >= 0)) for layer in engine.slots] == [8 - expected] * 3
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = engine.stats.totals()
    assert totals.misses_copied > 0 and totals.misses_cpu > 0  # both the CPU and copies took misses


def test_the_engine_weighs_its_miss_slots_at_the_prices_its_steps_pay(model_folder, slot_bytes, monkeypatch):
    """The slot weighing priced each split without two things the hybrid node charges its steps: the CPU computing
    a token through an expert where that takes longer than reading it (flops_per_token), and the slots' launch and
    merge (the store's launch_s) where copies alone make a step's device part. Here a miss costs the CPU ~2.5 ms of
    compute (~1 ms of reading) and copies alone pay a 1 ms launch: the weighing left 2 of 6 slots to copies where the
    steps' own prices make 3 best (4 without the launch)."""
    monkeypatch.setattr(SimulatedSlots, "launch_s", 1e-3, raising=False)
    bandwidths = Bandwidths(pcie=50e6, hbm=400e6, cpu=16e6, cpu_flops=20e6)
    model, _device = open_model(model_folder, bandwidths, device_expert_bytes=6 * 3 * slot_bytes)
    engine = model.offload
    info, store = engine.infos[0], engine.stores[0]
    assert [layer.num_slots for layer in engine.slots] == [6] * 3

    def weighed(**node):
        return miss_slots(bandwidths, info.bytes_per_expert, 6, 16, 4, copy_bytes=store.expert_bytes,
                          read_bytes=store.read_bytes, **node)

    assert (weighed(), weighed(flops_per_token=info.flops_per_token)) == (2, 4)
    assert weighed(flops_per_token=info.flops_per_token, launch_s=1e-3) == 3
    assert engine.policy.miss_slots == [3] * 3


def test_with_the_weighing_off_placement_wants_every_slot_for_a_resident(model_folder, cpu_run, slot_bytes):
    """The benchmarks' switch weigh_miss_slots=False: from the next weighing (here the re-plan's) adaptive placement
    leaves no slot to copies and fills them all with residents; the outputs still equal the all-CPU run."""
    model, _device = open_model(model_folder, BALANCED, device_expert_bytes=8 * 3 * slot_bytes)
    engine = model.offload
    assert engine.policy.miss_slots[0] > 0  # the weighing leaves some, as in the test above
    engine.weigh_miss_slots = False
    engine.reconfigure(engine.config)
    assert engine.policy.miss_slots == [0] * 3
    assert [int(np.count_nonzero(layer.expert_in >= 0)) for layer in engine.slots] == [8] * 3
    assert_same_as_cpu(greedy_run(model), cpu_run)


def _decode_four_steps(model):
    state = model.new_state()
    logits = model.decoder.forward(state, model.tokenizer.encode("The expert offload engine must be exact."))
    model.offload.stats.reset(len(model.offload.slots))
    for _ in range(4):
        logits = model.decoder.forward(state, [int(logits[-1].argmax())])
    return model.offload.stats.totals()


def test_no_slot_and_no_streaming_slot_means_every_miss_on_the_cpu(model_folder, slot_bytes, decisions):
    model, _device = open_model(model_folder, FAST_PCIE, device_expert_bytes=0, device_working_bytes=slot_bytes - 1)
    totals = _decode_four_steps(model)
    assert totals.misses > 0 and totals.misses_cpu == totals.misses and totals.misses_copied == 0
    assert not decisions  # nothing to decide without a slot to copy into


def test_without_slots_the_streaming_slots_take_the_copies_the_policy_picks(model_folder, decisions):
    """A zero budget: the policy weighs each layer's misses against the top-k streaming slots, with no residents
    beside them, and the copies it picks are exactly the step's copied pairs."""
    model, _device = open_model(model_folder, FAST_PCIE, device_expert_bytes=0, device_working_bytes=1 << 30)
    totals = _decode_four_steps(model)
    assert decisions and all(spare == 4 for spare, _n, _d in decisions)  # SPEC's top-4: four streaming slots
    assert all(d.predicted_s <= d.all_cpu_s for _s, _n, d in decisions)
    decode = decisions[-4 * 3:]  # the four decode steps' three layers
    assert totals.miss_copies == sum(d.num_copied for _s, _n, d in decode) > 0
    assert totals.misses_cpu + totals.misses_copied == totals.misses


def test_wanted_residents_are_never_spare():
    layer = LayerSlots(8, 4)
    policy = make_policy("adaptive", [layer])
    for slot, expert in enumerate([0, 1, 2, 3]):
        layer.place(slot, expert)
    policy.scores[0][:] = [5, 4, 0.1, 3, 2, 0, 0, 0]  # top 4: experts 0, 1, 3, 4 -> 2 is not wanted
    assert policy.spare_slots(0, np.array([], np.int64)).tolist() == [2]
    assert policy.spare_slots(0, np.array([2])).tolist() == []  # routed this step: busy
    static_layer = LayerSlots(8, 4)
    static = make_policy("static", [static_layer])
    static_layer.place(0, 6)  # placed by the placement itself: wanted
    assert static.spare_slots(0, np.array([], np.int64)).tolist() == [1, 2, 3]
    static.admit(0, 1, 7)
    assert static.spare_slots(0, np.array([], np.int64)).tolist() == [2, 3, 1]  # empty first, then admitted
    assert static.spare_slots(0, np.array([7])).tolist() == [2, 3]


def test_cpu_execution_disabled_copies_every_miss(model_folder, cpu_run, slot_bytes, decisions):
    model, _device = open_model(model_folder, SLOW_PCIE, cpu_execution="disabled", device_expert_bytes=4 * 3 * slot_bytes)
    assert_same_as_cpu(greedy_run(model), cpu_run)
    totals = model.offload.stats.totals()
    assert totals.misses > 0 and totals.misses_copied == totals.misses and totals.misses_cpu == 0 and totals.cpu_s == 0
    assert not decisions  # no cost model: the mode says where misses run


# --- the pinned staging ring -----------------------------------------------------------------

def test_the_pinned_high_water_mark_stays_within_pinned_bytes(model_folder, cpu_run, per_expert, slot_bytes, staged):
    pinned = 3 * staged
    model, device = open_model(model_folder, FAST_PCIE, device_expert_bytes=6 * 3 * slot_bytes, pinned_bytes=pinned,
                               prefill_wave_experts=4)
    assert model.offload.wave_experts == 1  # 3 experts of ring: waves of one, double-buffered
    assert_same_as_cpu(greedy_run(model), cpu_run)
    ring = device.pinned
    assert ring.capacity == pinned and ring.copies > 0 and 0 < ring.high_water <= pinned
    info = model.offload.stats.as_dict()["pinned"]
    assert info["bytes"] == pinned and info["high_water"] == ring.high_water
    assert any("pinned staging ring" in line for line in model.offload.plan.statements)

    auto, auto_device = open_model(model_folder, Bandwidths(), device_expert_bytes=0, prefill_wave_experts=3)
    assert auto_device.pinned.capacity == 2 * 3 * staged and auto.offload.wave_experts == 3
    prompt = " ".join(["many tokens make the prompt long enough to stream experts"] * 6)
    auto.decoder.forward(auto.new_state(), auto.tokenizer.encode(prompt))
    assert auto_device.pinned.copies > 0
    assert auto_device.pinned.high_water == 3 * per_expert  # one wave in flight, half the double-buffered ring


def test_a_pinned_ring_that_holds_no_expert_is_refused(model_folder, staged):
    with pytest.raises(OffloadPlanError) as error:
        open_model(model_folder, FAST_PCIE, pinned_bytes=staged - 1)
    message = str(error.value)
    assert "session.moe.offload.pinned_bytes" in message and str(staged) in message and "\n" not in message
    model, device = open_model(model_folder, FAST_PCIE, pinned_bytes=staged)  # one expert is enough
    assert device.pinned.capacity == staged and model.offload.wave_experts == 1


def test_reconfigure_resizes_the_pinned_ring(model_folder, cpu_run, slot_bytes, staged):
    model, device = open_model(model_folder, FAST_PCIE, device_expert_bytes=4 * 3 * slot_bytes, prefill_wave_experts=2)
    assert device.pinned.capacity == 4 * staged
    model.offload.reconfigure(model.offload.config.updated(pinned_bytes=10 * staged, prefill_wave_experts=8))
    assert device.pinned.capacity == 10 * staged and model.offload.wave_experts == 5
    assert model.offload.stats.pinned["bytes"] == 10 * staged
    with pytest.raises(OffloadPlanError, match="pinned_bytes"):
        model.offload.reconfigure(model.offload.config.updated(pinned_bytes=100))
    assert device.pinned.capacity == 10 * staged and model.offload.config.pinned_bytes == 10 * staged
    assert_same_as_cpu(greedy_run(model), cpu_run)
    assert device.pinned.high_water <= 10 * staged
    model.offload.reconfigure(model.offload.config.updated(mode="disabled"))
    assert device.pinned is None
    model.offload.reconfigure(model.offload.config.updated(mode="auto", pinned_bytes=None))
    assert device.pinned.capacity == 2 * 8 * staged


# --- the CUDA device's ring logic, with a stand-in for CuPy (the GPU itself: tests/test_offload_cuda.py) ----

class _Event:
    def __init__(self):
        self.done = False

    def synchronize(self):
        self.done = True


class _Stream:
    def record(self):
        return _Event()


class _FakeCupy:
    class cuda:
        @staticmethod
        def alloc_pinned_memory(nbytes):
            return bytearray(nbytes)

    @staticmethod
    def get_default_pinned_memory_pool():
        return type("Pool", (), {"free_all_blocks": staticmethod(lambda: None)})()


def test_the_cuda_ring_waits_only_for_regions_it_reuses():
    from engine.offload.cuda_device import ALIGN, CudaPinnedRing

    ring = CudaPinnedRing(_FakeCupy, 4 * ALIGN)
    stream = _Stream()
    a = ring.take(100)
    assert a == (0, ALIGN)
    pinned = ring.view(a[0], np.arange(25, dtype=np.float32))
    assert np.shares_memory(pinned, ring.buffer) and pinned[24] == 24
    ring.issued(*a, stream)
    b = ring.take(2 * ALIGN - 10)
    ring.issued(*b, stream)
    first, second = ring._flight[0][2], ring._flight[1][2]
    assert b == (ALIGN, 3 * ALIGN) and ring.in_use == 3 * ALIGN and not first.done
    c = ring.take(2 * ALIGN)  # does not fit after b: wraps to 0 and waits for a and b
    assert c == (0, 2 * ALIGN) and first.done and second.done
    assert ring.in_use == 2 * ALIGN and ring.high_water == 3 * ALIGN <= ring.capacity
    ring.issued(*c, stream)
    with pytest.raises(Exception, match="cannot hold"):
        ring.take(5 * ALIGN)
    ring.close()
    assert ring.in_use == 0


def test_a_wave_gathered_into_the_ring_reads_like_the_model(model_folder):
    from engine.offload.cuda_device import CudaPinnedRing, gather_wave
    from kernels.gpu import layout

    model = LoadedModel.open(model_folder, offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    runner = model.offload.runners[0]
    spec, tensors = runner.info.spec, {k: v for k, v in runner.tensors.items() if v is not None}
    experts = np.array([3, 7, 9, 12])
    ring = CudaPinnedRing(_FakeCupy, 8 * runner.info.bytes_per_expert)
    wave, start, end = gather_wave(ring, tensors, experts, spec.num_experts)
    assert end - start <= 5 * runner.info.bytes_per_expert
    for lay in layout.make_layouts(spec, tensors):
        ours = layout.raw_sources(spec, wave, lay, np.arange(4), xp=np)
        theirs = layout.raw_sources(spec, tensors, lay, experts, xp=np)
        for a, b in zip(ours, theirs):
            assert (a is None and b is None) or np.array_equal(a, b)
    name = "fc1_experts_weights"
    assert np.shares_memory(layout._take(wave[name], np.arange(4)), ring.buffer)  # no pageable copy on the way
    assert np.shares_memory(layout._take(wave[name], np.arange(1, 3)), ring.buffer)
    assert np.array_equal(layout._take(wave[name], np.array([2, 0])), tensors[name][[9, 3]])


def test_routing_that_comes_back_to_copied_misses_is_measured_and_given_to_the_policy(model_folder, slot_bytes,
                                                                                       monkeypatch):
    """Decode routed (route patched) to one of four disjoint expert sets, each for two steps in a row, with copies
    always paying: a set's misses are copied at its first step and hit at its second, so the engine measures later
    hits on copies, and the miss policy's decisions from then on carry them."""
    original = hybrid_node.route
    step = {"n": 0}

    def two_steps_per_set(logits, spec, router_weights=None):
        ids, weights = original(logits, spec, router_weights)
        if ids.shape[0] > 1:  # the prompt: routed as the model routes
            return ids, weights
        first = (step["n"] // (2 * len(model.offload.infos))) % 4 * spec.k
        step["n"] += 1
        return np.arange(first, first + spec.k, dtype=ids.dtype).reshape(ids.shape), weights

    offered = []

    def recording(*args, **kwargs):
        offered.append(kwargs.get("reuse"))
        return decode_costs(*args, **kwargs)

    monkeypatch.setattr(hybrid_node, "route", two_steps_per_set)
    monkeypatch.setattr(hybrid_node, "decode_costs", recording)
    model, _device = open_model(model_folder, FAST_PCIE, device_expert_bytes=8 * 3 * slot_bytes)
    greedy_run(model, steps=16)
    reuse = model.offload.copy_reuse
    totals = model.offload.stats.totals()
    assert totals.misses_copied > 0 and totals.hits > 0

    assert reuse.value is not None and reuse.value > 0.25, reuse.value
    assert offered[0] is None and offered[-1] == pytest.approx(reuse.value, rel=0.5)
    # records and --json carry the same state
    summary = model.offload.stats_dict()
    assert summary["later_hits_per_copy"] == reuse.value
    assert summary["miss_slots"] == model.offload.policy.miss_slots and summary["misses_copied"] == totals.misses_copied


def test_a_kept_cpu_cost_fit_follows_what_later_calls_of_one_size_cost():
    # a line from calls of 1-8 experts (the CPU path's calls); then calls of four experts only (decode path "both"),
    # each 60 µs cheaper than that line says: the slope stays, the fixed cost moves so that the line passes through
    # them, and a call of three experts is priced by the slope from there
    expert = 2_500_000
    rate = CpuRate()
    for n in [1, 8, 3, 6, 2, 7, 4, 5] * 2:
        rate.observe(n * expert, 150e-6 + n * expert / 90e9)
    assert rate.fixed_s == pytest.approx(150e-6, rel=1e-6)
    for _ in range(400):
        rate.observe(4 * expert, 90e-6 + 4 * expert / 90e9)
    assert rate._line() is None
    assert rate.value == pytest.approx(90e9, rel=1e-6) and rate.fixed_s == pytest.approx(90e-6, rel=1e-3)
    cheap = CpuRate()  # calls far below the line: a fixed cost of 0, not less
    for n in [1, 8, 3, 6, 2, 7, 4, 5] * 2:
        cheap.observe(n * expert, 150e-6 + n * expert / 90e9)
    assert cheap.fixed_s > 0  # (the line is fitted when read)
    for _ in range(400):
        cheap.observe(4 * expert, 0.5 * 4 * expert / 90e9)
    assert cheap.fixed_s == 0.0 and cheap.value == pytest.approx(90e9, rel=1e-6)


# The H100 host's Qwen3-30B-A3B-like "both" parts at 50% resident (seventy-first session): calls of three and five
# experts (bytes spread just past min_spread) at ~322 µs whatever their bytes, a line of 1301 GB/s + 322 µs a call
# beside ~120 GB/s of streaming read
FLAT_EXPERT = 2_500_000
FLAT_CALLS = [(n * FLAT_EXPERT, 322e-6 + n * FLAT_EXPERT / 1301e9) for n in [3, 5] * 10]


def line_calls(per_s: float, fixed_s: float) -> list[tuple[int, float]]:
    """Calls of one to eight experts, twice over, each on the line fixed_s + bytes / per_s."""
    return [(n * FLAT_EXPERT, fixed_s + n * FLAT_EXPERT / per_s) for n in [1, 8, 3, 6, 2, 7, 4, 5] * 2]


def observed(rate: CpuRate, calls) -> CpuRate:
    for nbytes, seconds in calls:
        rate.observe(nbytes, seconds)
    return rate


def test_a_cpu_cost_line_faster_than_the_ceiling_is_refused():
    # no ceiling (and no bound on the fixed cost's share of a call, which refuses it too): the line the engine reported
    free = observed(CpuRate(max_fixed_share=1.0), FLAT_CALLS)
    assert (free.value, free.fixed_s) == (pytest.approx(1301e9, rel=1e-6), pytest.approx(322e-6, rel=1e-6))
    # a ceiling of twice the streaming read: the line is refused, the calls price misses at their average rate
    capped = observed(CpuRate(ceiling=240e9, max_fixed_share=1.0), FLAT_CALLS)
    assert capped._line() is None and capped.fixed_s == 0.0
    assert capped.value == capped.average == pytest.approx(free.average) and 25e9 < capped.value < 35e9
    # a line fitted before (the CPU path's calls of 1-8 experts, ~110 µs + bytes / 100 GB/s) keeps its slope through
    # the flat calls, its fixed cost through their weighted mean (~10 MB in ~329.7 µs: ~230 µs at 100 GB/s)
    kept = observed(CpuRate(ceiling=240e9), line_calls(100e9, 110e-6))
    assert kept.value == pytest.approx(100e9, rel=1e-6)
    observed(kept, FLAT_CALLS * 20)  # the older calls decay away
    assert kept._line() is None
    assert (kept.value, kept.fixed_s) == (pytest.approx(100e9, rel=1e-6), pytest.approx(230e-6, rel=3e-3))
    # sane lines below the ceiling still fit, cache-hot ones faster than the streaming read included; just past it: not
    def line(per_s: float) -> CpuRate:
        return observed(CpuRate(ceiling=240e9), line_calls(per_s, 150e-6))
    for per_s in (66e9, 200e9):
        assert (line(per_s).value, line(per_s).fixed_s) == (pytest.approx(per_s, rel=1e-6), pytest.approx(150e-6))
    past = line(250e9)
    assert past.value == past.average and past.fixed_s == 0.0


def scattered_calls(scatter_s: float) -> list[tuple[int, float]]:
    """Calls of two and four experts on the line 150 GB/s + 100 µs, each `scatter_s` above or below it in turn."""
    return [(n * FLAT_EXPERT, 100e-6 + n * FLAT_EXPERT / 150e9 + scatter_s * (1, -1, -1, 1)[i // 2 % 4])
            for i, n in enumerate([2, 4] * 20)]


def test_a_cpu_cost_line_that_explains_the_calls_poorly_is_refused():
    # calls 50 µs off the line either way, against 33 µs between the two sizes' own: the line explains ~10% of how
    # their times vary (R²), its slope is noise however close it came here
    noisy = scattered_calls(50e-6)
    free = observed(CpuRate(ceiling=240e9, min_r2=0.0), noisy)
    assert (free.value, free.fixed_s) == (pytest.approx(150e9, rel=1e-3), pytest.approx(100e-6, rel=1e-3))
    refused = observed(CpuRate(ceiling=240e9), noisy)
    assert refused._line() is None and refused.fixed_s == 0.0 and refused.value == refused.average
    # a kept line's slope stays through them, as through calls that give no line
    kept = observed(CpuRate(ceiling=240e9), line_calls(100e9, 110e-6))
    assert kept.value == pytest.approx(100e9, rel=1e-6)
    observed(kept, noisy * 10)
    assert kept._line() is None and kept.value == pytest.approx(100e9, rel=1e-6)
    # 10 µs off (R² ~0.74): the line
    steady = observed(CpuRate(ceiling=240e9), scattered_calls(10e-6))
    assert (steady.value, steady.fixed_s) == (pytest.approx(150e9, rel=1e-3), pytest.approx(100e-6, rel=1e-3))


def test_a_cpu_cost_line_whose_fixed_cost_takes_most_of_a_call_is_refused():
    # calls of three and five experts on 239 GB/s + 288 µs (the H100 host's, seventy-first session): under the ceiling
    # and on the line exactly, but 87% of the mean call is its fixed cost
    flat = [(n * FLAT_EXPERT, 288e-6 + n * FLAT_EXPERT / 239e9) for n in [3, 5] * 10]
    free = observed(CpuRate(ceiling=240e9, max_fixed_share=1.0), flat)
    assert (free.value, free.fixed_s) == (pytest.approx(239e9, rel=1e-6), pytest.approx(288e-6, rel=1e-6))
    refused = observed(CpuRate(ceiling=240e9), flat)
    assert refused._line() is None and refused.fixed_s == 0.0 and refused.value == refused.average
    # the same calls with their bytes read at 66 GB/s: the fixed cost is 66% of the mean call, the line stands
    slower = observed(CpuRate(ceiling=240e9), [(n * FLAT_EXPERT, 288e-6 + n * FLAT_EXPERT / 66e9) for n in [3, 5] * 10])
    assert (slower.value, slower.fixed_s) == (pytest.approx(66e9, rel=1e-6), pytest.approx(288e-6, rel=1e-6))


def test_a_cpu_cost_line_mostly_of_fixed_cost_is_kept_where_its_slope_reads_no_faster_than_the_stream():
    # the H200 Xeon's 180 µs + 66 GB/s (98 GB/s streaming) with the fixture models' 32 KiB experts, calls of one and
    # two: 99% of the mean call is fixed cost. Refused, the average priced a miss at ~0.26 GB/s, a share of a whole
    # call, where one more miss costs 0.5 µs
    tiny = [(n * 32256, 180e-6 + n * 32256 / 66e9) for n in [1, 2] * 10]
    refused = observed(CpuRate(ceiling=196e9), tiny)  # the stream not known: the share bound alone
    assert refused._line() is None and refused.fixed_s == 0.0 and refused.value == pytest.approx(0.26e9, rel=0.01)
    kept = observed(CpuRate(ceiling=196e9, stream=98e9), tiny)
    assert (kept.value, kept.fixed_s) == (pytest.approx(66e9, rel=1e-6), pytest.approx(180e-6, rel=1e-6))
    # the H100 host's 239 GB/s + 288 µs (87% fixed) reads faster than its ~120 GB/s stream: refused still
    flat = [(n * FLAT_EXPERT, 288e-6 + n * FLAT_EXPERT / 239e9) for n in [3, 5] * 10]
    assert observed(CpuRate(ceiling=240e9, stream=120e9), flat)._line() is None


def test_a_cpu_cost_line_through_a_slightly_negative_fixed_cost_is_fitted_through_the_origin():
    # calls of one to eight experts at 68 GB/s and no fixed cost, 2 µs less each (noise): the line's fixed cost is
    # -2 µs; taken as 0, the slope through the origin prices a miss within 1% of 68 GB/s, where the calls' average
    # rate is 2.5% off
    rate = observed(CpuRate(ceiling=240e9), line_calls(68e9, -2e-6))
    assert rate._line() is not None and rate.fixed_s == 0.0 and rate.value == pytest.approx(68e9, rel=0.01)
    assert rate.average == pytest.approx(68e9 * 1.025, rel=3e-3)


def test_a_cpu_cost_line_held_to_the_stream_passes_through_the_calls_means():
    # calls of one to eight experts (2.5 MB each) on 150 GB/s + 100 µs, unweighted (fit_keep 1): 11.25 MB in 175 µs on
    # average. Held to a 100 GB/s stream the line through that mean costs 175 - 112.5 = 62.5 µs a call; the fitted
    # line's 100 µs beside the stream's slope priced the mean call at 212.5 µs
    rate = observed(CpuRate(fit_keep=1.0, ceiling=200e9, stream=100e9), line_calls(150e9, 100e-6))
    assert (rate.value, rate.fixed_s) == (pytest.approx(150e9, rel=1e-9), pytest.approx(100e-6, rel=1e-9))
    assert rate.priced(100e9) == (pytest.approx(100e9, rel=1e-9), pytest.approx(62.5e-6, rel=1e-9))
    assert rate.priced(200e9) == (rate.value, rate.fixed_s)  # a stream the slope does not pass: the line as fitted
    # 400 GB/s + 2 µs held to 40 GB/s: the mean less its bytes at 40 GB/s is below 0, so the line goes through the
    # origin, whose slope (400 GB/s less a little) is held to the stream too
    fast = observed(CpuRate(fit_keep=1.0), line_calls(400e9, 2e-6))
    assert fast.priced(40e9) == (pytest.approx(40e9, rel=1e-9), 0.0)
    # the held line checked as a fitted one: 150 GB/s + 100 µs held to 10 GB/s is through the origin (the mean,
    # 175 µs, is below 11.25 MB at 10 GB/s) and prices every call ~6x over, explaining none of how their times vary:
    # refused, the average rate held to the stream
    assert rate.priced(10e9) == (10e9, 0.0)
    # a kept slope through later calls of one size (no line of their own): held to the stream as _through_recent
    # makes it, through their mean (four experts, 10 MB in 166.7 µs: 66.7 µs at 100 GB/s)
    kept = observed(CpuRate(ceiling=200e9, stream=100e9), line_calls(150e9, 100e-6))
    assert kept.value == pytest.approx(150e9, rel=1e-6)
    observed(kept, [(4 * FLAT_EXPERT, 100e-6 + 4 * FLAT_EXPERT / 150e9)] * 400)
    assert kept._line() is None and kept.value == pytest.approx(150e9, rel=1e-6)
    assert kept.priced(100e9) == (pytest.approx(100e9, rel=1e-9), pytest.approx(66.67e-6, rel=1e-3))
    assert CpuRate().priced(100e9) == (None, 0.0)


def test_a_cpu_cost_line_held_to_the_stream_is_made_once_until_calls_come(monkeypatch):
    # priced() runs at every layer whose misses the policy prices (HybridExpertNode._miss_costs): the held line was
    # made again from the sums (_checked, _through_recent: float work and an R²) at each of those calls
    calls = line_calls(150e9, 100e-6)
    later = [(4 * FLAT_EXPERT, 100e-6 + 4 * FLAT_EXPERT / 150e9)] * 400  # of one size: the slope kept through them

    def priced_once(stream: float, then=()) -> tuple:
        """The price of a rate that makes its held line fresh: the same calls (fitted after the first), priced once."""
        fresh = observed(CpuRate(ceiling=200e9, stream=100e9), calls)
        assert fresh.value == pytest.approx(150e9, rel=1e-6)
        return observed(fresh, then).priced(stream)

    fresh = [priced_once(100e9), priced_once(80e9), priced_once(80e9, later)]
    assert fresh[2][1] == pytest.approx(100e-6 + 10e6 / 150e9 - 10e6 / 80e9, rel=1e-3)  # through the later calls
    made = []
    for name in ("_checked", "_through_recent"):
        monkeypatch.setattr(CpuRate, name, lambda self, *args, method=getattr(CpuRate, name), name=name: (
            made.append(name), method(self, *args))[1])
    rate = observed(CpuRate(ceiling=200e9, stream=100e9), calls)
    rate.value  # the fit (its own _checked)
    made.clear()
    assert [rate.priced(100e9) for _ in range(6)] == [fresh[0]] * 6 and made == ["_checked"]
    assert [rate.priced(80e9) for _ in range(6)] == [fresh[1]] * 6 and made == ["_checked"] * 2  # a stream change
    observed(rate, later)
    made.clear()
    assert [rate.priced(80e9) for _ in range(6)] == [fresh[2]] * 6
    assert made == ["_through_recent"] * 2  # the kept line through the later calls, and the held one once


def test_the_words_for_a_cpu_rate_say_a_slow_one_in_mb_per_s():
    # a host pricing a miss at 0.3 GB/s (a busy CPU's calls, each mostly its fixed cost) read "0 GB/s", as if free
    assert cpu_rate_words(0.3e9, 0.3e9, 17.3e-3, 17.3e-3) == "300 MB/s + 17300 µs a call"
    assert cpu_rate_words(0.45e9, 0.45e9, 0.0, 0.0, decimals=1) == "450.0 MB/s + 0 µs a call"
    assert cpu_rate_words(85e9, 85e9, 129e-6, 129e-6) == "85 GB/s + 129 µs a call"
    assert cpu_rate_words(0.04e9, 400e9, 0.0, 2e-6) == \
        "40 MB/s + 0 µs a call (measured 400 GB/s + 2 µs a call, its rate clamped to the stream)"


def test_the_words_for_a_cpu_rate_held_to_the_stream_say_the_measured_line_and_the_priced_one():
    # 60 GB/s + 100 µs held to a 40 GB/s stream prices a call at 6 µs (through the calls' mean): the report said
    # "40 GB/s + 6 µs a call (measured 60, clamped to the stream)", the measured rate beside the fixed cost in force,
    # a line of 60 GB/s + 6 µs that nobody measured nor priced
    assert cpu_rate_words(40e9, 60e9, 6.25e-6, 100e-6) == \
        "40 GB/s + 6 µs a call (measured 60 GB/s + 100 µs a call, its rate clamped to the stream)"
    assert cpu_rate_words(40e9, 60e9, 6.25e-6, 100e-6, decimals=1) == \
        "40.0 GB/s + 6 µs a call (measured 60.0 GB/s + 100 µs a call, its rate clamped to the stream)"


def test_a_cpu_rates_slow_first_calls_are_left_out_of_its_fit():
    # the Xeon's 180 µs + 66 GB/s with 2.96 MB experts, calls of one to eight experts (225-539 µs), the first taking
    # 90 ms (a kernel's first compile): its time's variance left the line under min_r2 for 477 calls, the average rate
    # (~32 GB/s, no fixed cost) pricing misses meanwhile. Left out (over 10x the first eight calls' median, 427 µs),
    # the line is the calls' own from the eighth call on; observe_many() alike
    expert = 2_960_000
    calls = [(n * expert, 180e-6 + n * expert / 66e9) for n in [1, 8, 3, 6, 2, 7, 4, 5] * 2]
    slow = [(calls[0][0], 90e-3)] + calls[1:]
    one, many = observed(CpuRate(), slow), CpuRate()
    many.observe_many(slow)
    for rate in (one, many):
        assert (rate.value, rate.fixed_s) == (pytest.approx(66e9, rel=1e-9), pytest.approx(180e-6, rel=1e-9))
    assert observed(CpuRate(), slow[:8]).value == pytest.approx(66e9, rel=1e-9)  # (the first eight calls: seven)
    # a call later than the first eight is counted however slow (a slowdown that lasts must move the rate)
    late = observed(CpuRate(), calls + [(calls[0][0], 90e-3)])
    assert late._line() is None and late.value == late.average
    # a steady host's first calls within 10x their median all count: seven of one expert at no fixed cost and one of
    # eight (8x the median), the line through them all
    steady = [(expert, expert / 66e9)] * 7 + [(8 * expert, 8 * expert / 66e9)] + calls[:8]
    rate = observed(CpuRate(max_fixed_share=1.0), steady)
    assert rate._sums[0] == pytest.approx(sum(0.98 ** age for age in range(16)), rel=1e-12)


def test_the_average_cpu_rate_is_bounded_by_the_ceiling():
    # calls of eight experts at 37 GB/s (no spread: no line), then one timed at 1 µs (20 MB: 20 TB/s) counts as a
    # call at the ceiling, observe() and observe_many() alike
    calls = [(8 * FLAT_EXPERT, 8 * FLAT_EXPERT / 37e9)] * 5 + [(8 * FLAT_EXPERT, 1e-6)]
    one, many = observed(CpuRate(ceiling=240e9), calls), CpuRate(ceiling=240e9)
    many.observe_many(calls)
    for rate in (one, many):
        assert rate.fixed_s == 0.0 and rate.value == pytest.approx(0.9 * 37e9 + 0.1 * 240e9)
    # every call faster than the ceiling: the ceiling
    assert observed(CpuRate(ceiling=240e9), [(FLAT_EXPERT, 1e-6)] * 3).value == pytest.approx(240e9)
    assert observed(CpuRate(), calls).value == pytest.approx(0.9 * 37e9 + 0.1 * 20e12)  # no ceiling: no bound


def test_the_engine_sets_no_cpu_rate_ceiling_on_the_simulated_device(model_folder):
    # its bandwidths are assumed (here 1 MB/s of CPU), its CPU kernels' calls this machine's: the fit as without one
    model, _device = open_model(model_folder, FAST_PCIE, measure_cpu_rate=True)
    for rate in (model.offload.cpu_rate, model.offload.split_rate):
        observed(rate, line_calls(100e9, 110e-6))
        assert rate.value == pytest.approx(100e9, rel=1e-6)


def test_a_cpu_cost_fit_stays_while_later_calls_of_one_size_give_none():
    # calls of 1-8 experts give the line (~180 µs + bytes / 66 GB/s); then calls of one expert each, as under
    # real-like routing with most experts resident, give none: the line stays, not the average rate, which would
    # price one expert's miss at a whole call (2.96 MB in 225 µs: 13 GB/s)
    expert = 2_960_000
    rate = CpuRate()
    for n in [1, 8, 3, 6, 2, 7, 4, 5] * 2:
        rate.observe(n * expert, 180e-6 + n * expert / 66e9)
    fitted = (rate.value, rate.fixed_s)
    assert fitted == (pytest.approx(66e9, rel=1e-6), pytest.approx(180e-6, rel=1e-6))
    for _ in range(400):  # the older calls decay away: no spread left among the calls the sums hold
        rate.observe(expert, 180e-6 + expert / 66e9)
    assert rate._line() is None and rate.average == pytest.approx(expert / (180e-6 + expert / 66e9))
    assert (rate.value, rate.fixed_s) == (pytest.approx(fitted[0], rel=1e-9), pytest.approx(fitted[1], rel=1e-6))
    rate.keep_fit = False  # the switch the A/B sets (bench_offload_ab --b rate.keep_fit=0): the average rate alone
    rate.observe(expert, 180e-6 + expert / 66e9)
    assert rate.fixed_s == 0.0 and rate.value == pytest.approx(rate.average)
    # calls of many sizes again: a new line
    rate.keep_fit = True
    for n in [1, 8, 2, 6] * 100:
        rate.observe(n * expert, 100e-6 + n * expert / 80e9)
    assert rate.value == pytest.approx(80e9, rel=0.05) and rate.fixed_s == pytest.approx(100e-6, rel=0.1)


def first_step_replay(layers: int, cold_bytes_per_s: float, steps: int = 12) -> list[tuple[int, float, int]]:
    """(bytes, seconds, layer) of `steps` decode steps' CPU calls, one a layer, on the H200 Xeon's line (180 µs +
    bytes / 66 GB/s, 2.96 MB experts, one to eight a call, 5% noise), the first step's each slower by its bytes read at
    `cold_bytes_per_s` more (its pages cold: minor faults)."""
    rng = np.random.default_rng(4)
    calls = []
    for step in range(steps):
        for layer in range(layers):
            nbytes = int(rng.integers(1, 9)) * 2_960_000
            seconds = (180e-6 + nbytes / 66e9) * rng.normal(1.0, 0.05)
            calls.append((nbytes, seconds + (nbytes / cold_bytes_per_s if step == 0 else 0.0), layer))
    return calls


def priced_cost_error(calls, layers: int, by_layer: bool) -> list[float]:
    """Per decode step after the first: the mean relative error of each call's price (the rate in force before the
    call, CpuRate.priced at a 98 GB/s stream; the stream where none is measured, as cpu_bytes_per_s) against the
    steady line's cost of its bytes."""
    rate, errors = CpuRate(ceiling=196e9, stream=98e9), []
    for index, (nbytes, seconds, layer) in enumerate(calls):
        if index >= layers:
            per_s, fixed_s = rate.priced(98e9)
            per_s = 98e9 if per_s is None else per_s
            steady = 180e-6 + nbytes / 66e9
            errors.append(abs(fixed_s + nbytes / per_s - steady) / steady)
        rate.observe(nbytes, seconds, layer if by_layer else None)
    return [float(np.mean(errors[start:start + layers])) for start in range(0, len(errors), layers)]


def test_a_cpu_rate_leaves_out_each_layers_first_call():
    # a first decode step slow across all 48 layers (cold pages: bytes at 5 GB/s more): the warm-up window, the first
    # eight calls, held none of the forty slow calls after it, and the fit priced the next six steps' calls ~5x over;
    # each layer's first call left out, the next step's calls are priced within 17% (the stream, then the average
    # until eight calls came), the later ones' within 2%, the line the steady calls' own
    calls = first_step_replay(48, 5e9)
    before, after = priced_cost_error(calls, 48, False), priced_cost_error(calls, 48, True)
    assert min(before[:6]) > 4.0 and before[-1] < 0.02
    assert after[0] < 0.17 and max(after[1:]) < 0.02


def test_a_cpu_rates_warm_up_window_leaves_out_calls_slow_against_its_fastest():
    # four layers whose first two steps took 5 ms a call (the first step's left out by layer): the window is the
    # second step's four slow calls and the third's four steady ones, whose median, a slow call's, left none out and
    # priced calls 12-93% off through forty steps; against the window's fastest, the steady calls' own line from the
    # fourth step
    calls = [(nbytes, 5e-3 if index < 8 else seconds, layer)
             for index, (nbytes, seconds, layer) in enumerate(first_step_replay(4, 5e9, steps=40))]
    errors = priced_cost_error(calls, 4, True)
    assert max(errors[2:]) < 0.03


def test_a_cpu_rates_lines_follow_settings_changed_after_a_read():
    # calls of 1-8 experts on 100 GB/s + 110 µs, then calls 10 µs off 150 GB/s + 100 µs either way, read once; each
    # setting changed then (bench_offload_ab's rate.NAME switches set them on a running rate) and read again: what a
    # fresh rate with that setting fed the same calls reads, where the lines made were kept until the next call, and
    # the sums and the average kept the old fit_keep's weights and ceiling's clamp (90 GB/s: the 98 GB/s line refused;
    # 50 GB/s: the 10 MB calls' ~60 GB/s clamped too)
    calls = line_calls(100e9, 110e-6) + scattered_calls(10e-6)

    def read(rate: CpuRate) -> tuple:
        return rate.value, rate.fixed_s, *rate.priced(100e9), rate.average

    settings = {"ceiling": 240e9, "stream": 120e9}
    for name, value in (("fit_keep", 0.9), ("ceiling", 50e9), ("ceiling", 90e9), ("min_r2", 0.95), ("keep", 0.5)):
        rate = observed(CpuRate(**settings), calls)
        before = read(rate)
        setattr(rate, name, value)
        fresh = read(observed(CpuRate(**{**settings, name: value}), calls))
        assert read(rate) == fresh and fresh != pytest.approx(before, rel=1e-3), name
