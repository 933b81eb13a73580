"""Numba's thread count, set only when it changes.

``numba.set_num_threads`` takes two locks at every call and costs ~15 µs in situ in a decode step (issue #4);
``numba.get_num_threads`` costs as much. Numba keeps the count per calling thread, so this module keeps, per
thread, the last count it set or read there and skips the call when nothing changes. That record is right only
while every change of the count goes through ``use_threads``: no code in this repository calls
``numba.set_num_threads`` directly.
"""
from __future__ import annotations

import threading

import numba

__all__ = ["PRANGE_ONLY", "use_threads"]

_IN_EFFECT = threading.local()  # .count: Numba's thread count in this thread, once known


def use_threads(count: int | None) -> int:
    """Make ``count`` (clamped to 1..NUMBA_NUM_THREADS) Numba's thread count in the calling thread and return
    the count in effect. None or 0 leaves the count as it is (Numba's default in a thread that never set one)."""
    known = getattr(_IN_EFFECT, "count", None)
    if not count:
        if known is None:
            known = _IN_EFFECT.count = numba.get_num_threads()
        return known
    threads = max(1, min(int(count), numba.config.NUMBA_NUM_THREADS))
    if threads != known:
        numba.set_num_threads(threads)
        _IN_EFFECT.count = threads
    return threads


# Numba's parallel options for the kernels: prange loops only. With parallel=True Numba also turns every array
# expression outside a prange loop (np.zeros, np.full, a[:] = 0, ...) into a parallel loop of its own, each a fork and
# join of all the threads: 1.4 µs a statement on the 2-core dev VM, and 28 µs of moe_gemv's ~95 µs on one expert on
# the H200 machine's 16 cores (benchmarks/diag_gemv_timeline.py, RESULTS.md "Seventeenth session"). The kernels'
# array statements outside prange are small set-ups; their parallel work is the prange loops.
PRANGE_ONLY = {"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
               "setitem": False, "numpy": False, "stencil": False, "fusion": False}
