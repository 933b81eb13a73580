"""The calling thread's GNU OpenMP thread pool, released when another thread's pool takes over the kernels (issue #4).

GNU OpenMP keeps a pool of threads for each thread that starts a parallel region, for as long as that thread lives.
While the pools' threads together outnumber the cores, every waiting thread of every pool spins only briefly before
it sleeps (libgomp's throttled spin count), so each parallel region must wake its threads with a system call. On the
H200 machine's 16-core Xeon a nearly empty region took 72.9 µs with a second thread's pool alive against 10.7 µs
without, a decode-sized CPU kernel call 160 against 122 µs (bench_pool_beside, RESULTS.md). The decoder's engine
thread and the host-part worker (engine/offload/host_part_worker.py) each start such a pool. So each gives its pool
back when the other takes over.

libgomp's omp_pause_resource_all(omp_pause_soft) frees the calling thread's pool: its threads exit, and the next
parallel region started there makes a new pool. Other OpenMP runtimes (Intel's, LLVM's) are left alone: their pause
is not documented as limited to the calling thread's pool. Numba's other threading layers (TBB, workqueue) keep no
pool per thread.
"""

from __future__ import annotations

import ctypes
import sys

import numba

OMP_PAUSE_SOFT = 1
enabled = True  # False: pools are kept (bench_offload_ab's dense.pool_back=0, an A/B of the give-back)
_pause = None  # libgomp's omp_pause_resource_all, once found (False: not in this process)


def _libgomp_pause():
    """libgomp's omp_pause_resource_all as loaded in this process (Numba's OpenMP layer), else None."""
    global _pause
    if _pause is None:
        _pause = False
        path = _loaded_libgomp()
        if path is not None:
            function = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
            if function is not None:
                function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
                _pause = function
    return _pause or None


def _loaded_libgomp() -> str | None:
    """The path of the GNU OpenMP library mapped into this process (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libgomp" in path:
                    return path
    except OSError:
        return None
    return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP pool where Numba's kernels run on GNU OpenMP; whether one was freed (or there
    was none to free). Cheap where the thread has no pool; the thread's next parallel region starts a new one."""
    if not enabled:
        return False
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run in this process: no pool anywhere
        return False
    pause = _libgomp_pause() if layer == "omp" else None
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
