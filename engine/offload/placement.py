"""Which experts live in a layer's GPU slots.

Each expert node has a fixed number of slots. A policy sees the experts every step routes to and,
at safe points between steps, may ask to swap cold experts in. `static` fills the slots once
(from a popularity file or counts measured over a warm-up) and never moves; `adaptive` scores
every expert by exponentially decayed hits (recency with a memory of frequency) and swaps an
expert in only when its score beats the weakest resident's by a margin (hysteresis), at most a
few swaps per layer per safe point, so placement never thrashes.

Between safe points, a decode step's miss policy (miss_policy.py) may copy a missed expert into a
spare slot: an empty slot or one whose expert the placement does not want (static: anything it did
not choose itself; adaptive: a resident scored below the slots' worth of best scores). The policy is
told (admit), and keeps or evicts the expert at later safe points like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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

    def __post_init__(self):
        self.slot_of = np.full(self.num_experts, -1, np.int32)
        self.expert_in = np.full(self.num_slots, -1, np.int32)

    def resident(self) -> np.ndarray:
        return self.expert_in[self.expert_in >= 0]

    def place(self, slot: int, expert: int) -> int | None:
        evicted = int(self.expert_in[slot])
        if evicted >= 0:
            self.slot_of[evicted] = -1
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        return evicted if evicted >= 0 else None

    def resize(self, num_slots: int) -> list[int]:
        """Change the slot count keeping the first residents; returns the experts dropped."""
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

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        raise NotImplementedError

    def wanted(self, layer: int) -> np.ndarray:
        """A bool per expert: the placement wants it resident (base: what it placed itself)."""
        slots = self.layers[layer]
        return (slots.slot_of >= 0) & ~self.admitted[layer]

    def spare_slots(self, layer: int, busy: np.ndarray) -> np.ndarray:
        """Slots a missed expert may be copied into during a step: empty ones first, then those
        whose expert the placement does not want, weakest first; never one holding an expert in
        `busy` (routed this step: the device may be reading it)."""
        slots = self.layers[layer]
        occupant = slots.expert_in
        # per expert: may be evicted now (resident, not wanted, not routed this step); an empty slot's -1
        # reads the last expert's entry, and `occupied` masks it out
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
        """Fill empty slots with the best-scored experts (all policies)."""
        swaps = []
        for index, layer in enumerate(self.layers):
            order = np.argsort(-self.scores[index], kind="stable")
            wanted = [int(e) for e in order[:layer.num_slots] if layer.slot_of[e] < 0]
            for slot in np.flatnonzero(layer.expert_in < 0):
                if not wanted:
                    break
                expert = wanted.pop(0)
                layer.place(int(slot), expert)
                self._placed(index, expert)
                swaps.append(Swap(index, int(slot), None, expert))
        return swaps

    def rebalance(self) -> list[Swap]:
        return []


class StaticPlacement(PlacementPolicy):
    """Residents chosen once from popularity (counts per layer × expert); never moved."""

    def __init__(self, layers: list[LayerSlots], popularity: list[np.ndarray] | None = None):
        super().__init__(layers)
        if popularity is not None:
            for index, counts in enumerate(popularity):
                self.scores[index] = np.asarray(counts, dtype=np.float64).copy()

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        # Only fills slots that are still empty (e.g. no popularity file: the first steps decide).
        ids = expert_ids[expert_ids >= 0]
        np.add.at(self.scores[layer], ids, 1.0)


class AdaptivePlacement(PlacementPolicy):
    """Decayed hit counts per layer × expert; swaps with hysteresis at safe points.

    decay: weight kept per step (0.9 remembers ~10 steps: strong recency, as real routing has).
    margin: a cold expert must score this many times the weakest resident's score to swap in.
    max_swaps: swaps per layer per safe point (copies must never stall a decode step).
    """

    def __init__(self, layers: list[LayerSlots], decay: float = 0.9, margin: float = 1.5, max_swaps: int = 2):
        super().__init__(layers)
        self.decay, self.margin, self.max_swaps = decay, margin, max_swaps

    def wanted(self, layer: int) -> np.ndarray:
        """Residents scored at least the slot count's best score (ties count as wanted)."""
        slots, scores = self.layers[layer], self.scores[layer]
        if slots.num_slots == 0:
            return np.zeros(slots.num_experts, bool)
        if slots.num_slots >= slots.num_experts:
            return slots.slot_of >= 0
        bar = np.partition(scores, scores.size - slots.num_slots)[scores.size - slots.num_slots]
        return (slots.slot_of >= 0) & (scores >= bar) & (scores > 0)

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        scores = self.scores[layer]
        scores *= self.decay
        ids = expert_ids[expert_ids >= 0]
        np.add.at(scores, ids, 1.0)

    def rebalance(self) -> list[Swap]:
        swaps = []
        for index, layer in enumerate(self.layers):
            if layer.num_slots == 0:
                continue
            scores = self.scores[index]
            swaps += [Swap(index, s, None, e) for s, e in self._fill_empty(layer, scores)]
            cold = np.flatnonzero(layer.slot_of < 0)
            if cold.size == 0:
                continue
            candidates = cold[np.argsort(-scores[cold], kind="stable")][: self.max_swaps]
            for expert in candidates:
                residents = layer.expert_in[layer.expert_in >= 0]
                weakest = residents[np.argmin(scores[residents])]
                if scores[expert] <= self.margin * scores[weakest] or scores[expert] <= 0:
                    break
                slot = int(layer.slot_of[weakest])
                layer.place(slot, int(expert))
                swaps.append(Swap(index, slot, int(weakest), int(expert)))
        return swaps

    @staticmethod
    def _fill_empty(layer: LayerSlots, scores: np.ndarray) -> list[tuple[int, int]]:
        placed = []
        empty = np.flatnonzero(layer.expert_in < 0)
        if empty.size == 0:
            return placed
        cold = np.flatnonzero(layer.slot_of < 0)
        cold = cold[scores[cold] > 0]
        for slot, expert in zip(empty, cold[np.argsort(-scores[cold], kind="stable")]):
            layer.place(int(slot), int(expert))
            placed.append((int(slot), int(expert)))
        return placed


def make_policy(name: str, layers: list[LayerSlots], popularity: list[np.ndarray] | None = None) -> PlacementPolicy:
    if name == "static":
        return StaticPlacement(layers, popularity)
    if name == "adaptive":
        policy = AdaptivePlacement(layers)
        if popularity is not None:
            for index, counts in enumerate(popularity):
                policy.scores[index] = np.asarray(counts, dtype=np.float64) / max(1.0, float(np.max(counts)))
        return policy
    raise ValueError(f"unknown placement '{name}'")
