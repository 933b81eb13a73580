"""What else used this machine's CPUs while something was timed (a run record, a benchmark): the share of the CPUs'
time the hypervisor gave other guests (steal, /proc/stat; a virtual machine's only view of a busy host) and the share
that processes other than this one used. On the H200 machine the benchmarks' figures moved by several times within
minutes (benchmarks/RESULTS.md, forty-eighth session) with nothing in the results to tell a disturbed run from a quiet
one; a user comparing two runs' records has the same question.

    meter = HostLoadMeter()
    ...                       # the run, or the timings
    load = meter.read()       # HostLoad(steal=..., others=...), shares of the CPUs' time since the meter was made
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostLoad:
    steal: float   # share of all CPUs' time given to other guests (0 where the kernel does not count it)
    others: float  # share of all CPUs' time that processes other than this one used

    def describe(self) -> str:
        return f"steal {self.steal:.1%}, other processes {self.others:.1%} of the CPUs' time"

    def as_dict(self) -> dict:
        return {"host_steal_share": self.steal, "host_others_share": self.others}


def _total(times) -> float:
    """All CPUs' seconds in psutil's cpu_times (guest time is counted in user time already, as psutil counts it)."""
    return sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _busy(times) -> float:
    return _total(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "steal", 0.0)


def _own_seconds(times, children: bool) -> float:
    seconds = times.user + times.system
    return seconds + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0) if children else seconds


class HostLoadMeter:
    """The machine's and this process's CPU times when made; read() gives the shares since then. With `children`, the
    CPU time of this process's children that ended meanwhile (worker processes it waited for) counts as its own."""

    def __init__(self, children: bool = False):
        self._process, self._children = psutil.Process(), children
        self._machine, self._own = psutil.cpu_times(), self._process.cpu_times()

    def read(self) -> HostLoad:
        machine, own = psutil.cpu_times(), self._process.cpu_times()
        total = _total(machine) - _total(self._machine)
        if total <= 0:
            return HostLoad(0.0, 0.0)
        steal = getattr(machine, "steal", 0.0) - getattr(self._machine, "steal", 0.0)
        ours = _own_seconds(own, self._children) - _own_seconds(self._own, self._children)
        others = _busy(machine) - _busy(self._machine) - ours
        return HostLoad(max(0.0, steal) / total, min(1.0, max(0.0, others) / total))
