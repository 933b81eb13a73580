"""A burst of other work on every core, at a moment a benchmark chooses: what a build or a document indexer does to a
decode for a while (issue #4: the engine must recover from it).

Each of `processes` child processes allocates its buffer and waits; `start()` releases them all at once, and each
then sums its buffer over and over (streaming host memory, one core busy) for `ms` milliseconds and exits.

    with CompetingLoad(processes=16, ms=100) as load:
        ...                  # the children are ready
        load.start()         # the burst begins now
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys, time
import numpy as np
buffer = np.ones({floats}, np.float64)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.read(1)
end = time.perf_counter() + {seconds}
while time.perf_counter() < end:
    buffer.sum()
"""


class CompetingLoad:
    def __init__(self, processes: int, ms: float, buffer_mb: int = 64):
        code = CHILD.format(floats=buffer_mb * (1 << 20) // 8, seconds=ms / 1e3)
        self.started = False
        self.children = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        for child in self.children:  # each has its buffer: start() costs the children no set-up
            if child.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("a competing-load child process did not start")

    def start(self) -> None:
        self.started = True
        for child in self.children:
            child.stdin.write("x")
            child.stdin.flush()

    def close(self) -> list[int]:
        """Waits for the children (after start(), their burst's end; else they are stopped); their exit codes."""
        for child in self.children:
            if not self.started:
                child.kill()
            child.stdin.close()
        codes = []
        for child in self.children:
            codes.append(child.wait())
            child.stdout.close()
        return codes

    def __enter__(self) -> "CompetingLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
