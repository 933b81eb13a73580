"""Whether adaptive placement's swaps pay for their copies (issue #4).

A swap copies an expert into a slot and evicts another; it pays when, in the decode steps that follow, routing hits
the expert brought in more often than the one sent out. On routing with recency (anchors.md: real routing) it does;
on uniform routing (a model with random weights, or a conversation without any structure) the expert brought in is
no likelier to come back than the one evicted, and every swap is a copy and host work for nothing: on the H200
machine adaptive placement ran 0.78x / 0.91x static placement's decode at Qwen3-30B-A3B-like's 25 / 50% under
uniform routing, with 1-3 points more hit rate (RESULTS.md, thirty-third session).

So each swap is watched for `window` safe points: the hits its loaded expert takes less the hits its evicted expert
takes (misses now). The net hits of all watched swaps, over the watched swaps' time in windows (each counts 1 /
window a safe point while watched, so a swap too recent to have earned anything weighs as little), both decayed by
`memory` per safe point, give the net hits a swap earns in its window. Below `pays` (one hit, about what a swap's
copy costs against a miss) placement stops making swaps, and goes on watching the swaps it would have made, so it
takes them up again once routing turns predictable. Filling empty slots is never judged: it evicts nothing.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numba import njit


class SwapJudge:
    def __init__(self, num_experts: list[int], window: int = 16, pays: float = 1.0, memory: float = 1 / 64,
                 evidence: float = 8.0):
        self.window, self.pays, self.memory, self.evidence = window, pays, memory, evidence
        # per layer and expert: +1 for each watched swap that loaded it, -1 for each that evicted it; routing's hits
        # on it count that many net hits (placement's compiled observe adds them up); the layers' rows of one table,
        # which a safe point's swaps are counted into in one compiled call
        self._table = np.zeros((len(num_experts), max(num_experts, default=0)))
        self.watch = [self._table[layer, :count] for layer, count in enumerate(num_experts)]
        self._watched: deque[tuple[int, np.ndarray, int]] = deque()  # (safe point, its swaps' rows, those evicting)
        self._watching = 0  # the swaps in _watched
        self._point = 0
        self.step_net = 0.0  # net hits since the last safe point (observe adds to it)
        self._net = 0.0  # decayed sums over the safe points: net hits on watched experts, windows watched
        self._windows = 0.0
        self.paused = False  # placement makes no swaps (it still fills empty slots)

    @property
    def net_hits_per_swap(self) -> float | None:
        """What a swap earned lately in its window, in hits; None until `evidence` windows were watched."""
        return self._net / self._windows if self._windows >= max(self.evidence, 1e-9) else None

    def safe_point(self, swaps: np.ndarray) -> None:
        """A safe point's swaps (made, or while paused the ones placement would have made), as rows (layer, slot,
        evicted or -1, loaded) like AdaptivePlacement.rebalance's (read now, not kept): watched from now; the watches
        `window` points old end; the verdict for the next point."""
        self._point += 1
        keep = 1.0 - self.memory  # the steps since the last point: the swaps watched then took these net hits
        self._net = keep * self._net + self.step_net
        self._windows = keep * self._windows + self._watching / self.window
        self.step_net = 0.0
        while self._watched and self._watched[0][0] <= self._point - self.window:
            _, ended, watching = self._watched.popleft()
            _watch(self._table, ended, -1.0)
            self._watching -= watching
        swaps = np.array(swaps, np.int64).reshape(-1, 4)  # a copy: placement writes its rows again next time
        watching = _watch(self._table, swaps, 1.0)
        if watching:
            self._watched.append((self._point, swaps, watching))
            self._watching += watching
        earned = self.net_hits_per_swap
        self.paused = earned is not None and earned < self.pays

    def state(self) -> dict:
        """For records and the GUI: whether swaps are paused and what a swap earned lately (hits, None unknown)."""
        return {"swaps_paused": self.paused, "net_hits_per_swap": self.net_hits_per_swap}


@njit(cache=True, nogil=True)
def _watch(table, swaps, sign):
    """For each of `swaps` (layer, slot, evicted or -1, loaded) that evicts (a fill is not watched):
    table[layer, loaded] += sign and table[layer, evicted] -= sign (sign -1: its watch ends); returns how many evict.
    Runs at every decode step's end, while the GPU idles, and a paused judge watches up to max_swaps swaps per layer:
    one call, not a few Python operations per swap."""
    evicting = 0
    for i in range(swaps.shape[0]):
        layer, evicted, loaded = swaps[i, 0], swaps[i, 2], swaps[i, 3]
        if evicted >= 0:
            table[layer, loaded] += sign
            table[layer, evicted] -= sign
            evicting += 1
    return evicting
