"""SwapJudge (engine/offload/swap_judge.py): adaptive placement stops swapping where its swaps earn no hits (uniform
routing) and keeps every swap where they do (routing with recency), and takes swaps up again when routing turns
predictable; the net hits it counts, against their definition."""

from __future__ import annotations

import numpy as np
import pytest

from engine.offload.placement import AdaptivePlacement, LayerSlots, make_policy
from engine.offload.swap_judge import SwapJudge
from engine.offload.traces import realistic_trace, replay, uniform_trace


def _judged(judges: list):
    """make_policy's adaptive placement (judged), its judge appended to `judges`: for traces.replay."""
    def make(layers):
        policy = make_policy("adaptive", layers)
        judges.append(policy.judge)
        return policy
    return make


def test_net_hits_are_the_loaded_experts_hits_less_the_evicted_ones_within_the_window():
    layers = [LayerSlots(8, 2), LayerSlots(8, 2)]
    judge = SwapJudge([8, 8], window=3, evidence=0.0)
    policy = AdaptivePlacement(layers, judge=judge)
    judge.safe_point([[0, 0, 5, 3], [1, 1, -1, 4]])  # (layer, slot, evicted, loaded): a fill is not watched
    assert judge.watch[0].tolist() == [0, 0, 0, 1, 0, -1, 0, 0] and not judge.watch[1].any()
    policy.observe(0, np.array([3, 3, 5, -1]))  # 3 twice (hits it earns), 5 once (a miss it causes)
    policy.observe(1, np.array([4, 5]))  # layer 1 watches nothing
    assert judge.step_net == 1.0
    judge.safe_point([])
    policy.observe(0, np.array([3, 1]))
    judge.safe_point([])
    judge.safe_point([])  # the swap's window (3 points) has ended: no longer watched
    assert not judge.watch[0].any()
    policy.observe(0, np.array([3, 3, 3]))
    assert judge.step_net == 0.0
    # decayed sums over the three points that followed the swap: net hits 1, 1, 0, a third of a window each
    keep = 1.0 - judge.memory
    net = (1.0 * keep + 1.0) * keep + 0.0
    windows = (1 / 3 * keep + 1 / 3) * keep + 1 / 3
    assert judge.net_hits_per_swap == pytest.approx(net / windows)


@pytest.mark.parametrize("experts, k, slots", [(32, 4, 8), (128, 8, 32)])
def test_under_uniform_routing_adaptive_placement_stops_swapping_at_no_cost_in_hits(experts, k, slots):
    """Uniform routing (random weights): a swap's loaded expert is no likelier to come back than the one it evicted.
    Judged, placement makes no swaps after its first steps, and hits as many pairs as a policy that never moves."""
    trace = uniform_trace(600, 4, experts, k, seed=3)
    judges = []
    hit, swaps = replay(_judged(judges), trace, experts, slots, warmup=100)
    unjudged_hit, unjudged_swaps = replay(lambda layers: AdaptivePlacement(layers), trace, experts, slots, warmup=100)
    static_hit, _ = replay(lambda layers: make_policy("static", layers), trace, experts, slots, warmup=100)
    assert judges[0].paused and abs(judges[0].net_hits_per_swap) < 0.5
    assert swaps == 0.0 and unjudged_swaps > 0.4
    assert hit == pytest.approx(slots / experts, abs=0.02) and abs(hit - static_hit) < 0.02


@pytest.mark.parametrize("experts, k, slots", [(32, 4, 8), (128, 8, 32)])
def test_with_recency_every_swap_is_still_made(experts, k, slots):
    """Routing with strong recency (anchors.md): swaps earn more than a hit each, so the judge never pauses and
    placement makes the very swaps it makes unjudged."""
    trace = realistic_trace(800, 4, experts, k, seed=5)
    judges = []
    assert replay(_judged(judges), trace, experts, slots) == replay(lambda layers: AdaptivePlacement(layers), trace,
                                                                    experts, slots)
    assert not judges[0].paused and judges[0].net_hits_per_swap > 1.5


def test_swaps_resume_when_routing_turns_predictable():
    """Uniform routing first (swaps pause), then routing with recency: the swaps placement would make are watched
    while paused, earn hits, and placement takes them up again."""
    experts, k, slots = 128, 8, 32
    trace = np.concatenate([uniform_trace(300, 2, experts, k, seed=1), realistic_trace(400, 2, experts, k, seed=2)])
    layers = [LayerSlots(experts, slots) for _ in range(2)]
    policy = make_policy("adaptive", layers)
    swaps_made, paused_at = [], []
    for step in range(trace.shape[0]):
        for layer in range(2):
            policy.observe(layer, trace[step, layer])
        swaps_made.append(len([swap for swap in policy.rebalance() if swap.evicted is not None]))
        paused_at.append(policy.judge.paused)
    assert all(paused_at[100:300]) and sum(swaps_made[100:300]) == 0
    assert not any(paused_at[400:]) and sum(swaps_made[400:]) > 50


def test_while_swaps_are_paused_a_miss_may_not_be_copied_over_a_resident():
    """A copied miss that evicts a resident is a swap for one step: while the judge pauses swaps, spare slots are the
    empty ones and those of earlier copies (as under static placement), not the weakest residents."""
    layer = LayerSlots(16, 6)
    policy = make_policy("adaptive", [layer])
    for slot, expert in enumerate([0, 1, 2, 3, 4]):  # slot 5 left empty
        layer.place(slot, expert)
    policy.scores[0][:] = np.arange(16, 0, -1)  # experts 0..4 the best: 3 and 4 below the wanted slots' bar
    policy.scores[0][[3, 4]] = 0.5
    policy.observe(0, np.array([-1]))  # (decays the scores, routes nothing)
    assert policy.spare_slots(0, np.array([], np.int64)).tolist() == [5, 3, 4]  # empty, then the weakest
    policy.admit(0, 5, 9)
    policy.judge.paused = True
    assert policy.spare_slots(0, np.array([], np.int64)).tolist() == [5]  # the copy's slot only
    assert policy.wanted(0).tolist() == [e in (0, 1, 2, 3, 4) for e in range(16)]
    policy.judge.paused = False  # weakest first: 3 and 4, then the copy (expert 9, below the bar as well)
    assert policy.spare_slots(0, np.array([], np.int64)).tolist() == [3, 4, 5]
