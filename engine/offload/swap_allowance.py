"""How many placement swaps a safe point may make.

A swap is host work that the next decode step waits for: the expert is packed into the GPU kernels' layout and
staged before its copy starts (CudaSlots.load; 75-200 ms for a gpt-oss-20b expert with NumPy packing). The
adaptive policy proposes up to two swaps per layer per step, and with routing that spreads evenly it keeps
proposing them: on the H200 a sweep point with a third of the experts resident decoded 9x slower than all-CPU.
So swaps get a share of decode time, like a token bucket: each step adds SHARE x its duration, each swap spends
its measured seconds, and a step may bank at most BURST swaps' worth (or one step's share, if larger).
"""

from __future__ import annotations

SHARE = 0.1
BURST = 4
SMOOTHING = 0.5  # weight of the newest measured swap in the running cost


class SwapAllowance:
    def __init__(self, share: float = SHARE, burst: int = BURST):
        self.share, self.burst = share, burst
        self.balance_s = 0.0
        self.cost_s: float | None = None  # seconds per swap, once one was measured

    def grant(self, step_s: float) -> int | None:
        """Swaps the safe point after a step of `step_s` seconds may make (None: no limit, while swaps cost
        nothing measurable). Before the first measured swap, one at most: its cost is unknown."""
        earned = self.share * max(step_s, 0.0)
        if self.cost_s is None:
            self.balance_s = min(self.balance_s + earned, earned)
            return 1
        if self.cost_s <= 0.0:
            return None
        self.balance_s = min(self.balance_s + earned, max(self.burst * self.cost_s, earned))
        return max(0, int(self.balance_s // self.cost_s))

    def spent(self, seconds: list[float]) -> None:
        """The swaps made, with each one's measured host seconds."""
        for s in seconds:
            self.balance_s -= s
            self.cost_s = s if self.cost_s is None else (1 - SMOOTHING) * self.cost_s + SMOOTHING * s
