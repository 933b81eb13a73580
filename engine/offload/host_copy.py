"""Gathering experts' rows of a weight tensor into another buffer, on every core.

A prefill wave gathers its experts' rows of every per-expert tensor into the pinned staging ring
(cuda_device.gather_wave) before one copy to the GPU: for gpt-oss-20b's dimensions 125 MB per wave of
8 experts, dozens of waves per prompt. NumPy's take copies on one thread; one core streams a fraction
of what the memory delivers to all of them. On the 2-core dev VM both read 19-20 GB/s
(benchmarks/bench_host_copy.py); the gain is on machines with many cores (not yet measured there).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.threads import PRANGE_ONLY

CHUNK = 1 << 20  # bytes per parallel job: large enough to stream, small enough to spread a row over cores


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True)
def _take_rows(src, rows, out):
    """out[i, :] = src[rows[i], :] for uint8 2-D src / out, in CHUNK-byte jobs spread over the threads."""
    width = src.shape[1]
    chunks = (width + CHUNK - 1) // CHUNK
    for job in prange(rows.size * chunks):
        i = job // chunks
        start = (job % chunks) * CHUNK
        end = min(width, start + CHUNK)
        out[i, start:end] = src[rows[i], start:end]


def take_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """np.take(src, rows, axis=0, out=out) for valid row ids, on every core when both arrays are C-contiguous
    (NumPy's take otherwise: mode "clip", which writes `out` directly instead of through a buffer). Returns out."""
    if not (src.flags.c_contiguous and out.flags.c_contiguous) or src.dtype != out.dtype or src.ndim == 0:
        return np.take(src, rows, axis=0, out=out, mode="clip")
    if out.shape != (rows.size,) + src.shape[1:]:
        raise ValueError(f"out has shape {out.shape}, not {(rows.size,) + src.shape[1:]}")
    width = src.nbytes // max(1, src.shape[0])
    _take_rows(src.reshape(src.shape[0], -1).view(np.uint8).reshape(src.shape[0], width),
               np.ascontiguousarray(rows, dtype=np.int64),
               out.reshape(out.shape[0], -1).view(np.uint8).reshape(out.shape[0], width))
    return out
