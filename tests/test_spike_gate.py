"""The split's slow-step gate (engine/offload/spike_gate.py): a short slowdown's "both" steps leave the CPU parts'
rate, and so the split's table, as they were; a lasting one moves them."""

import numpy as np
import pytest

from engine.offload.miss_policy import CpuRate
from engine.offload.spike_gate import SPIKE_STEPS, SpikeGate
from kernels.cold_split import cpu_take_table

EXPERT = 2_661_376  # a Qwen3-30B-A3B-like expert's bytes with its scales
K = 8


def step_calls(rng, slower: float = 1.0, most: int = 5) -> list[tuple[int, float]]:
    """One "both" step's CPU parts over 48 layers: 1 to `most` experts a call at 80 GB/s + 40 µs, ±10% noise."""
    experts = rng.integers(1, most + 1, size=48)
    return [(int(n) * EXPERT, slower * (40e-6 + n * EXPERT / 80e9) * rng.uniform(0.9, 1.1)) for n in experts]


def run(gate: SpikeGate, calls_per_step: list) -> None:
    for calls in calls_per_step:
        for nbytes, seconds in calls:
            gate.observe(nbytes, seconds)
        gate.end_step()


def table(rate: CpuRate) -> list[int]:
    """The split's table from `rate` against a tier read at 40 GB/s (OffloadEngine.cold_split_table's arithmetic)."""
    return cpu_take_table(K, EXPERT / rate.value, rate.fixed_s, EXPERT / 40e9).tolist()


def test_calls_wait_for_the_steps_end_and_steady_steps_count_as_a_plain_rate_would():
    rng = np.random.default_rng(0)
    steps = [step_calls(rng) for _ in range(6)]
    gated, plain = CpuRate(), CpuRate()
    gate = SpikeGate(gated)
    for nbytes, seconds in steps[0]:
        gate.observe(nbytes, seconds)
    assert gated.value is None  # nothing counted before the step ends
    gate.end_step()
    run(gate, steps[1:])
    for calls in steps:
        for nbytes, seconds in calls:
            plain.observe(nbytes, seconds)
    assert gated.value == pytest.approx(plain.value) and gated.fixed_s == pytest.approx(plain.fixed_s)
    assert gated.value == pytest.approx(80e9, rel=0.1) and gated.fixed_s == pytest.approx(40e-6, abs=15e-6)
    assert gate.left_out == 0


def test_a_short_slowdown_leaves_the_rate_and_the_table_as_they_were():
    """Two steps of CPU parts at 2.3x their time (the H200 run that collapsed the table) are left out, and the table
    made after them is the one made before; a plain rate's table gives the CPU fewer experts."""
    rng = np.random.default_rng(1)
    steady = [step_calls(rng) for _ in range(6)]
    slow = [step_calls(rng, slower=2.3) for _ in range(2)]
    after = step_calls(rng)
    gated, plain = CpuRate(), CpuRate()
    gate = SpikeGate(gated)
    run(gate, steady)
    before = table(gated)
    run(gate, slow + [after])
    for calls in steady:
        plain.observe_many(calls)
    assert table(plain) == before  # its table made then too: the line stays where later calls give none (too noisy)
    for calls in slow + [after]:
        plain.observe_many(calls)
    assert table(gated) == before and gate.left_out == 2
    assert gated.value == pytest.approx(80e9, rel=0.1)
    assert sum(table(plain)) < sum(before), (table(plain), before)


def test_a_lasting_slowdown_moves_the_rate_after_its_steps_in_a_row():
    rng = np.random.default_rng(2)
    gated = CpuRate()
    gate = SpikeGate(gated)
    run(gate, [step_calls(rng) for _ in range(6)])
    fast = gated.value
    run(gate, [step_calls(rng, slower=2.0) for _ in range(SPIKE_STEPS - 1)])
    assert gated.value == fast  # held so far
    run(gate, [step_calls(rng, slower=2.0)])
    assert gated.value == pytest.approx(fast / 2.0, rel=0.15) and gate.left_out == 0
    # and later steps at the slower speed count at once (the rate predicts them now)
    run(gate, [step_calls(rng, slower=2.0)])
    assert gated.value == pytest.approx(fast / 2.0, rel=0.15)


def test_faster_steps_count_at_once():
    rng = np.random.default_rng(3)
    gated = CpuRate()
    gate = SpikeGate(gated)
    run(gate, [step_calls(rng, slower=2.0) for _ in range(6)])
    slow = gated.value
    run(gate, [step_calls(rng) for _ in range(3)])
    assert gated.value > 1.6 * slow and gate.left_out == 0


def test_a_slow_step_between_steady_ones_is_held_then_dropped():
    rng = np.random.default_rng(4)
    gated = CpuRate()
    gate = SpikeGate(gated, ratio=1.5, steps=3)
    run(gate, [step_calls(rng) for _ in range(4)])
    run(gate, [step_calls(rng, slower=1.8)])
    assert gate._held and gate.left_out == 0
    run(gate, [step_calls(rng)])
    assert not gate._held and gate.left_out == 1
    # a step only a little slower than predicted (steady noise) counts
    run(gate, [step_calls(rng, slower=1.3)])
    assert not gate._held and gate.left_out == 1


@pytest.mark.parametrize("fit", [True, False])
def test_a_steps_calls_reach_the_rate_as_one_call_at_a_time_would_leave_it(fit):
    """CpuRate.observe_many (the gate's hand-over at a step's end) against observe() call by call, on random calls
    with a few that observe() skips (no bytes, no time), from an empty rate and from one with a fitted line."""
    rng = np.random.default_rng(4)
    for start in (0, 30):
        one, many = CpuRate(fit=fit), CpuRate(fit=fit)
        for _ in range(start):
            nbytes, seconds = int(rng.integers(1, 8)) << 20, float(rng.uniform(1e-4, 1e-3))
            one.observe(nbytes, seconds)
            many.observe(nbytes, seconds)
        calls = [(int(rng.integers(1, 8)) << 20, float(rng.uniform(1e-4, 1e-3))) for _ in range(48)]
        calls[5], calls[17] = (0, 1e-4), (1 << 20, 0.0)
        for nbytes, seconds in calls:
            one.observe(nbytes, seconds)
        many.observe_many(calls)
        assert many._calls == one._calls == start + 46
        assert many._sums == pytest.approx(one._sums, rel=1e-12)
        assert many.average == pytest.approx(one.average, rel=1e-12)
        assert (many.value, many.fixed_s) == pytest.approx((one.value, one.fixed_s), rel=1e-9)
    empty = CpuRate()
    empty.observe_many([(0, 1.0)])
    assert empty.value is None and empty._calls == 0
