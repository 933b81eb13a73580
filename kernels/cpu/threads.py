"""Numba's thread count, set only when it changes.

``numba.set_num_threads`` takes two locks at every call and costs ~15 µs in situ in a decode step (issue #4);
``numba.get_num_threads`` costs as much. Numba keeps the count per calling thread, so this module keeps, per
thread, the last count it set or read there and skips the call when nothing changes. That record is right only
while every change of the count goes through ``use_threads``: no code in this repository calls
``numba.set_num_threads`` directly.
"""
from __future__ import annotations

import os
import threading

import numba
from numba.core.cpu import ParallelOptions

__all__ = ["PRANGE_ONLY", "binding_warning", "use_threads"]

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
# array statements outside prange are small set-ups; their parallel work is the prange loops. An options object, not
# a dict: Numba empties a dict as it reads it, so the second function compiled (or a function's second
# specialisation) would find no options left and take all of them.
PRANGE_ONLY = ParallelOptions({"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
                               "setitem": False, "numpy": False, "stencil": False, "fusion": False})


def binding_warning(environ=None) -> str | None:
    """A sentence for the user when OpenMP thread binding is asked for in the environment, else None.

    GNU OpenMP then binds the thread that starts the first parallel region (the engine's) to one core, and every
    thread the process starts later (onnxruntime's pools, CUDA's) inherits that core. With OMP_PROC_BIND=close
    OMP_PLACES=cores the CPU expert kernels ran 7-11x slower in the engine on the H200 machine's 16-core Xeon
    (RESULTS.md, seventeenth session). GCC binds by default when OMP_PLACES or GOMP_CPU_AFFINITY is set."""
    env = os.environ if environ is None else environ
    asked = {name: env[name] for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY") if env.get(name)}
    proc_bind = asked.get("OMP_PROC_BIND", "").strip().lower()
    if proc_bind == "false" or not asked:
        return None
    settings = " ".join(f"{name}={value}" for name, value in asked.items())
    return (f"OpenMP thread binding is set ({settings}): the expert kernels' threads and every thread started after "
            "them share cores, which made CPU experts 7-11x slower on a 16-core Xeon; unset it for this app.")
