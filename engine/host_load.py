"""What else used this process's CPUs (those its affinity allows) while something was timed (a run record, a
benchmark): the share of their time the hypervisor gave other guests (steal, /proc/stat; a virtual machine's only view
of a busy host) and the share that processes other than this one used. On the H200 machine the benchmarks' figures
moved by several times within minutes (benchmarks/RESULTS.md, forty-eighth session) with nothing in the results to
tell a disturbed run from a quiet one; a user comparing two runs' records has the same question.

    meter = HostLoadMeter()
    ...                       # the run, or the timings
    load = meter.read()       # HostLoad(steal=..., others=...), shares of the CPUs' time since the meter was made
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostLoad:
    steal: float   # share of our CPUs' time given to other guests (0 where the kernel does not count it)
    others: float  # share of our CPUs' time that processes other than this one used

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


ONLINE_CPUS = "/sys/devices/system/cpu/online"


def cpu_numbers(count: int) -> list[int]:
    """The CPU number of each of psutil's `count` per-CPU entries. psutil promises only that their order stays the same
    across calls; on Linux they are /proc/stat's cpuN lines with N dropped, which the kernel writes for the online CPUs
    in ascending order: with CPU 2 offline the third entry is CPU 3. Where the online list cannot be read or does not
    match (not Linux; a CPU going on- or offline between the two reads): entry i is CPU i."""
    try:
        with open(ONLINE_CPUS, encoding="ascii") as file:
            text = file.read().strip()
        numbers = []
        for part in text.split(","):  # "0-1,3-7"
            first, _, last = part.partition("-")
            numbers.extend(range(int(first), int(last or first) + 1))
    except (OSError, ValueError):
        return list(range(count))
    return numbers if len(numbers) == count else list(range(count))


def our_cpus(count: int) -> list[int]:
    """The indices into psutil's per-CPU lists (`count` entries) of the CPUs this process may run on (its affinity,
    which names CPUs by number): all where the system cannot say."""
    try:
        allowed = os.sched_getaffinity(os.getpid())
    except (AttributeError, OSError):  # (not Linux)
        return list(range(count))
    return [index for index, cpu in enumerate(cpu_numbers(count)) if cpu in allowed] or list(range(count))


def _our_times() -> dict:
    """psutil's times of the CPUs this process may run on, by CPU number."""
    per_cpu = psutil.cpu_times(percpu=True)
    numbers = cpu_numbers(len(per_cpu))
    return {numbers[index]: per_cpu[index] for index in our_cpus(len(per_cpu))}


def _summed(times):
    """CPUs' times summed field by field."""
    times = list(times)
    return type(times[0])._make(map(sum, zip(*times)))


class HostLoadMeter:
    """The CPU times of the CPUs this process may run on (its affinity: a build pinned to the others does not compete)
    and this process's, when made; read() gives the shares since then. With `children`, the CPU time of this process's
    children that ended meanwhile (worker processes it waited for) counts as its own."""

    def __init__(self, children: bool = False):
        self._process, self._children = psutil.Process(), children
        self._start, self._own = _our_times(), self._process.cpu_times()

    def read(self) -> HostLoad:
        now, own = _our_times(), self._process.cpu_times()
        cpus = self._start.keys() & now.keys()  # (a CPU put on- or offline meanwhile: not one of both reads)
        if not cpus:
            return HostLoad(0.0, 0.0)
        machine, start = _summed(now[cpu] for cpu in cpus), _summed(self._start[cpu] for cpu in cpus)
        total = _total(machine) - _total(start)
        if total <= 0:
            return HostLoad(0.0, 0.0)
        steal = getattr(machine, "steal", 0.0) - getattr(start, "steal", 0.0)
        ours = _own_seconds(own, self._children) - _own_seconds(self._own, self._children)
        others = _busy(machine) - _busy(start) - ours
        return HostLoad(max(0.0, steal) / total, min(1.0, max(0.0, others) / total))
