"""Whether the expert budget is spread over every layer or spent on whole layers, chosen by measuring both (issue #4).

The planner spreads the budget evenly, as onnxruntime's offload does: every layer keeps some experts resident, and
where routing repeats recent experts most of a token's experts are hits in every layer. But every layer then takes the
hybrid path: its inputs come to the host, the miss policy decides, the CPU computes the misses and the result goes
back to the device, some hundreds of µs of host work a layer on the H200 machine. A layer that keeps all its experts
runs all on the device with no host round trip; a layer with none runs all on the CPU. Where routing has little
locality (random weights; nearly uniform routers) the spread's hit rate is only its slot fraction, and whole layers
decoded 1.14-1.66x faster on the H200 machine; with real-like routing the spread was as fast or faster (RESULTS.md,
twentieth session). Which one wins depends on the model, the routing and the machine, so the engine measures it.

A trial: the median seconds of `window` decode steps with the split in force, then, after `settle` steps (the
re-planned residents' copies, the dense graphs captured again), of `window` steps with the other, then of `window`
steps with the first again (A-B-A). The split in force counts with the faster of its two windows; whole layers are
kept only when `margin` faster than the spread (the spread is onnxruntime's way and follows routing's locality: it
wins ties). The second window of the split in force comes after the other's: a drift in the machine's speed during
the trial (separate processes on the H200 machine differ by up to 1.5x) then cannot favour the other, and the
spread's second window comes after adaptive placement has learnt the routing for longer (its scores go on learning
under whole layers too, and a re-plan fills the slots by them). On the H200 machine a trial under a realistic trace
chose whole layers where the spread decoded faster in other runs (RESULTS.md, twenty-first session): a first window
caught in a slow spell or with placement still moving to the trace's experts is the likely reason, not confirmed.
The first trial starts after `first` decode steps (placement warms up), the next `recheck` decode steps after the
last one, as routing changes with the conversation; each trial that keeps the split in force doubles that wait, up
to `recheck_max`, since a trial costs two re-plans, three where it switches (the residents copied again: ~0.1-0.3 s
for Qwen3-30B-A3B-like at half residency), and steps the slower way. Steps of more than one token (prefill) are not
counted and do not interrupt a trial. On the simulated device the step times compared are those projected for the
card it simulates (OffloadEngine._trial_seconds, projection.py): its wall time computes the "device" experts on the
CPU.
"""

from __future__ import annotations

import os
import statistics

from engine.errors import WorkbenchError

SPREAD, WHOLE = "spread", "whole"
MODES = ("auto", SPREAD, WHOLE)  # auto: trials decide; spread / whole: that split, no trials
BOTH = (SPREAD, WHOLE)  # a budget sweep's splits where it compares them (engine/records/sweep.py)


def checked_split(mode: str) -> str:
    """`mode` if it is one of MODES; else a WorkbenchError naming it."""
    if mode not in MODES:
        raise WorkbenchError(f"layer split '{mode}': one of {', '.join(MODES)}")
    return mode


def default_layer_split() -> str:
    """The split an engine takes when none is asked for: MOE_LAYER_SPLIT (benchmarks' A/Bs, the test suite), else
    auto."""
    return os.environ.get("MOE_LAYER_SPLIT", "auto")


class LayerSplitTrials:
    def __init__(self, first: int = 16, settle: int = 4, window: int = 12, recheck: int = 512,
                 recheck_max: int = 8192, margin: float = 0.05):
        self.first, self.settle, self.window, self.margin = first, settle, window, margin
        self.recheck, self.recheck_max = recheck, max(recheck, recheck_max)
        self.wait = recheck                   # decode steps from one trial to the next
        self.split = SPREAD
        self.measured: dict[str, float] = {}  # each split's median decode step seconds in the last finished trial
        self.trials = 0                       # finished trials
        self._skip = first                    # decode steps to let pass before the next sample
        self._queue: list[str] = []           # the splits this trial still measures, the one measured now first
        self._results: dict[str, float] = {}
        self._samples: list[float] = []
        self._before = SPREAD                 # the split in force when the current trial began

    def step(self, seconds: float, tokens: int) -> str | None:
        """One step's seconds; the split to re-plan to now, or None to keep the one in force."""
        if tokens != 1:
            return None
        if self._skip:
            self._skip -= 1
            return None
        if not self._queue:  # a new trial: the split in force, the other, the split in force again
            other = WHOLE if self.split == SPREAD else SPREAD
            self._queue = [self.split, other, self.split]
            self._results = {}
            self._before = self.split
        self._samples.append(seconds)
        if len(self._samples) < self.window:
            return None
        split, median = self._queue.pop(0), statistics.median(self._samples)
        self._results[split] = min(median, self._results.get(split, median))  # the faster of its windows
        self._samples = []
        if self._queue:
            self._skip = self.settle
            return self._use(self._queue[0])
        self.measured = dict(self._results)
        self.trials += 1
        faster = self._results[WHOLE] < (1.0 - self.margin) * self._results[SPREAD]
        chosen = WHOLE if faster else SPREAD
        self.wait = min(2 * self.wait, self.recheck_max) if chosen == self._before else self.recheck
        self._skip = self.wait
        return self._use(chosen)

    def _use(self, split: str) -> str | None:
        if split == self.split:
            return None
        self.split = split
        return split

    def state(self) -> dict:
        """For records and the GUI: the trials finished, what the last one measured (ms a decode step) and, while a
        trial runs, the split it times now (decode speed moves with it), else None."""
        return {"trials": self.trials, "measured_ms": {name: seconds * 1e3 for name, seconds in self.measured.items()},
                "measuring": self._queue[0] if self._queue else None}
