"""kernels/cpu/omp_pool.py: a thread's GNU OpenMP pool given back, so that another thread's pool is not throttled.

The threads are counted in a fresh process (/proc/self/task): in the test run's own process, other tests' background
threads come and go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    import numba, numpy as np
    from numba import njit, prange
    from kernels.cpu.omp_pool import release_pool

    @njit(parallel=True, nogil=True)
    def add_one(values):
        for i in prange(values.size):
            values[i] += 1.0

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settles_at(count):  # pool threads exit a moment after they are let go
        deadline = time.perf_counter() + 5.0
        while threads() != count and time.perf_counter() < deadline:
            time.sleep(0.01)
        return threads()

    values = np.zeros(64)
    seen = {"layer": None}
    def engine():  # a thread that starts a pool, gives it back, starts another
        start = threads()
        add_one(values)
        seen["layer"] = numba.threading_layer()
        seen["with_pool"] = threads() - start
        seen["released"] = release_pool()
        seen["after_release"] = settles_at(start) - start
        add_one(values)
        seen["again"] = threads() - start
    base = threads()
    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    settles_at(base)  # the finished thread's second pool exits a moment after it (on a loaded machine, not at once)
    # the main thread's pool stays while another thread starts and gives back its own
    add_one(values)
    with_main_pool = threads()
    other = threading.Thread(target=lambda: (add_one(values), release_pool()))
    other.start()
    other.join()
    seen["main_pool_kept"] = settles_at(with_main_pool) - with_main_pool
    add_one(values)
    seen["values"] = values.tolist()
    seen["pool_threads"] = numba.config.NUMBA_NUM_THREADS - 1
    print(json.dumps(seen))
""")


def test_release_pool_frees_the_calling_threads_pool_only_and_the_next_region_makes_a_new_one():
    if not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2:
        pytest.skip("counts threads through /proc, with 2 cores or more")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    if seen["layer"] != "omp":
        pytest.skip(f"Numba's threading layer is {seen['layer']}, not GNU OpenMP")
    assert seen["with_pool"] == seen["pool_threads"] == 1
    assert seen["released"] and seen["after_release"] == 0
    assert seen["again"] == 1  # a new pool for the next region
    assert seen["main_pool_kept"] == 0  # another thread's release left the main thread's pool
    assert seen["values"] == [5.0] * 64
