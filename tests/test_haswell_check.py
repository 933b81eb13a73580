"""The Haswell check's processes (tests/haswell_check.py: the warming process and the check it starts) end with the
pytest process that started them, however it ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests.haswell_check import ROOT

STARTER = """
import time
from tests import haswell_check
check = haswell_check.Check(warm=("no-such-part",))  # warms nothing: starts the check at once
print(check._process.pid, flush=True)
time.sleep(120)
"""


def _alive(group: int) -> list[psutil.Process]:
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (psutil.Error, ProcessLookupError):
            pass
    return alive


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_checks_processes_end_with_a_killed_pytest():
    """pytest killed (a CI time limit, a closed terminal) finishes no session: the check's processes, in a session of
    their own, went on compiling kernels on a core for minutes."""
    starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    group = int(starter.stdout.readline())
    try:
        assert _wait(lambda: len(_alive(group)) == 2, 60)  # the warming process and the check it started
        starter.kill()
        starter.wait()
        assert _wait(lambda: not _alive(group), 20), [p.cmdline() for p in _alive(group)]
    finally:
        starter.kill()
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
