"""Placement swaps get a share of decode time (engine/offload/swap_allowance.py): the allowance's arithmetic,
and the engine on the simulated device with swaps made to cost far more than the steps earn."""

from __future__ import annotations

import pytest

from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.offload.swap_allowance import SwapAllowance
from engine.writer import WriterSpec, write_model
from tests.test_offload import greedy_run


def test_one_swap_until_one_was_measured():
    allowance = SwapAllowance()
    assert allowance.grant(0.001) == 1 and allowance.grant(10.0) == 1  # the cost is not known yet
    allowance.spent([])
    assert allowance.grant(0.001) == 1


def test_swaps_earn_a_share_of_step_time():
    allowance = SwapAllowance(share=0.1, burst=4)
    allowance.grant(0.010)  # 1 ms earned
    allowance.spent([0.005])  # a 5 ms swap: 4 ms in debt
    assert allowance.cost_s == 0.005
    assert [allowance.grant(0.010) for _ in range(4)] == [0, 0, 0, 0]  # 4 steps pay the debt back
    assert allowance.balance_s == pytest.approx(0.0, abs=1e-12)
    assert [allowance.grant(0.010) for _ in range(5)] == [0, 0, 0, 0, 1]  # 5 more earn one swap


def test_the_bank_holds_a_burst_or_one_long_step():
    cost = 2.0 ** -9  # binary fractions: the arithmetic below is exact
    allowance = SwapAllowance(share=0.125, burst=4)
    allowance.grant(0.0)
    allowance.spent([cost])  # one swap in debt
    assert allowance.grant(64.0) == 4095  # a long step (a prefill): its share, 8 s, less the debt
    allowance.spent([cost] * 10)
    assert allowance.grant(0.0) == 4  # what the long step left is not kept past the next safe point
    allowance.spent([cost] * 4)
    for _ in range(100):
        allowance.grant(0.0625)  # many short steps: the bank stops at BURST swaps' worth
    assert allowance.grant(0.0) == 4


def test_the_running_cost_follows_the_measured_swaps():
    allowance = SwapAllowance()
    allowance.spent([0.004, 0.008])
    assert allowance.cost_s == pytest.approx(0.006)
    zero = SwapAllowance()
    zero.spent([0.0])
    assert zero.grant(0.01) is None  # swaps that cost nothing measurable are not limited


SPEC = WriterSpec(layers=3, num_experts=16, top_k=4, hidden_size=128, inter_size=64, seed=23, dense_accuracy_level=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("swaps") / "m", SPEC)


def test_expensive_swaps_are_rationed_by_step_time(folder, monkeypatch):
    """Each swap made to cost 1 s of host time: after the first, the steps must earn 1 s / SHARE before the
    next (SHARE = 0.1: 10 s of steps), so a short run makes one; without the allowance (end_step without a step time) it makes many.
    The answer is the same either way."""
    budget = LoadedModel.open(folder).folder.experts[0].device_bytes_per_expert * 4 * SPEC.layers  # 4 of 16 slots
    config = OffloadConfig(placement="adaptive", device_expert_bytes=budget)

    def run(rationed: bool):
        model = LoadedModel.open(folder, offload=config, device=SimulatedDevice(1 << 30))
        engine = model.offload
        loaded = engine.stats.totals()
        filled = loaded.fills  # the slots filled at load (not rationed: no step waits on them)
        assert filled == sum(engine.policy.wanted_slots(i) for i in range(SPEC.layers))  # the miss slots left empty
        assert loaded.swaps == 0
        for store in engine.stores:
            load = store.load
            monkeypatch.setattr(store, "load", lambda slot, expert, load=load: (load(slot, expert), 1.0)[1])
        if not rationed:
            model.decoder.on_step_end = lambda step_s, tokens: engine.end_step(None)
        logits, tokens = greedy_run(model, steps=16)
        made = engine.stats.totals()  # placement's copies in the run, a fill of an empty slot as dear as a swap
        return tokens, made.swaps + made.fills - filled, engine.swap_allowance

    rationed_tokens, rationed_swaps, allowance = run(True)
    free_tokens, free_swaps, _ = run(False)
    assert rationed_tokens == free_tokens
    assert free_swaps > 3
    assert rationed_swaps == 1 and allowance.cost_s == 1.0 and allowance.balance_s < 0
