"""The Haswell check's processes (tests/haswell_check.py: the warming process and the check it starts): started by
conftest.py only where the check's test runs, warming only for a run of the whole suite; ended with the pytest process
that started them, however it ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

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


PROBE = """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    from tests import haswell_check

    check = haswell_check.running
    print("started:", "none" if check is None else "warm" if "--warm-first" in check._process.args else "check")
"""
# a suite of two files, run as the whole suite is (testpaths, no paths given)
SUITE = ["-o", "testpaths=tests/test_qmoe_cpu.py tests/test_cuda_pool_limit.py"]


@pytest.mark.parametrize("options, started", [
    ([], "warm"),
    (["-k", "pool_limit"], "none"),  # the check's test deselected
    (["--deselect", "tests/test_cuda_pool_limit.py"], "check"),  # not the whole suite
    (["tests/test_qmoe_cpu.py"], "check"),
])
def test_what_collection_starts(tmp_path, options, started):
    """Collection starts the check where its test runs, warming later tests' kernels first where the whole suite runs.
    It looked at the tests before -k, -m, --lf or --deselect had left theirs out: a run without the check's test still
    started the check (minutes of compiling on the other core, killed at the end), and a few tests left by --lf or
    --deselect (no paths, -k or -m given) had the warming process compile beside them the kernels they reach at once."""
    (tmp_path / "haswell_probe.py").write_text(PROBE)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "haswell_probe",
                          "-p", "no:cacheprovider", *SUITE, *options], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)])), timeout=300)
    assert f"started: {started}" in run.stdout, run.stdout + run.stderr
