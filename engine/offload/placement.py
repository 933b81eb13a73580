"""Which experts live in a layer's GPU slots.

Each expert node has a fixed number of slots. A policy sees the experts every step routes to and,
at safe points between steps, may ask to swap cold experts in. `static` chooses the residents once
(from a popularity file, or from the routing counted over an opening: StaticPlacement) and never moves them once
in; `adaptive` scores every expert by exponentially decayed hits (recency with a memory of frequency) and swaps an
expert in only when its score beats the weakest resident's by a margin (hysteresis), at most a
few swaps per layer per safe point, so placement never thrashes.

Between safe points, a decode step's miss policy (miss_policy.py) may copy a missed expert into a
spare slot: an empty slot or one whose expert the placement does not want (static: anything it did
not choose itself; adaptive: a resident scored below the wanted slots' worth of best scores, or, while its swaps
are paused for earning nothing (swap_judge.py), anything it did not choose itself, as static). The policy is
told (admit), and keeps or evicts the expert at later safe points like any other.

A layer's `miss_slots` (set by the engine under adaptive placement, from the miss policy's cost model:
miss_policy.miss_slots) are slots the placement leaves to those copies: it wants only num_slots - miss_slots
residents, fills no more than that at load or at a safe point, and the rest stay empty or hold experts it does
not want (earlier copied misses), so a decode step always finds a slot to copy a miss into. With the CPU and PCIe both reading misses, a step is
shorter than with one more resident expert and every miss on the CPU (anchors.md: misses split between CPU
compute and PCIe copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import is_

import numpy as np
from numba import njit
from numba.typed import List

from engine.offload.swap_judge import SwapJudge


@dataclass
class Swap:
    layer: int
    slot: int
    evicted: int | None
    loaded: int


@dataclass
class LayerSlots:
    """The slots of one expert node: expert -> slot and slot -> expert (-1 = empty)."""
    num_experts: int
    num_slots: int
    slot_of: np.ndarray = field(init=False)     # [E] int32, -1 = cold
    expert_in: np.ndarray = field(init=False)   # [slots] int32, -1 = empty

    _all_resident: bool = field(init=False, default=False, repr=False)  # all_resident's answer, once true

    def __post_init__(self):
        self.slot_of = np.full(self.num_experts, -1, np.int32)
        self.expert_in = np.full(self.num_slots, -1, np.int32)

    def resident(self) -> np.ndarray:
        return self.expert_in[self.expert_in >= 0]

    @property
    def all_resident(self) -> bool:
        """Every expert of the node in a slot: routing can stay on the device (hybrid_node.py). Asked at every step of
        every layer; once true it stays so (no expert is cold, so none is swapped in) until place() or resize()."""
        if not self._all_resident:
            self._all_resident = self.num_slots >= self.num_experts and bool((self.slot_of >= 0).all())
        return self._all_resident

    def place(self, slot: int, expert: int) -> int | None:
        self._all_resident = False
        evicted = int(self.expert_in[slot])
        if evicted >= 0:
            self.slot_of[evicted] = -1
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        return evicted if evicted >= 0 else None

    def resize(self, num_slots: int) -> list[int]:
        """Change the slot count keeping the first residents; returns the experts dropped."""
        self._all_resident = False
        kept = self.expert_in[:num_slots]
        dropped = [int(e) for e in self.expert_in[num_slots:] if e >= 0]
        self.expert_in = np.concatenate([kept, np.full(max(0, num_slots - len(kept)), -1, np.int32)])
        self.num_slots = num_slots
        self.slot_of[:] = -1
        for slot, expert in enumerate(self.expert_in):
            if expert >= 0:
                self.slot_of[expert] = slot
        return dropped


class PlacementPolicy:
    """Scores experts from what routing hits; proposes swaps at safe points."""

    def __init__(self, layers: list[LayerSlots]):
        self.layers = layers
        self.scores = [np.zeros(layer.num_experts) for layer in layers]
        self.admitted = [np.zeros(layer.num_experts, bool) for layer in layers]  # copied in by the miss policy
        self.admissions = 0
        self.miss_slots = [0] * len(layers)  # per layer: slots left to the miss policy's copies
        self._unwatched = [np.zeros(layer.num_experts) for layer in layers]  # observe's watch where none is judged
        # spare_slots in one compiled call where wanted() is one of ours (0: base, 1: adaptive); a subclass with
        # its own wanted() gets the NumPy formulation
        wanted = type(self).wanted
        self._wanted_rule = 0 if wanted is PlacementPolicy.wanted else 1 if wanted is AdaptivePlacement.wanted else -1

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        raise NotImplementedError

    def wanted_slots(self, layer: int) -> int:
        """The residents the placement wants in the layer: its slots less those left to copied misses."""
        return max(0, self.layers[layer].num_slots - self.miss_slots[layer])

    def wanted(self, layer: int) -> np.ndarray:
        """A bool per expert: the placement wants it resident (base: what it placed itself)."""
        slots = self.layers[layer]
        return (slots.slot_of >= 0) & ~self.admitted[layer]

    def spare_slots(self, layer: int, busy: np.ndarray) -> np.ndarray:
        """Slots a missed expert may be copied into during a step: empty ones first, then those
        whose expert the placement does not want, weakest first; never one holding an expert in
        `busy` (routed this step: the device may be reading it; negative ids, unrouted pairs, are ignored)."""
        slots = self.layers[layer]
        rule = self._spare_rule()
        if rule >= 0:
            return _spare_slots(self.scores[layer], slots.slot_of, slots.expert_in, self.admitted[layer],
                                busy.reshape(-1), rule, self.wanted_slots(layer))
        occupant = slots.expert_in
        # per expert: may be evicted now (resident, not wanted, not routed this step); an empty slot's -1
        # reads the last expert's entry, and `occupied` masks it out
        free = ~self.wanted(layer)
        busy = busy[busy >= 0]
        if busy.size:
            free[busy] = False
        occupied = occupant >= 0
        safe = occupied & free[occupant]
        empty = np.flatnonzero(~occupied)
        spare = np.flatnonzero(safe)
        if spare.size > 1:
            spare = spare[np.argsort(self.scores[layer][occupant[spare]], kind="stable")]
        return np.concatenate([empty, spare]).astype(np.int64)

    def _spare_rule(self) -> int:
        """_spare_slots' rule for wanted(): 0 the base's, 1 adaptive's, -1 a subclass's own (NumPy)."""
        return self._wanted_rule

    def admit(self, layer: int, slot: int, expert: int) -> int | None:
        """The miss policy copied `expert` into `slot`; returns the expert evicted from it."""
        evicted = self.layers[layer].place(slot, expert)
        if evicted is not None:
            self.admitted[layer][evicted] = False
        self.admitted[layer][expert] = True
        self.admissions += 1
        return evicted

    def _placed(self, layer: int, expert: int) -> None:
        self.admitted[layer][expert] = False

    def initial(self) -> list[Swap]:
        """Fill empty slots with the best-scored experts, up to the wanted residents (all policies)."""
        swaps = []
        for index, layer in enumerate(self.layers):
            order = np.argsort(-self.scores[index], kind="stable")
            room = max(0, self.wanted_slots(index) - int(np.count_nonzero(layer.expert_in >= 0)))
            wanted = [int(e) for e in order[:self.wanted_slots(index)] if layer.slot_of[e] < 0][:room]
            for slot in np.flatnonzero(layer.expert_in < 0):
                if not wanted:
                    break
                expert = wanted.pop(0)
                layer.place(int(slot), expert)
                self._placed(index, expert)
                swaps.append(Swap(index, int(slot), None, expert))
        return swaps

    def rebalance(self, limit: int | None = None) -> list[Swap]:
        """Swaps for this safe point, at most `limit` in all (None: as many as the policy wants)."""
        return []


# Static placement's opening (no popularity file): routed pairs a layer counts per expert before it chooses its
# residents. A count with a mean of 8 is noisy by about a third, enough to tell the experts routing favours from the
# rest (a hot expert counts several times the mean); a longer opening leaves the slots to churning copies for longer.
# gpt-oss-20b (32 experts, top-4): 64 tokens, Qwen3-30B-A3B (128, top-8): 128; a prompt that long ends it at its
# prefill.
OPENING_PAIRS_PER_EXPERT = 8


class StaticPlacement(PlacementPolicy):
    """Residents chosen once from popularity (counts per layer × expert); never moved once in.

    With a popularity file its counts choose them at once (initial(), at load); where it counts fewer experts than the
    layer has slots, they stay and the layer's opening chooses for the slots left (topping_up). Without one (or in a
    layer the file leaves out or counts 0 throughout), the layer's opening counts what routing chooses, prefill and
    decode alike, until OPENING_PAIRS_PER_EXPERT routed pairs per expert;
    at the safe point that ends it, the layer's best-counted experts (one per slot, counted at least once, the lowest
    id first on ties; every expert where there is a slot for each) are chosen. Until a layer has chosen, every slot is
    spare for the miss policy's copies. Then, at safe points, rebalance copies the chosen experts in, best first, into
    empty slots and then over the experts it did not choose (weakest first), within the swap allowance like adaptive's
    swaps; a chosen expert already in a slot as a copied miss stays where it is, as its own. Once in, they never move
    (the miss policy copies into slots static placement left empty or holds no chosen expert in)."""

    def __init__(self, layers: list[LayerSlots], popularity: list[np.ndarray | None] | None = None):
        super().__init__(layers)
        # per layer: placed from the popularity file (its scores the file's counts, the routing since added); a layer
        # the file leaves out (None) or counts 0 throughout (no expert told from another) is measured by its opening,
        # as without a file
        self.from_file = [popularity is not None and counts_any(popularity[index]) for index in range(len(layers))]
        self.file_counts = [np.asarray(popularity[index], dtype=np.float64).copy() if from_file else None
                            for index, from_file in enumerate(self.from_file)]
        for index, counts in enumerate(self.file_counts):
            if counts is not None:
                self.scores[index] = counts.copy()
        self.chosen: list[np.ndarray | None] = [None] * len(layers)  # per layer: a bool per expert, once chosen
        self.chosen_for = [0] * len(layers)  # per layer: the slots it had when it chose (a re-plan keeps the choice)
        # per layer: chose from the file, which counts fewer experts than it has slots; its opening measures the rest
        self.topping_up = [False] * len(layers)
        self.counted = [0.0] * len(layers)  # per layer: the routed pairs observed (enough end its opening)
        self._each = [np.ones(layer.num_experts) for layer in layers]  # _observe's watch: it returns the pairs
        # every layer chose and its chosen experts are in, while these are the layers' expert_in arrays (only a resize,
        # as a re-plan that failed makes, can take a chosen expert out: the miss policy copies over none)
        self._settled: list[np.ndarray] | None = None
        self._turn = 0  # under a limit, the layer that goes first (layers take turns)
        for index, layer in enumerate(layers):  # residents it finds (a re-plan keeps them) are not its own choice
            self.admitted[index][layer.resident()] = True

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        # = np.add.at(scores, expert_ids[expert_ids >= 0], 1.0), in one compiled call, which counts those ids
        self.counted[layer] += _observe(self.scores[layer], expert_ids.reshape(-1), 1.0, False, self._each[layer])

    @property
    def opening(self) -> bool:
        """Some layer's opening still counts routing before it chooses its residents."""
        return any(self.opening_left(index) > 0 for index in range(len(self.layers)))

    def opening_left(self, layer: int) -> float:
        """The routed pairs the layer's opening still counts before it chooses (0 once it has, and where there is
        nothing to choose: no slot, or a slot for every expert); in a layer topping the file's choice up, before it
        chooses the experts for the slots the file's counts leave."""
        slots = self.layers[layer]
        if not 0 < slots.num_slots < slots.num_experts or (self.chosen[layer] is not None
                                                            and not self.topping_up[layer]):
            return 0.0
        return max(0.0, OPENING_PAIRS_PER_EXPERT * slots.num_experts - self.counted[layer])

    def unchosen_slots(self, layer: int) -> int:
        """The layer's slots its choice leaves to copied misses, where it counted fewer experts than it has slots (0
        before it has chosen); while its opening tops a popularity file's choice up, those the file's counts leave
        (they hold copied misses until its opening chooses for them)."""
        chosen = self.chosen[layer]
        if chosen is None:
            return 0
        return max(0, self.layers[layer].num_slots - int(np.count_nonzero(chosen)))

    def to_place(self) -> int:
        """The chosen experts not yet copied in, over the layers."""
        return sum(int(np.count_nonzero(chosen & (layer.slot_of < 0)))
                   for chosen, layer in zip(self.chosen, self.layers) if chosen is not None)

    def choose(self) -> None:
        """End every layer's opening now: its residents chosen from the counts so far (traces.replay)."""
        for index in range(len(self.layers)):
            if self.chosen[index] is None or self.topping_up[index]:
                self._choose(index)

    def _choose(self, layer: int) -> None:
        """The layer's best-counted experts chosen, up to its wanted residents. A file's choice that leaves slots is
        topped up by the layer's opening (an expert the file counts 0 was routed nowhere in its measurement, which
        says nothing of this workload's): it is kept (its experts never move), and the best the opening counted of
        the others join it. The file's choice is its counts' alone (a re-plan keeps the routing measured since)."""
        wanted = self.wanted_slots(layer)
        topping_up = self.topping_up[layer]
        scores = self.file_counts[layer] if self.from_file[layer] and not topping_up else self.scores[layer]
        kept = self.chosen[layer] if topping_up else np.zeros(scores.size, bool)
        others = np.flatnonzero(~kept)
        best = others[np.argsort(-scores[others], kind="stable")][:max(0, wanted - int(np.count_nonzero(kept)))]
        # a slot for every expert: every one, counted or not (the layer then routes on the device: all_resident)
        chosen = kept | (wanted >= scores.size)
        chosen[best[scores[best] > 0]] = True
        self.topping_up[layer] = self.from_file[layer] and not topping_up and int(np.count_nonzero(chosen)) < wanted
        self.chosen[layer], self.chosen_for[layer] = chosen, self.layers[layer].num_slots
        self._settled = None

    def initial(self) -> list[Swap]:
        """The layers placed from the popularity file choose now; the chosen experts are copied in, without a limit
        (the layers the file leaves out keep their opening)."""
        for index, from_file in enumerate(self.from_file):
            if from_file and self.chosen[index] is None:
                self._choose(index)
        return self.rebalance()

    def rebalance(self, limit: int | None = None) -> list[Swap]:
        """Layers whose opening has counted enough choose; then the chosen experts not yet in are copied in (the class
        says how), at most `limit` in all (None: every one), the layers taking turns to go first under a limit; once
        it is spent, later layers are not looked at (their chosen experts copied in as misses are taken as its own
        at a later safe point)."""
        if self._settled is not None and all(map(is_, [layer.expert_in for layer in self.layers], self._settled)):
            return []
        count = len(self.layers)
        first = 0
        if limit is not None and count:
            first = self._turn % count
            self._turn += 1
        swaps: list[Swap] = []
        settled = True
        for offset in range(count):
            index = (first + offset) % count
            if self.chosen[index] is None or self.topping_up[index]:
                if self.opening_left(index) > 0:  # (a layer topping up meanwhile keeps the file's choice in)
                    settled = False
                    if self.chosen[index] is None:
                        continue
                else:
                    self._choose(index)
            if limit is not None and len(swaps) >= limit:  # (not looked at: ~6 µs a layer, most safe points)
                settled = False
                continue
            settled &= self._bring_in(index, None if limit is None else limit - len(swaps), swaps)
        self._settled = [layer.expert_in for layer in self.layers] if settled else None
        return swaps

    def _bring_in(self, index: int, left: int | None, swaps: list[Swap]) -> bool:
        """Up to `left` of the layer's chosen experts copied in (appended to `swaps`); whether all are in now."""
        layer, chosen, admitted = self.layers[index], self.chosen[index], self.admitted[index]
        admitted[chosen & (layer.slot_of >= 0)] = False  # copied in as misses: its own now, where they are
        cold = np.flatnonzero(chosen & (layer.slot_of < 0))
        if not cold.size:
            return True
        cold = cold[np.argsort(-self.scores[index][cold], kind="stable")]
        occupant = layer.expert_in
        empty = np.flatnonzero(occupant < 0)
        others = np.flatnonzero((occupant >= 0) & ~chosen[occupant])
        others = others[np.argsort(self.scores[index][occupant[others]], kind="stable")]
        count = cold.size if left is None else min(left, cold.size)
        for expert, slot in zip(cold[:count].tolist(), np.concatenate([empty, others]).tolist()):
            evicted = layer.place(slot, expert)
            if evicted is not None:
                admitted[evicted] = False
            self._placed(index, expert)
            swaps.append(Swap(index, slot, evicted, expert))
        return count == cold.size


class AdaptivePlacement(PlacementPolicy):
    """Decayed hit counts per layer × expert; swaps with hysteresis at safe points.

    decay: weight kept per step (0.9 remembers ~10 steps: strong recency, as real routing has).
    margin: a cold expert must score this many times the weakest resident's score to swap in.
    max_swaps: swaps per layer per safe point (copies must never stall a decode step).
    judge: whether the swaps pay (swap_judge.py): while they do not, none is made (None: every swap is made).
    """

    def __init__(self, layers: list[LayerSlots], decay: float = 0.9, margin: float = 1.5, max_swaps: int = 2,
                 judge: SwapJudge | None = None):
        super().__init__(layers)
        self.decay, self.margin, self.max_swaps = decay, margin, max_swaps
        self.judge = judge
        self._arrays: _LayerArrays | None = None  # rebalance's compiled call's arguments (_layer_arrays)
        self._wanted, self._wanted_key = np.zeros(0, np.int64), None  # _wanted_counts' answer, and what it came from
        self._turn = 0  # under a limit, the layer that goes first (layers take turns)

    def wanted(self, layer: int) -> np.ndarray:
        """Residents scored at least the wanted slot count's best score (ties count as wanted); while the judge has
        paused the swaps, every resident the placement chose: a miss copied over one would be a swap, for a step."""
        if self._moves_paused():
            return super().wanted(layer)
        slots, scores = self.layers[layer], self.scores[layer]
        wanted = self.wanted_slots(layer)
        if wanted == 0:
            return np.zeros(slots.num_experts, bool)
        if wanted >= slots.num_experts:
            return slots.slot_of >= 0
        bar = np.partition(scores, scores.size - wanted)[scores.size - wanted]
        return (slots.slot_of >= 0) & (scores >= bar) & (scores > 0)

    def _moves_paused(self) -> bool:
        return self.judge is not None and self.judge.paused

    def _spare_rule(self) -> int:
        return 0 if self._moves_paused() and self._wanted_rule == 1 else self._wanted_rule

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        # = scores *= decay; np.add.at(scores, expert_ids[expert_ids >= 0], 1.0), in one compiled call, which also
        # counts the net hits on the experts the judge watches
        judge = self.judge
        if judge is None:
            _observe(self.scores[layer], expert_ids.reshape(-1), self.decay, True, self._unwatched[layer])
        else:
            judge.step_net += _observe(self.scores[layer], expert_ids.reshape(-1), self.decay, True,
                                       judge.watch[layer])

    def rebalance(self, limit: int | None = None) -> list[Swap]:
        """Per layer with slots: fill empty slots with the best positive-scored cold experts, up to the wanted
        residents (the layer's miss slots stay free for the miss policy); then take the
        max_swaps best cold experts (highest score first, lowest id on ties) and, in that order, swap each in for
        the weakest resident (first in slot order on ties) while it scores more than margin times that one's
        score. Under a `limit` (swaps in all, SwapAllowance), the layers take turns to go first, one further at
        every call, so none waits on the others for ever; once the limit is spent, later layers are not looked at.
        While the judge finds that swaps do not pay, only empty slots are filled; the swaps that would have been
        made (worked out on copies of each layer's slots) are handed to the judge all the same, so that it sees
        when they would pay again.

        This runs at every decode step's end, while the GPU idles: all layers in one compiled call
        (_rebalance_layers, _rebalance per layer), the judge's part in one more, not several Python-level calls per
        layer (benchmarks/bench_rebalance.py, 48 layers, judge paused, dev VM: 272 µs a safe point before, 47 now)."""
        paused = self._moves_paused()
        count = len(self.layers)
        first = 0
        if limit is not None and count:
            first = self._turn % count
            self._turn += 1
        if limit == 0:  # nothing may move and no layer is looked at: most safe points where swaps pay (rationed)
            swaps = watched = _NO_ROWS
        else:
            arrays = self._layer_arrays()
            made, watching = _rebalance_layers(arrays.scores, arrays.slot_of, arrays.expert_in, self._wanted_counts(),
                                               first, -1 if limit is None else limit, float(self.margin),
                                               arrays.max_swaps, paused, arrays.rows, arrays.shadow_rows,
                                               arrays.spare_slot_of, arrays.spare_expert_in)
            swaps, watched = arrays.rows[:made], arrays.shadow_rows[:watching]
        if self.judge is not None:
            self.judge.safe_point(watched if paused else swaps)
        return _swaps(swaps)

    def _wanted_counts(self) -> np.ndarray:
        """wanted_slots(index) of every layer, as int64; where wanted_slots is PlacementPolicy's, asked again only
        when a layer's slot count or miss slots changed."""
        count = len(self.layers)
        if type(self).wanted_slots is not PlacementPolicy.wanted_slots:
            return np.array([self.wanted_slots(index) for index in range(count)], np.int64)
        key = ([layer.num_slots for layer in self.layers], list(self.miss_slots[:count]))
        if key != self._wanted_key:
            self._wanted = np.array([self.wanted_slots(index) for index in range(count)], np.int64)
            self._wanted_key = key
        return self._wanted

    def _layer_arrays(self) -> _LayerArrays:
        """The layers' arrays as rebalance hands them to its compiled call, made again when a layer's slot_of /
        expert_in or scores array was replaced (LayerSlots.resize, a re-plan's scores), a layer came or went, or
        max_swaps changed; checking costs a few µs at 48 layers."""
        arrays, layers, scores = self._arrays, self.layers, self.scores
        if (arrays is None or arrays.max_swaps != self.max_swaps or len(arrays.expert_in_seen) != len(layers)
                or not all(map(is_, [layer.expert_in for layer in layers], arrays.expert_in_seen))
                or not all(map(is_, [layer.slot_of for layer in layers], arrays.slot_of_seen))
                or not all(map(is_, scores, arrays.scores_seen)) or len(scores) < len(layers)):
            arrays = self._arrays = _LayerArrays(layers, scores, int(self.max_swaps))
        return arrays


class _LayerArrays:
    """Every layer's slot_of / expert_in / scores as numba typed Lists (the same arrays, changed in place by
    _rebalance_layers), the arrays seen (identity checks), and the rows _rebalance_layers writes: each layer's at most
    its slots (fills) plus max_swaps, for the swaps made and the swaps a paused judge watches."""

    def __init__(self, layers: list[LayerSlots], scores: list[np.ndarray], max_swaps: int):
        self.max_swaps = max_swaps
        self.slot_of_seen = [layer.slot_of for layer in layers]
        self.expert_in_seen = [layer.expert_in for layer in layers]
        self.scores_seen = [scores[index] for index in range(len(layers))]
        self.slot_of = _typed_list(self.slot_of_seen, np.int32)
        self.expert_in = _typed_list(self.expert_in_seen, np.int32)
        self.scores = _typed_list(self.scores_seen, np.float64)
        rows = sum(expert_in.size + max_swaps for expert_in in self.expert_in_seen)
        self.rows = np.empty((rows, 4), np.int64)
        self.shadow_rows = np.empty((rows, 4), np.int64)
        # the paused judge's copies of one layer's slots
        self.spare_slot_of = np.empty(max((a.size for a in self.slot_of_seen), default=0), np.int32)
        self.spare_expert_in = np.empty(max((a.size for a in self.expert_in_seen), default=0), np.int32)


def _typed_list(arrays: list[np.ndarray], dtype) -> List:
    """`arrays` (1-D, contiguous, of `dtype`: another raises) in a numba typed List that refers to them. Made by
    compiled code that Numba caches on disk: typed List's own methods would compile again in every process (~0.3 s
    against ~0.1, at the warm-up of a model's load: kernel_warmup.py)."""
    out = _empty_list_of(np.empty(0, dtype))
    for array in arrays:
        _append(out, array)
    return out


@njit(cache=True)
def _empty_list_of(example):
    """An empty typed List of arrays like `example`."""
    out = List()
    out.append(example)
    out.pop()
    return out


@njit(cache=True)
def _append(out, array):
    out.append(array)


_NO_ROWS = np.empty((0, 4), np.int64)  # no swaps, as rebalance's rows


def _swaps(rows: np.ndarray) -> list[Swap]:
    """Rows (layer, slot, evicted or -1, loaded) as Swaps."""
    return [Swap(layer, slot, evicted if evicted >= 0 else None, loaded)
            for layer, slot, evicted, loaded in rows.tolist()]


# --- compiled bookkeeping (issue #4) --------------------------------------------------------------------------
# A decode step's placement work is a handful of comparisons over 128 scores, but as NumPy calls it was ~10 calls
# per layer (flatnonzero, argsort, partition, masks, add.at), each 5-10 µs with the caches cold after a kernel.
# These do the same work in one compiled call each, with the very same floating-point operations (decay multiply,
# += 1.0 in order, margin * score) and the same tie rules as the NumPy formulation (stable sorts: the lowest
# index / slot first), so the decisions are identical: tests/test_placement_fast.py checks them against the
# straightforward NumPy implementation (the reference kept in the methods' docstrings' terms) on random traces.
# rebalance's loop over the layers is one more (_rebalance_layers): tests/test_placement_rebalance.py checks it against
# the per-layer Python loop it replaced.

@njit(cache=True, nogil=True)
def _observe(scores, ids, decay, decaying, watch):
    """scores *= decay (when decaying); then scores[e] += 1.0 for every id e >= 0, in order (np.add.at). Returns
    the sum of watch[e] over those ids (SwapJudge's net hits)."""
    if decaying:
        for e in range(scores.size):
            scores[e] *= decay
    net = 0.0
    for i in range(ids.size):
        e = ids[i]
        if e >= 0:
            scores[e] += 1.0
            net += watch[e]
    return net


@njit(cache=True, nogil=True)
def _spare_slots(scores, slot_of, expert_in, admitted, busy, rule, num_slots):
    """PlacementPolicy.spare_slots. rule 0: wanted = resident and not admitted (base / static); rule 1: adaptive's
    wanted (resident, scored at least the num_slots-th best score, > 0; none when no resident is wanted; every
    resident when one is wanted per expert). num_slots: the wanted residents (PlacementPolicy.wanted_slots)."""
    E = slot_of.size
    S = expert_in.size
    bar = 0.0
    if rule == 1 and 0 < num_slots < E:
        bar = np.sort(scores)[E - num_slots]  # the num_slots-th largest value, as np.partition gives it
    free = np.ones(E, np.bool_)  # per expert: may be evicted now
    for e in range(E):
        if slot_of[e] >= 0:
            if rule == 0:
                wanted = not admitted[e]
            elif num_slots == 0:
                wanted = False
            elif num_slots >= E:
                wanted = True
            else:
                wanted = scores[e] >= bar and scores[e] > 0
            free[e] = not wanted
    for i in range(busy.size):
        e = busy[i]
        if e >= 0:
            free[e] = False
    out = np.empty(S, np.int64)
    n = 0
    for s in range(S):
        if expert_in[s] < 0:
            out[n] = s
            n += 1
    first = n
    for s in range(S):
        e = expert_in[s]
        if e >= 0 and free[e]:
            out[n] = s
            n += 1
    if n - first > 1:  # weakest first; insertion sort is stable (equal scores keep slot order)
        for i in range(first + 1, n):
            slot = out[i]
            key = scores[expert_in[slot]]
            j = i - 1
            while j >= first and scores[expert_in[out[j]]] > key:
                out[j + 1] = out[j]
                j -= 1
            out[j + 1] = slot
    return out[:n]


@njit(cache=True, nogil=True)
def _best_cold(scores, slot_of, taken, positive):
    """The cold expert with the highest score (lowest index on ties) not in `taken` (and > 0 when positive); -1."""
    best = -1
    for e in range(slot_of.size):
        if slot_of[e] >= 0 or taken[e]:
            continue
        if positive and not scores[e] > 0:
            continue
        if best < 0 or scores[e] > scores[best]:
            best = e
    return best


@njit(cache=True, nogil=True)
def _rebalance(scores, slot_of, expert_in, margin, max_swaps, limit, wanted, swaps):
    """AdaptivePlacement's safe point for one layer, in place on slot_of / expert_in. swaps [rows, 3] receives
    (slot, evicted or -1, loaded); returns the row count, at most `limit` (negative: no limit). Empty slots are
    filled first, up to `wanted` residents (best positive-scored cold experts, slots in order); then up to max_swaps
    of the best cold experts (chosen before any swap) each replace the weakest resident (the first in slot order on
    ties) while it scores more than margin times it."""
    E = slot_of.size
    S = expert_in.size
    fill = wanted
    for s in range(S):
        if expert_in[s] >= 0:
            fill -= 1
    fill = max(0, fill)
    n = 0
    taken = np.zeros(E, np.bool_)
    for s in range(S):
        if n == limit:
            return n
        if n == fill:
            break
        if expert_in[s] < 0:
            e = _best_cold(scores, slot_of, taken, True)
            if e < 0:
                break
            expert_in[s] = e
            slot_of[e] = s
            swaps[n, 0] = s
            swaps[n, 1] = -1
            swaps[n, 2] = e
            n += 1
    candidates = np.empty(max_swaps, np.int64)
    count = 0
    for k in range(max_swaps):
        e = _best_cold(scores, slot_of, taken, False)
        if e < 0:
            break
        candidates[count] = e
        taken[e] = True
        count += 1
    for k in range(count):
        if n == limit:
            break
        expert = candidates[k]
        weakest = -1
        for s in range(S):
            r = expert_in[s]
            if r >= 0 and (weakest < 0 or scores[r] < scores[weakest]):
                weakest = r
        if weakest < 0 or scores[expert] <= margin * scores[weakest] or scores[expert] <= 0:
            break
        slot = slot_of[weakest]
        slot_of[weakest] = -1
        expert_in[slot] = expert
        slot_of[expert] = slot
        swaps[n, 0] = slot
        swaps[n, 1] = weakest
        swaps[n, 2] = expert
        n += 1
    return n


@njit(cache=True, nogil=True)
def _all_resident(slot_of, num_slots):
    """LayerSlots.all_resident, worked out again: a slot per expert and every expert in one."""
    if num_slots < slot_of.size:
        return False
    for e in range(slot_of.size):
        if slot_of[e] < 0:
            return False
    return True


@njit(cache=True, nogil=True)
def _rebalance_layers(scores, slot_of, expert_in, wanted, first, limit, margin, max_swaps, paused, rows, shadow_rows,
                      spare_slot_of, spare_expert_in):
    """AdaptivePlacement.rebalance's layers in one call: scores / slot_of / expert_in typed Lists of each layer's
    arrays, wanted each layer's wanted residents. Layers in turn from `first`, _rebalance on each layer with slots
    and a cold expert, at most `limit` swaps in all (negative: no limit; once spent, no later layer is looked at).
    Paused: real swaps only fill empty slots, and _rebalance on copies of the slots (spare_*) gives the swaps the
    judge watches. rows / shadow_rows receive (layer, slot, evicted or -1, loaded) of the swaps made / watched;
    returns both counts."""
    count = len(expert_in)
    made = watched = 0
    for offset in range(count):
        index = (first + offset) % count
        left = limit - made if limit >= 0 else -1
        if left == 0:
            break
        layer_slot_of, layer_expert_in = slot_of[index], expert_in[index]
        if layer_expert_in.size == 0 or _all_resident(layer_slot_of, layer_expert_in.size):
            continue  # no cold expert to bring in
        n = _rebalance(scores[index], layer_slot_of, layer_expert_in, margin, 0 if paused else max_swaps, left,
                       wanted[index], rows[made:, 1:])
        rows[made:made + n, 0] = index
        made += n
        if paused:
            copy_slot_of = spare_slot_of[:layer_slot_of.size]
            copy_expert_in = spare_expert_in[:layer_expert_in.size]
            copy_slot_of[:] = layer_slot_of
            copy_expert_in[:] = layer_expert_in
            n = _rebalance(scores[index], copy_slot_of, copy_expert_in, margin, max_swaps, -1, wanted[index],
                           shadow_rows[watched:, 1:])
            shadow_rows[watched:watched + n, 0] = index
            watched += n
    return made, watched


def counts_any(counts: np.ndarray | None) -> bool:
    """A popularity file's row for a layer counts some expert: one left out (None) or all 0 tells static placement
    nothing (its opening measures the layer)."""
    return counts is not None and bool(np.any(counts > 0))


def make_policy(name: str, layers: list[LayerSlots], popularity: list[np.ndarray | None] | None = None
                ) -> PlacementPolicy:
    if name == "static":
        return StaticPlacement(layers, popularity)
    if name == "adaptive":
        policy = AdaptivePlacement(layers, judge=SwapJudge([layer.num_experts for layer in layers]))
        if popularity is not None:  # (a node the file leaves out starts from no counts)
            for index, counts in enumerate(popularity):
                if counts is not None:
                    policy.scores[index] = adaptive_scores([counts])[0]
        return policy
    raise ValueError(f"unknown placement '{name}'")


def adaptive_scores(counts: list[np.ndarray]) -> list[np.ndarray]:
    """Counts per layer × expert (a popularity file's, static placement's) as adaptive placement's starting scores:
    the most counted expert of a layer 1.0, as a hit this step scores; raw counts would outweigh its decayed hits (~10
    for an expert routed at every step) for as many steps as they take to decay. A file of shares (0.25) starts as one
    of counts does: its most counted expert 1.0 too (a row of 0 stays 0)."""
    return [np.asarray(row, dtype=np.float64) / (float(np.max(row, initial=0.0)) or 1.0) for row in counts]
