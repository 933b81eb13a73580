"""The CPU expert kernels' thread count: fixed, or automatic (cpu_threads=0): every core this process may use, less
the cores other processes keep busy.

A kernel call forks its threads and joins them. A thread that shares its core with someone else's busy process is
preempted for a scheduler tick (4 ms at 250 Hz) and the call's other threads wait for it at the join. On the 2-core
dev VM beside one busy process, a Qwen3-30B-A3B-like node of eight experts took 2.82 ms a call on average on both
cores (p90 8.0 ms) and 2.29 ms under this count (p90 2.4 ms; alone, on both, 0.92 ms); a 4-layer model of that shape
decoded 1.14-1.66x as many tokens a second under it as on both cores beside one or two busy processes
(benchmarks/bench_kernel_threads.py; RESULTS.md, "Forty-ninth session").

So in automatic mode the count follows the cores the others leave. At a safe point between decoder steps, once
`window_s` has passed, the other processes' share of all CPUs' time over the window (engine/host_load.py) is read as
busy CPUs of the machine, rounded, and the count is the CPUs they leave, at most the kernels' cores (fewer than the
machine's under NUMBA_NUM_THREADS or an affinity: a share of all CPUs read against those alone took a build on 8 of
16 CPUs for 2 of 4 busy). The count changes when two windows in a row ask for the same new count: a burst of a few
hundred milliseconds moves nothing. Rounding, not ceiling: a process that would keep a core busy shows as 0.55-0.85
of one while two threads of ours compete with it on two cores (1.0 once we leave it the core), and a desktop's
background of a few tenths of a core should cost no thread.

Decoders of this process that step at the same time (a side-by-side chat answered at once) share what is left: each
automatic count takes an equal part of those cores. Their own threads are not "other processes", and two OpenMP pools
each as large as the machine throttle each other (README).

The VM host's steal time is not counted: fewer threads do not keep the hypervisor from pausing a vCPU mid-call.
"""

from __future__ import annotations

import math
import threading
import time
import weakref

import numba
import psutil

from engine.host_load import HostLoadMeter, our_cpus
from engine.ort_env import cpu_threads

WINDOW_S = 0.5  # how often the automatic count looks at the other processes' load
STALE_WINDOWS = 4  # a window this many times as long spans a pause between turns: the past, not judged

_counts: "weakref.WeakSet[KernelThreads]" = weakref.WeakSet()  # every count of this process (its decoders')
_counts_lock = threading.Lock()


def threads_for(cores: int, others_share: float) -> int:
    """The kernels' threads on `cores` cores while other processes use `others_share` of all their time."""
    return max(1, cores - math.floor(others_share * cores + 0.5))


class KernelThreads:
    """Sets the thread count of every runner's CPU kernel (`runner.kernel.num_threads`): a fixed count, or the
    automatic one (module docstring), which `step_ended` moves at safe points."""

    def __init__(self, runners, requested: int = 0, cores: int | None = None, meter=HostLoadMeter,
                 clock=time.monotonic, window_s: float = WINDOW_S):
        self.runners = list(runners)
        self.cores = cores or min(cpu_threads(), numba.config.NUMBA_NUM_THREADS)  # the most the kernels can take
        # the CPUs this process may run on, whose time the meter's shares are of
        self.cpus = max(self.cores, len(our_cpus(psutil.cpu_count() or 1)))
        self._new_meter, self._clock, self.window_s = meter, clock, window_s
        self.others_cores = 0.0  # cores the other processes kept busy in the last window (automatic mode)
        self.changes = 0  # times the automatic count moved
        self.last_step = None  # the clock at the last step's end (automatic mode)
        self.requested = None
        self.request(requested)
        with _counts_lock:
            _counts.add(self)

    @property
    def automatic(self) -> bool:
        return self.requested == 0

    def request(self, count: int) -> None:
        """`count` threads from now on (at most the cores: the kernels run no more); 0: automatic, starting from every
        core. The count asked for already: nothing changes (a budget change on a loaded model asks again)."""
        if count == self.requested:
            return
        self.requested = count
        self._asked = None  # a new count the last window asked for (automatic mode)
        self._window = (self._new_meter(), self._clock()) if count == 0 else None
        self._apply(min(count, self.cores) if count else self.cores)

    def step_ended(self) -> None:
        """A safe point: in automatic mode, the count follows the other processes' load of the last window."""
        if self._window is None:
            return
        meter, since = self._window
        now = self.last_step = self._clock()
        if now - since < self.window_s:
            return
        self._window = (self._new_meter(), now)
        if now - since > STALE_WINDOWS * self.window_s:
            self._asked = None  # (what the turn before asked for is as old)
            return
        wanted = self._wanted(meter.read().others, now)
        if wanted != self.in_force and wanted == self._asked:
            self._apply(wanted)
            self.changes += 1
        self._asked = wanted if wanted != self.in_force else None

    def settle(self, sleep=time.sleep) -> float:
        """Before a timed run, in automatic mode: the count the other processes' load asks for, read over one window
        while this process waits, and put in force at once; the steps' windows move it on from there. Returns the
        seconds waited: 0 for a fixed count, and where steps ended within the last few windows (a sweep's runs one
        after another), whose windows have kept the count following the load. A record's turns otherwise ran on every
        core beside a busy process: on the 2-core dev VM its multiturn turns decoded at 180-711 tokens a second against
        1155-1223 settled (RESULTS.md, fifty-first session). With this process idle, a busy process shows as the whole
        core it takes."""
        if not self.automatic or (self.last_step is not None
                                  and self._clock() - self.last_step <= STALE_WINDOWS * self.window_s):
            return 0.0
        meter = self._new_meter()
        sleep(self.window_s)
        wanted = self._wanted(meter.read().others, self._clock())
        if wanted != self.in_force:
            self._apply(wanted)
            self.changes += 1
        self._asked = None
        self._window = (self._new_meter(), self._clock())
        return self.window_s

    def _wanted(self, others: float, now: float) -> int:
        """The count a window in which other processes used `others` of the CPUs' time asks for (noted in
        others_cores), shared with this process's decoders stepping at the same time."""
        self.others_cores = others * self.cpus
        left = threads_for(self.cpus, others) // (1 + self._decoding_beside(now))
        return max(1, min(self.cores, left))

    def _decoding_beside(self, now: float) -> int:
        """This process's other automatic counts whose decoders ended a step within the last window."""
        with _counts_lock:
            counts = list(_counts)
        return sum(1 for count in counts if count is not self and count.automatic and count.last_step is not None
                   and 0 <= now - count.last_step < self.window_s)

    def state(self) -> dict:
        """For the statistics and the records."""
        return {"cpu_threads_in_force": self.in_force, "cpu_threads_automatic": self.automatic, "cores": self.cores,
                "others_busy_cores": self.others_cores, "cpu_threads_changes": self.changes}

    def _apply(self, count: int) -> None:
        self.in_force = count
        for runner in self.runners:
            runner.kernel.num_threads = count
