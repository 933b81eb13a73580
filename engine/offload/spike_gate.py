"""The CPU parts of "both" steps, passed to the split's rate a step at a time, without a short slowdown's steps.

The split's table (kernels/cold_split.py) comes from the CPU parts' own rate (OffloadEngine.split_rate, a CpuRate),
and that rate remembers little more than the last step's calls (48 calls a step on Qwen3-30B-A3B-like against a fit
that keeps 0.98 of the past per call). A few steps slowed by something else on the machine were enough to collapse
the table for good (H200 machine, Qwen3-30B-A3B-like at 25% resident, RESULTS.md "Forty-fourth session"): CPU parts
of 2.3x their usual time made a slower rate, the next table gave the CPU fewer experts, and calls of one expert
each, whose threads fall asleep between them, then measured slow themselves and kept the table at a pair or two:
19 ms steps against 12.7 before, long after the slowdown ended.

So a step's calls wait here until the step ends. A step whose CPU parts took more than `ratio` times what the rate
predicts for them is held back; if `steps` such steps come in a row, the machine did slow down and the rate follows
them all; a step of usual speed drops what was held. Faster steps always count.
"""

from __future__ import annotations

from engine.offload.miss_policy import CpuRate

SPIKE_RATIO = 1.5  # a step slower than this, against the rate's prediction, is held back (steady steps: 0.8-1.25)
SPIKE_STEPS = 8  # ... until this many come in a row (~0.1 s of decode on the H200 machine)


class SpikeGate:
    def __init__(self, rate: CpuRate, ratio: float = SPIKE_RATIO, steps: int = SPIKE_STEPS):
        self.rate, self.ratio, self.steps = rate, ratio, steps
        self._step: list[tuple[int, float]] = []  # this step's calls: (bytes of experts, seconds)
        self._held: list[tuple[int, float]] = []  # the slow steps' calls in a row so far
        self._slow_in_row = 0
        self.left_out = 0  # slow steps whose calls the rate never counted (the slowdown did not last)

    def observe(self, nbytes: int, seconds: float) -> None:
        self._step.append((nbytes, seconds))

    def end_step(self) -> None:
        """The step's calls to the rate, unless it was slow against the rate's prediction (see the module)."""
        calls, self._step = self._step, []
        if not calls:
            return
        if self._slower_than_predicted(calls):
            self._held.extend(calls)
            self._slow_in_row += 1
            if self._slow_in_row < self.steps:
                return
            calls = self._held  # the slowdown lasted: the rate follows it
        elif self._slow_in_row:
            self.left_out += self._slow_in_row
        self._held, self._slow_in_row = [], 0
        self.rate.observe_many(calls)

    def _slower_than_predicted(self, calls: list[tuple[int, float]]) -> bool:
        bytes_per_s = self.rate.value
        if bytes_per_s is None:  # nothing to predict with yet
            return False
        predicted = len(calls) * self.rate.fixed_s + sum(nbytes for nbytes, _ in calls) / bytes_per_s
        return sum(seconds for _, seconds in calls) > self.ratio * predicted
