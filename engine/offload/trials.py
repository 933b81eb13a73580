"""A-B-A trials between ways of running decode, keeping the fastest (issue #4): the layer split (layer_split.py)
and where cold experts are computed (decode_path.py) are chosen this way, since which one wins depends on the model,
its routing and the machine.

A trial: the median seconds of `window` decode steps with the way in force, then, after `settle` steps (a re-plan's
copies, the dense graphs captured again), of `window` steps with each other way in turn, then of `window` steps with
the first again (A-B-A, or A-B-C-A with three ways). The way in force counts with the faster of its two windows: a
drift in the machine's speed during the trial then cannot favour another (separate processes on the H200 machine
differ by up to 1.5x). Another way is kept only when the fastest and `margin` faster than the preferred one, which
wins ties. The first trial starts after `first` decode steps (placement warms up), the next `recheck` decode steps
after the last one, as routing changes with the conversation; each trial that keeps the way in force doubles that
wait, up to `recheck_max`, since a trial costs switches and steps the slower way. Steps of more than one token
(prefill) are not counted and do not interrupt a trial.
"""

from __future__ import annotations

import statistics


class AbaTrials:
    def __init__(self, preferred: str, *others: str, first: int = 16, settle: int = 4, window: int = 12,
                 recheck: int = 512, recheck_max: int = 8192, margin: float = 0.05):
        self.preferred, self.ways = preferred, (preferred, *others)
        self.first, self.settle, self.window, self.margin = first, settle, window, margin
        self.recheck, self.recheck_max = recheck, max(recheck, recheck_max)
        self.wait = recheck                   # decode steps from one trial to the next
        self.choice = preferred               # the way in force
        self.measured: dict[str, float] = {}  # each way's median decode step seconds in the last finished trial
        self.trials = 0                       # finished trials
        self._skip = first                    # decode steps to let pass before the next sample
        self._queue: list[str] = []           # the ways this trial still measures, the one measured now first
        self._results: dict[str, float] = {}
        self._samples: list[float] = []
        self._before = preferred              # the way in force when the current trial began

    @property
    def first_trial_steps(self) -> int:
        """Decode steps from a fresh start to the end of the first trial: the first wait, the way in force's window,
        then each way's settling and window (the way in force again last)."""
        return self.first + self.window + len(self.ways) * (self.settle + self.window)

    @property
    def measuring(self) -> bool:
        """A trial is under way (its switches and windows are not to be disturbed)."""
        return bool(self._queue)

    @property
    def due(self) -> bool:
        """The next decode step counted starts a trial."""
        return not self._queue and not self._skip

    def hold(self, steps: int) -> None:
        """No trial starts for at least `steps` decode steps (the wait goes on where it is longer)."""
        self._skip = max(self._skip, steps)

    def step(self, seconds: float, tokens: int) -> str | None:
        """One step's seconds; the way to switch to now, or None to keep the one in force."""
        if tokens != 1:
            return None
        if self._skip:
            self._skip -= 1
            return None
        if not self._queue:  # a new trial: the way in force, each other way, the way in force again
            self._queue = [self.choice, *(way for way in self.ways if way != self.choice), self.choice]
            self._results = {}
            self._before = self.choice
        self._samples.append(seconds)
        if len(self._samples) < self.window:
            return None
        way, median = self._queue.pop(0), statistics.median(self._samples)
        self._results[way] = min(median, self._results.get(way, median))  # the faster of its windows
        self._samples = []
        if self._queue:
            self._skip = self.settle
            return self._use(self._queue[0])
        self.measured = dict(self._results)
        self.trials += 1
        fastest = min(self._results, key=self._results.get)
        faster = self._results[fastest] < (1.0 - self.margin) * self._results[self.preferred]
        chosen = fastest if faster else self.preferred
        self.wait = min(2 * self.wait, self.recheck_max) if chosen == self._before else self.recheck
        self._skip = self.wait
        return self._use(chosen)

    def _use(self, way: str) -> str | None:
        if way == self.choice:
            return None
        self.choice = way
        return way

    def state(self) -> dict:
        """For records and the GUI: the trials finished, what the last one measured (ms a decode step) and, while a
        trial runs, the way it times now (decode speed moves with it), else None."""
        return {"trials": self.trials, "measured_ms": {name: seconds * 1e3 for name, seconds in self.measured.items()},
                "measuring": self._queue[0] if self._queue else None}
