"""The placement policies' compiled bookkeeping (observe, spare_slots, rebalance: engine/offload/placement.py, issue #4)
against the straightforward NumPy implementation they replaced, on random routing traces: the same scores, the
same spare slots and the same swaps, step by step."""

from __future__ import annotations

import numpy as np
import pytest

from engine.offload.placement import (OPENING_PAIRS_PER_EXPERT, AdaptivePlacement, LayerSlots, StaticPlacement, Swap,
                                      make_policy)
from engine.offload.traces import realistic_trace, uniform_trace


class Reference:
    """The NumPy formulation (placement.py before the compiled kernels), on its own LayerSlots."""

    def __init__(self, layers, adaptive, decay=0.9, margin=1.5, max_swaps=2):
        self.layers, self.adaptive = layers, adaptive
        self.decay, self.margin, self.max_swaps = decay, margin, max_swaps
        self.scores = [np.zeros(layer.num_experts) for layer in layers]
        self.miss_slots = [0] * len(layers)
        self.admitted = [np.zeros(layer.num_experts, bool) for layer in layers]
        self.turn = 0
        self.counted = [0] * len(layers)  # static: routed pairs seen, and the experts chosen once enough were
        self.chosen = [None] * len(layers)

    def observe(self, layer, expert_ids):
        scores = self.scores[layer]
        if self.adaptive:
            scores *= self.decay
        np.add.at(scores, expert_ids[expert_ids >= 0], 1.0)
        self.counted[layer] += int(np.count_nonzero(expert_ids >= 0))

    def wanted(self, layer):
        slots, scores = self.layers[layer], self.scores[layer]
        if not self.adaptive:
            return (slots.slot_of >= 0) & ~self.admitted[layer]
        wanted = max(0, slots.num_slots - self.miss_slots[layer])
        if wanted == 0:
            return np.zeros(slots.num_experts, bool)
        if wanted >= slots.num_experts:
            return slots.slot_of >= 0
        bar = np.partition(scores, scores.size - wanted)[scores.size - wanted]
        return (slots.slot_of >= 0) & (scores >= bar) & (scores > 0)

    def spare_slots(self, layer, busy):
        slots = self.layers[layer]
        occupant = slots.expert_in
        free = ~self.wanted(layer)
        if busy.size:
            free[busy] = False
        occupied = occupant >= 0
        safe = occupied & free[occupant]
        empty = np.flatnonzero(~occupied)
        spare = np.flatnonzero(safe)
        if spare.size > 1:
            spare = spare[np.argsort(self.scores[layer][occupant[spare]], kind="stable")]
        return np.concatenate([empty, spare]).astype(np.int64)

    def admit(self, layer, slot, expert):
        evicted = self.layers[layer].place(slot, expert)
        if evicted is not None:
            self.admitted[layer][evicted] = False
        self.admitted[layer][expert] = True

    def rebalance(self, limit=None):
        """Under a limit: at most that many swaps in all, layers in turn from a first layer that moves on by
        one at every call."""
        swaps = []
        first = 0
        if limit is not None:
            first = self.turn % len(self.layers)
            self.turn += 1
        order = [(first + offset) % len(self.layers) for offset in range(len(self.layers))]

        def room():
            return limit is None or len(swaps) < limit

        if not self.adaptive:
            for index in order:
                self.static_layer(index, swaps, room)
            return swaps
        for index in order:
            layer = self.layers[index]
            if layer.num_slots == 0 or not room():
                continue
            scores = self.scores[index]
            empty = np.flatnonzero(layer.expert_in < 0)
            fill = layer.num_slots - self.miss_slots[index] - (layer.num_slots - empty.size)  # up to the wanted
            empty = empty[:max(0, fill)]
            if empty.size:
                cold = np.flatnonzero(layer.slot_of < 0)
                cold = cold[scores[cold] > 0]
                for slot, expert in zip(empty, cold[np.argsort(-scores[cold], kind="stable")]):
                    if not room():
                        break
                    layer.place(int(slot), int(expert))
                    swaps.append(Swap(index, int(slot), None, int(expert)))
            cold = np.flatnonzero(layer.slot_of < 0)
            if cold.size == 0:
                continue
            candidates = cold[np.argsort(-scores[cold], kind="stable")][: self.max_swaps]
            for expert in candidates:
                if not room():
                    break
                residents = layer.expert_in[layer.expert_in >= 0]
                weakest = residents[np.argmin(scores[residents])]
                if scores[expert] <= self.margin * scores[weakest] or scores[expert] <= 0:
                    break
                slot = int(layer.slot_of[weakest])
                layer.place(slot, int(expert))
                swaps.append(Swap(index, slot, int(weakest), int(expert)))
        return swaps


    def static_layer(self, index, swaps, room):
        """Static placement: once the layer counted its opening's pairs, its best-counted experts (one per slot, counted
        at least once, the lowest id first on ties) are chosen; chosen ones found resident become its own, the others
        are copied in, best first, into empty slots and then over experts it did not choose, weakest first."""
        layer, scores = self.layers[index], self.scores[index]
        if self.chosen[index] is None:
            if self.counted[index] < OPENING_PAIRS_PER_EXPERT * layer.num_experts:
                return
            ranked = sorted(range(layer.num_experts), key=lambda e: (-scores[e], e))[:layer.num_slots]
            self.chosen[index] = {e for e in ranked if scores[e] > 0}
        if not room():
            return
        chosen = self.chosen[index]
        for expert in chosen:
            if layer.slot_of[expert] >= 0:
                self.admitted[index][expert] = False
        cold = sorted((e for e in chosen if layer.slot_of[e] < 0), key=lambda e: (-scores[e], e))
        occupant = layer.expert_in.tolist()
        targets = ([slot for slot, e in enumerate(occupant) if e < 0]
                   + sorted((slot for slot, e in enumerate(occupant) if e >= 0 and e not in chosen),
                            key=lambda slot: (scores[occupant[slot]], slot)))
        for expert, slot in zip(cold, targets):
            if not room():
                break
            evicted = layer.place(slot, expert)
            if evicted is not None:
                self.admitted[index][evicted] = False
            self.admitted[index][expert] = False
            swaps.append(Swap(index, slot, evicted, expert))


def _replay(policy_name, trace, num_experts, slots, seed, popularity=None, admit_every=3, limits=(None,),
            miss_slots=None):
    """Drive the policy and the reference with the same trace and the same miss-policy admissions; compare.
    Each safe point's swap limit is drawn from `limits`; `miss_slots` per layer are left to the miss policy."""
    rng = np.random.default_rng(seed)
    L = trace.shape[1]
    ours_layers = [LayerSlots(num_experts, s) for s in slots]
    ref_layers = [LayerSlots(num_experts, s) for s in slots]
    policy = make_policy(policy_name, ours_layers, popularity)
    policy.judge = None  # every swap made, as the reference makes them (the judge: tests/test_swap_judge.py)
    ref = Reference(ref_layers, policy_name == "adaptive")
    for index in range(L):
        ref.scores[index][:] = policy.scores[index]
    if miss_slots is not None:
        policy.miss_slots, ref.miss_slots = list(miss_slots), list(miss_slots)
    total_swaps = total_spare = 0
    for step in range(trace.shape[0]):
        for layer in range(L):
            ids = trace[step, layer].astype(np.int64)
            if step % 5 == 4:  # some unrouted pairs (approximate routing drops them)
                ids = ids.copy()
                ids[rng.integers(ids.size)] = -1
            if step % admit_every == 0 and slots[layer]:
                busy = ids[ids >= 0]
                spare, expected = policy.spare_slots(layer, ids), ref.spare_slots(layer, busy)
                assert spare.dtype == np.int64 and spare.tolist() == expected.tolist(), (step, layer)
                cold = [int(e) for e in busy if ours_layers[layer].slot_of[e] < 0]
                for slot, expert in zip(spare.tolist(), cold[: int(rng.integers(0, 3))]):
                    policy.admit(layer, slot, expert)
                    ref.admit(layer, slot, expert)
                total_spare += spare.size
            policy.observe(layer, ids)
            ref.observe(layer, ids)
            assert np.array_equal(policy.scores[layer], ref.scores[layer])  # bit for bit
        limit = limits[int(rng.integers(len(limits)))]
        swaps, expected = policy.rebalance(limit), ref.rebalance(limit)
        assert limit is None or len(swaps) <= limit
        assert swaps == expected, step
        total_swaps += len(swaps)
        for ours, theirs in zip(ours_layers, ref_layers):
            assert np.array_equal(ours.expert_in, theirs.expert_in) and np.array_equal(ours.slot_of, theirs.slot_of)
    return total_swaps, total_spare


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_makes_the_reference_swaps_on_realistic_traces(seed):
    trace = realistic_trace(300, 3, 128, 8, seed=seed, switch_every=100)
    swaps, spare = _replay("adaptive", trace, 128, [64, 32, 0], seed)
    assert swaps > 50 and spare > 0  # the comparison saw real work


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_makes_the_reference_swaps_under_swap_limits(seed):
    """SwapAllowance's limits: none at some safe points, one or a few at others, no limit at the rest."""
    trace = realistic_trace(300, 3, 128, 8, seed=seed, switch_every=60)
    swaps, _ = _replay("adaptive", trace, 128, [64, 32, 0], seed, limits=(0, 1, 3, None))
    assert swaps > 30


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_with_miss_slots_makes_the_reference_swaps_and_keeps_them_free(seed):
    """Slots left to the miss policy: the reference's swaps, and never more residents filled in than wanted
    (admissions of copied misses aside)."""
    trace = realistic_trace(300, 3, 128, 8, seed=seed, switch_every=80)
    swaps, spare = _replay("adaptive", trace, 128, [64, 16, 4], seed, miss_slots=[8, 4, 4], limits=(1, 3, None))
    assert swaps > 30 and spare > 0
    layers = [LayerSlots(32, 8)]
    policy = AdaptivePlacement(layers)
    policy.miss_slots = [3]
    policy.observe(0, np.arange(32))
    assert len(policy.initial()) == 5 and np.count_nonzero(layers[0].expert_in >= 0) == 5
    policy.observe(0, np.arange(8, 16))  # cold experts now score above the residents: swaps, but no fills
    swaps = policy.rebalance()
    assert swaps and all(swap.evicted is not None for swap in swaps)
    assert np.count_nonzero(layers[0].expert_in >= 0) == 5
    assert policy.spare_slots(0, np.array([], np.int64)).tolist()[:3] == [5, 6, 7]  # the three left empty


def test_under_a_limit_of_one_the_layers_take_turns():
    layers = [LayerSlots(8, 2) for _ in range(3)]
    policy = AdaptivePlacement(layers)
    for layer in range(3):
        policy.observe(layer, np.array([0, 1, 2, 3, 4, 5]))  # every layer wants to fill its two empty slots
    assert [swap.layer for swap in [*policy.rebalance(1), *policy.rebalance(1), *policy.rebalance(1)]] == [0, 1, 2]
    assert [swap.layer for swap in policy.rebalance(0)] == []
    assert [swap.layer for swap in policy.rebalance(None)] == [0, 1, 2]  # the second slot of each, in order


def test_adaptive_makes_the_reference_swaps_with_popularity_and_uniform_routing():
    rng = np.random.default_rng(7)
    trace = uniform_trace(300, 2, 64, 6, seed=3)
    popularity = [rng.integers(0, 5, 64).astype(float) for _ in range(2)]  # ties in the scores
    swaps, _ = _replay("adaptive", trace, 64, [16, 64], 7, popularity)
    assert swaps > 0


@pytest.mark.parametrize("limits", [(None,), (0, 1, 3, None)])
def test_static_keeps_the_reference_spare_slots_and_places_its_openings_choice(limits):
    """Static placement without a popularity file: the copied misses' spare slots, and once a layer's opening has
    counted enough, the reference's copies of its chosen experts (under swap limits too)."""
    trace = realistic_trace(300, 3, 64, 8, seed=4)
    swaps, spare = _replay("static", trace, 64, [16, 48, 0], 4, admit_every=1, limits=limits)
    assert swaps > 0 and spare > 0


def test_a_subclass_with_its_own_wanted_gets_the_numpy_spare_slots():
    class Everything(AdaptivePlacement):
        def wanted(self, layer):
            return np.zeros(self.layers[layer].num_experts, bool)

    layer = LayerSlots(8, 4)
    policy = Everything([layer])
    for slot, expert in enumerate([3, 1, 5, 7]):
        layer.place(slot, expert)
    policy.scores[0][:] = [0, 4, 0, 1, 0, 2, 0, 3]
    assert policy.spare_slots(0, np.array([5])).tolist() == [0, 3, 1]
    assert StaticPlacement([LayerSlots(4, 2)])._wanted_rule == 0


def test_all_resident_follows_placement_and_resizing():
    """all_resident (asked at every layer-step) keeps its answer once true, until a slot changes or the slots do."""
    layer = LayerSlots(num_experts=4, num_slots=4)
    assert not layer.all_resident
    for expert in range(4):
        layer.place(expert, expert)
    assert layer.all_resident and layer.all_resident
    layer.resize(3)  # fewer slots than experts
    assert not layer.all_resident
    layer.resize(4)
    assert not layer.all_resident  # the fourth slot came back empty
    layer.place(3, 3)
    assert layer.all_resident
    layer.slot_of[2] = -1  # (not how placement moves experts: to see that place() asks again)
    layer.place(3, 3)
    assert not layer.all_resident
