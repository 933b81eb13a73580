"""Which other processes compete with this one, from a walk of every process (no Qt here).

A process's CPU between two walks is the growth of its own CPU time plus that of the children it waited for (psutil's
children_user/children_system), less what the walk before had counted for those children while they lived. So the
compilers a build starts and ends between two walks (make -j's cc1, cargo's rustc) count toward the long-lived process
that waited for them; they were never named when each process needed two walks of its own to have a CPU figure.
The busy processes are then grouped by process group (a build's make and every job it started share one), named by
its leader (or by the one busy process a leader that works less only waits for: timeout's, nohup's), and only
processes allowed on this process's CPUs count: a build pinned to other cores does not compete.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from engine.nvml import describe

ATTRS = ["name", "ppid", "cpu_times", "memory_info", "create_time"]


@dataclass
class _Seen:
    created: float
    ppid: int
    total: float  # CPU seconds: its own and its waited-for children's


def _total(times) -> float:
    return times.user + times.system + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (OSError, AttributeError):  # gone, or not a POSIX system
        return None


def _allowed(proc: psutil.Process, ours: set[int]) -> bool:
    """Whether `proc` may run on one of this process's CPUs (True where its affinity cannot be read)."""
    try:
        return bool(set(proc.cpu_affinity()) & ours)
    except (psutil.Error, AttributeError, OSError):
        return True


class ProcessWalk:
    """walk() gives (the top other process groups by CPU, the top other processes by resident memory), the CPU
    averaged since the walk before; the first walk only learns which processes there are."""

    def __init__(self, me: int):
        self.me = me
        self.own_group = _pgid(me)
        self._seen: dict[int, _Seen] = {}
        self._at, self._walked = time.monotonic(), False

    def walk(self, ours: set[int]) -> tuple[list[dict], list[dict]]:
        now = time.monotonic()
        seen, rows = {}, {}
        for proc in psutil.process_iter(ATTRS):
            info = proc.info
            if proc.pid == self.me or info.get("cpu_times") is None or info.get("create_time") is None:
                continue
            total, created = _total(info["cpu_times"]), info["create_time"]
            before = self._seen.get(proc.pid)
            if before is not None and before.created == created:
                used = total - before.total
            else:  # not there at the walk before (which saw every process): all its time is new; at the first, none
                used = total if self._walked else 0.0
            seen[proc.pid] = _Seen(created, info.get("ppid") or 0, total)
            memory = info.get("memory_info")
            rows[proc.pid] = {"pid": proc.pid, "name": info.get("name") or f"pid {proc.pid}", "used": used,
                              "rss": memory.rss if memory else 0, "created": created, "proc": proc}
        for pid, gone in self._seen.items():
            if pid in seen and seen[pid].created == gone.created:
                continue
            # an ended process's whole time lands in the children times of the living ancestor that waited for it
            # (through parents that ended too); its time until the walk before was counted already
            ancestor = gone.ppid
            while ancestor not in rows and ancestor in self._seen:  # (one walk's parents: a tree)
                ancestor = self._seen[ancestor].ppid
            if ancestor in rows:
                rows[ancestor]["used"] -= gone.total
        elapsed = max(now - self._at, 1e-3)
        self._seen, self._at, self._walked = seen, now, True
        cpus = psutil.cpu_count() or 1
        for row in rows.values():
            # (at most every CPU: a process reparented before it ended is waited for by another, whose children
            # times then take what was counted for it already)
            row["cores"] = min(cpus, max(0.0, row.pop("used")) / elapsed)
        by_cpu = self._groups([r for r in rows.values() if r["cores"] >= 0.01 and _allowed(r["proc"], ours)], rows)
        by_ram = sorted(rows.values(), key=lambda r: -r["rss"])[:5]
        for row in by_ram[:3]:  # the names a warning may show
            row["name"] = describe(row["proc"], row["name"])
        return by_cpu, [{k: v for k, v in r.items() if k in ("pid", "name", "cores", "rss")} for r in by_ram]

    def _groups(self, busy: list[dict], rows: dict[int, dict]) -> list[dict]:
        """The busy processes by process group (this process's own group's members and group 0's each alone), the
        busiest first, each named by its group's leader where it lives, else by its oldest busy member."""
        groups: dict[object, list[dict]] = {}
        for row in busy:
            group = _pgid(row["pid"])
            # (group 0: the kernel's threads, and what init started without a group of its own)
            groups.setdefault(row["pid"] if group in (None, 0, self.own_group) else group, []).append(row)
        named = []
        for key, members in sorted(groups.items(), key=lambda item: -sum(r["cores"] for r in item[1]))[:5]:
            leader = rows.get(key)  # the group's leader (busy or not), or the lone process itself
            head = leader or min(members, key=lambda r: r["created"])
            rest = [r for r in members if r is not head]
            if leader and len(rest) == 1 and rest[0]["cores"] > leader["cores"]:
                # a leader that only waits for the one process that works (timeout, nohup, a shell): that one named
                head, rest = rest[0], []
                name = f"{describe(head['proc'], head['name'])} (started by {describe(leader['proc'], leader['name'])})"
            else:
                name = describe(head["proc"], head["name"])
            if rest:
                name += (f" and {len(rest)} process{'es' if len(rest) > 1 else ''} "
                         + ("it started" if leader else "more"))
            named.append({"pid": head["pid"], "name": name, "cores": sum(r["cores"] for r in members),
                          "rss": sum(r["rss"] for r in members)})
        return named
