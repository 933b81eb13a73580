"""The host's streaming read bandwidth, measured once when a real device opens: the rate at which
the CPU expert kernels can read weights in decode, the miss policy's B_cpu (miss_policy.py).
A parallel sum over an array larger than the caches, all threads, best of a few runs; the
benchmarks use the same function over a larger array (benchmarks/common.stream_read_bandwidth)."""

from __future__ import annotations

import time

import numpy as np

_psum = None


def _kernel():
    global _psum
    if _psum is None:
        from numba import njit, prange

        @njit(parallel=True, fastmath=True)
        def psum(a):
            s = np.float32(0.0)
            for i in prange(a.size):
                s += a[i]
            return s

        _psum = psum
    return _psum


def stream_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 3) -> float:
    """Bytes per second."""
    psum = _kernel()
    a = np.ones(nbytes // 4, np.float32)
    psum(a)  # compile and fault the pages in
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        psum(a)
        best = max(best, a.nbytes / max(time.perf_counter() - started, 1e-9))
    del a
    return best
