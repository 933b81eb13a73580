"""AdaptivePlacement.rebalance's one compiled call over every layer (_rebalance_layers) and SwapJudge's rows against
the formulation they replaced: a Python loop over the layers calling _rebalance per layer (and again on copies of the
slots for the swaps a paused judge watches), the judge taking Swap objects. On random traces with the judge paused
and not, limits (0, 1, a few, none) over many safe points, layers without slots or with every expert resident,
resized layers and replaced score arrays between safe points, empty slots, copied misses and tied scores: the same
swaps in the same order, the same slots after every safe point and the same judge state."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from engine.offload.placement import AdaptivePlacement, LayerSlots, Swap, _rebalance
from engine.offload.swap_judge import SwapJudge
from engine.offload.traces import realistic_trace, uniform_trace


class ReferenceJudge:
    """SwapJudge before the rows: Swap objects, one watch array per layer, one deque entry per watched swap."""

    def __init__(self, num_experts, window=16, pays=1.0, memory=1 / 64, evidence=8.0):
        self.window, self.pays, self.memory, self.evidence = window, pays, memory, evidence
        self.watch = [np.zeros(count) for count in num_experts]
        self._watched = deque()
        self._point = 0
        self.step_net = 0.0
        self._net = 0.0
        self._windows = 0.0
        self.paused = False

    @property
    def net_hits_per_swap(self):
        return self._net / self._windows if self._windows >= max(self.evidence, 1e-9) else None

    def safe_point(self, swaps):
        self._point += 1
        keep = 1.0 - self.memory
        self._net = keep * self._net + self.step_net
        self._windows = keep * self._windows + len(self._watched) / self.window
        self.step_net = 0.0
        while self._watched and self._watched[0][0] <= self._point - self.window:
            _, layer, loaded, evicted = self._watched.popleft()
            self.watch[layer][loaded] -= 1.0
            self.watch[layer][evicted] += 1.0
        for swap in swaps:
            if swap.evicted is None:
                continue
            self.watch[swap.layer][swap.loaded] += 1.0
            self.watch[swap.layer][swap.evicted] -= 1.0
            self._watched.append((self._point, swap.layer, swap.loaded, swap.evicted))
        earned = self.net_hits_per_swap
        self.paused = earned is not None and earned < self.pays


class Reference(AdaptivePlacement):
    """AdaptivePlacement.rebalance before the compiled loop over the layers (everything else is AdaptivePlacement's)."""

    def rebalance(self, limit=None):
        swaps, watched = [], []
        paused = self._moves_paused()
        rows = None
        count = len(self.layers)
        first = 0
        if limit is not None and count:
            first = self._turn % count
            self._turn += 1
        for offset in range(count):
            index = (first + offset) % count
            layer = self.layers[index]
            left = -1 if limit is None else limit - len(swaps)
            if left == 0:
                break
            if layer.num_slots == 0 or layer.all_resident:
                continue
            if rows is None or rows.shape[0] < layer.expert_in.size + self.max_swaps:
                rows = np.empty((layer.expert_in.size + self.max_swaps, 3), np.int64)
            n = _rebalance(self.scores[index], layer.slot_of, layer.expert_in, self.margin,
                           0 if paused else self.max_swaps, left, self.wanted_slots(index), rows)
            swaps += _swaps(index, rows[:n])
            if paused:
                watched += self._shadow_swaps(index)
        if self.judge is not None:
            self.judge.safe_point(watched if paused else swaps)
        return swaps

    def _shadow_swaps(self, index):
        layer = self.layers[index]
        rows = np.empty((layer.expert_in.size + self.max_swaps, 3), np.int64)
        n = _rebalance(self.scores[index], layer.slot_of.copy(), layer.expert_in.copy(), self.margin, self.max_swaps,
                       -1, self.wanted_slots(index), rows)
        return _swaps(index, rows[:n])


def _swaps(layer, rows):
    return [Swap(layer, slot, evicted if evicted >= 0 else None, loaded) for slot, evicted, loaded in rows.tolist()]


def _same_judges(ours, ref):
    if ref is None:
        assert ours is None
        return
    assert ours.paused == ref.paused and ours._point == ref._point and ours.step_net == ref.step_net
    assert ours._net == ref._net and ours._windows == ref._windows and ours._watching == len(ref._watched)
    assert all(np.array_equal(a, b) for a, b in zip(ours.watch, ref.watch, strict=True))


def _replay(trace, experts, slots, seed, *, judged=True, limits=(None,), force_pause=None, initial=True,
            popularity=False, resize_every=0, rescore_every=0, miss_every=0, admit_every=3, swaps_every=0,
            policy_class=AdaptivePlacement, reference_class=Reference, judge_args=None):
    """Drive the policy and the reference with the same trace, admissions and changes between safe points; compare
    after every safe point. Returns the swaps made, the swaps the judges watched while paused and the safe points'
    layers with every expert resident."""
    rng = np.random.default_rng(seed)
    L = trace.shape[1]
    ours_layers = [LayerSlots(experts, s) for s in slots]
    ref_layers = [LayerSlots(experts, s) for s in slots]
    ours, ref = policy_class(ours_layers), reference_class(ref_layers)
    if judged:
        ours.judge = SwapJudge([experts] * L, **(judge_args or {}))
        ref.judge = ReferenceJudge([experts] * L, **(judge_args or {}))
    if popularity:  # small whole numbers: ties
        for index in range(L):
            ours.scores[index][:] = ref.scores[index][:] = rng.integers(0, 4, experts)
    ours.miss_slots = ref.miss_slots = [int(rng.integers(0, 3)) if s else 0 for s in slots]
    if initial:
        assert ours.initial() == ref.initial()
    made = watched = resident = 0
    for step in range(trace.shape[0]):
        for layer in range(L):
            ids = trace[step, layer].astype(np.int64)
            if step % 5 == 4:  # an unrouted pair
                ids = ids.copy()
                ids[rng.integers(ids.size)] = -1
            if admit_every and step % admit_every == 0 and ours_layers[layer].num_slots:  # copied misses
                spare = ours.spare_slots(layer, ids)
                assert spare.tolist() == ref.spare_slots(layer, ids).tolist()
                cold = [int(e) for e in ids if e >= 0 and ours_layers[layer].slot_of[e] < 0]
                for slot, expert in zip(spare.tolist(), cold[:int(rng.integers(0, 3))]):
                    assert ours.admit(layer, slot, expert) == ref.admit(layer, slot, expert)
            ours.observe(layer, ids)
            ref.observe(layer, ids)
        if resize_every and step % resize_every == resize_every - 1:  # LayerSlots.resize replaces expert_in
            layer = int(rng.integers(L))
            count = int(rng.integers(0, experts + 3))
            assert ours_layers[layer].resize(count) == ref_layers[layer].resize(count)
        if rescore_every and step % rescore_every == rescore_every - 1:  # a new scores array (a re-plan's), a slot_of
            layer = int(rng.integers(L))
            if rng.random() < 0.3:  # (not what LayerSlots does, but an attribute anyone may set)
                ours_layers[layer].slot_of = ours_layers[layer].slot_of.copy()
            else:
                ours.scores[layer] = ours.scores[layer].copy()
            if rng.random() < 0.5:
                ours.scores = list(ours.scores)
        if miss_every and step % miss_every == miss_every - 1:  # the engine weighs the miss slots again
            layer = int(rng.integers(L))
            if rng.random() < 0.5:
                ours.miss_slots[layer] = ref.miss_slots[layer] = int(rng.integers(0, 6))  # (the same list)
            else:
                ours.miss_slots = ref.miss_slots = [int(rng.integers(0, 6)) for _ in range(L)]
        if swaps_every and step % swaps_every == swaps_every - 1:  # a benchmark switch
            ours.max_swaps = ref.max_swaps = int(rng.integers(0, 5))
        if force_pause is not None and judged:
            ours.judge.paused = ref.judge.paused = bool(rng.random() < force_pause)
        paused = judged and ref.judge.paused
        limit = limits[int(rng.integers(len(limits)))]
        swaps, expected = ours.rebalance(limit), ref.rebalance(limit)
        assert swaps == expected, step
        assert ours._turn == ref._turn
        for a, b in zip(ours_layers, ref_layers, strict=True):
            assert np.array_equal(a.slot_of, b.slot_of) and np.array_equal(a.expert_in, b.expert_in), step
            assert a.all_resident == b.all_resident
            resident += a.all_resident
        _same_judges(ours.judge, ref.judge)
        made += len(swaps)
        if paused:
            watched += sum(1 for entry in ref.judge._watched if entry[0] == ref.judge._point)
    return made, watched, resident


# 6 layers: two without slots, one with a slot per expert (all resident once filled), one with more slots than
# experts, two with some
SLOTS = [16, 0, 32, 8, 0, 35]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_routing_pauses_the_judge_and_the_watched_swaps_are_the_references(seed):
    trace = uniform_trace(400, 6, 32, 4, seed=seed)
    made, watched, resident = _replay(trace, 32, SLOTS, seed, judge_args={"evidence": 2.0}, limits=(None, 1, 3))
    assert watched > 100 and made > 0 and resident > 100  # paused for most of the trace, filling and watching


@pytest.mark.parametrize("seed", [0, 1])
def test_realistic_routing_makes_the_references_swaps_unpaused(seed):
    trace = realistic_trace(400, 6, 32, 4, seed=seed, switch_every=60)
    made, _, resident = _replay(trace, 32, SLOTS, seed, limits=(None, 2))
    assert made > 100 and resident > 100


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_paused_and_not_at_random_under_every_kind_of_limit(seed):
    """The judge's verdict forced at random before each safe point; limits none, 0, 1, 2, 5 and negative; layers
    take turns over many safe points."""
    trace = realistic_trace(300, 6, 32, 4, seed=seed, switch_every=40)
    made, watched, _ = _replay(trace, 32, SLOTS, seed, force_pause=0.5, limits=(None, 0, 1, 2, 5, -1))
    assert made > 50 and watched > 50


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resizes_new_scores_miss_slots_and_max_swaps_between_safe_points(seed):
    """Arrays replaced between safe points (LayerSlots.resize, a scores array, the list of them), miss slots changed
    in place and replaced, max_swaps changed (larger rows); slots left empty at the start, tied scores."""
    trace = uniform_trace(300, 6, 32, 4, seed=seed) if seed % 2 else realistic_trace(300, 6, 32, 4, seed=seed)
    made, watched, _ = _replay(trace, 32, SLOTS, seed, force_pause=0.4, limits=(None, 0, 1, 3), initial=False,
                               popularity=True, resize_every=7, rescore_every=5, miss_every=6, swaps_every=11)
    assert made > 50 and watched > 20


def test_without_a_judge_and_with_layers_coming_and_going():
    rng = np.random.default_rng(5)
    trace = realistic_trace(200, 4, 16, 2, seed=5)
    layers = [LayerSlots(16, 4) for _ in range(4)]
    ref_layers = [LayerSlots(16, 4) for _ in range(4)]
    ours, ref = AdaptivePlacement(layers), Reference(ref_layers)
    for step in range(trace.shape[0]):
        for layer in range(len(ours.layers)):
            ids = trace[step, layer % 4]
            ours.observe(layer, ids)
            ref.observe(layer, ids)
        if step % 9 == 8:  # a layer more (every list the policy keeps per layer), or one less
            if len(ours.layers) < 6:
                count = int(rng.integers(0, 6))
                for policy in (ours, ref):
                    policy.layers.append(LayerSlots(16, count))
                    policy.scores.append(np.zeros(16))
                    policy.admitted.append(np.zeros(16, bool))
                    policy._unwatched.append(np.zeros(16))
                    policy.miss_slots.append(0)
            else:
                ours.layers, ref.layers = ours.layers[:3], ref.layers[:3]
        limit = (None, 1, 2)[step % 3]
        assert ours.rebalance(limit) == ref.rebalance(limit), step
        for a, b in zip(ours.layers, ref.layers, strict=True):
            assert np.array_equal(a.slot_of, b.slot_of) and np.array_equal(a.expert_in, b.expert_in)


def test_a_subclass_with_its_own_wanted_slots():
    """One that depends on more than the slot counts and miss slots (here, a score): asked at every safe point."""
    class Fewer(AdaptivePlacement):
        def wanted_slots(self, layer):
            return max(0, self.layers[layer].num_slots - int(self.scores[layer].sum()) % 4)

    class FewerReference(Reference):
        wanted_slots = Fewer.wanted_slots

    trace = realistic_trace(200, 6, 32, 4, seed=9)
    made, _, _ = _replay(trace, 32, SLOTS, 9, force_pause=0.3, limits=(None, 1), initial=False, resize_every=5,
                         admit_every=0, policy_class=Fewer, reference_class=FewerReference)
    assert made > 20


def test_the_judge_takes_rows_and_counts_only_evictions():
    judge = SwapJudge([4, 6], window=2, evidence=0.0)
    rows = np.array([[0, 1, 2, 3], [1, 0, -1, 5], [1, 2, 4, 5], [1, 3, 5, 0]])  # (layer, slot, evicted, loaded)
    judge.safe_point(rows)
    rows[:] = -7  # placement writes its rows again: the judge kept its own copy
    assert judge.watch[0].tolist() == [0, 0, -1, 1] and judge.watch[1].tolist() == [1, 0, 0, 0, -1, 0]
    assert judge._watching == 3
    judge.safe_point(np.empty((0, 4), np.int64))
    judge.safe_point([])  # the first point's watches end
    assert not judge.watch[0].any() and not judge.watch[1].any() and judge._watching == 0
