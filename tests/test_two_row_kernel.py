"""The two-row int4 row kernel (kernels.cpu.simd.qrow2_int4_16_lut_*: FC1's gate and up rows, FC2's rows in pairs)
against two calls of the one-row kernel it stands for: the same floats, bit for bit."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from kernels.cpu.simd import (qrow2_int4_16_lut_zblk, qrow2_int4_16_lut_zrow, qrow_int4_16_lut_zblk,
                              qrow_int4_16_lut_zrow)


@njit(cache=False)
def _rows(w, woff, woff2, nchunk, sc, soff, soff2, skind, zf, zf2, xa, xb, xs, per_block):
    """(one-row kernel on row 1, on row 2, the two-row kernel's pair) for one activation row."""
    if per_block:
        a = qrow_int4_16_lut_zblk(w, woff, nchunk, 0, sc, soff, skind, zf, 0, xa, xb, 0, xs, 0)
        b = qrow_int4_16_lut_zblk(w, woff2, nchunk, 0, sc, soff2, skind, zf2, 0, xa, xb, 0, xs, 0)
        pair = qrow2_int4_16_lut_zblk(w, woff, woff2, nchunk, 0, sc, soff, soff2, skind, zf, zf2, 0, xa, xb, 0, xs, 0)
    else:
        a = qrow_int4_16_lut_zrow(w, woff, nchunk, 0, sc, soff, skind, zf, 0, xa, xb, 0, xs, 0)
        b = qrow_int4_16_lut_zrow(w, woff2, nchunk, 0, sc, soff2, skind, zf2, 0, xa, xb, 0, xs, 0)
        pair = qrow2_int4_16_lut_zrow(w, woff, woff2, nchunk, 0, sc, soff, soff2, skind, zf, zf2, 0, xa, xb, 0, xs, 0)
    return a, b, pair[0], pair[1]


SCALES = [("float32", np.float32, 0), ("float16", np.float16, 1), ("bfloat16", ml_dtypes.bfloat16, 2)]


@pytest.mark.parametrize("per_block", [False, True], ids=["zero-point-per-row", "zero-points-per-block"])
@pytest.mark.parametrize("scale_name,scale_dtype,skind", SCALES, ids=[s[0] for s in SCALES])
def test_two_row_kernel_equals_two_one_row_calls(per_block, scale_name, scale_dtype, skind):
    """Rows of 1, 2, 5, 24 (Qwen3-30B-A3B's FC2) and 90 (gpt-oss's) chunks of 32 codes, block 32, each row with its
    own scales and zero points, next to each other or apart, random codes and activations."""
    rng = np.random.default_rng(17 + skind + 3 * per_block)
    for nchunk in (1, 2, 5, 24, 90):
        rows = 6
        w = rng.integers(0, 256, rows * nchunk * 16, dtype=np.uint8)
        sc = (rng.random(rows * nchunk) + 0.5).astype(scale_dtype)
        sc_arg = sc if skind == 0 else sc.view(np.uint16)
        xa = rng.standard_normal(nchunk * 16).astype(np.float32)
        xb = rng.standard_normal(nchunk * 16).astype(np.float32)
        xs = np.zeros(nchunk, np.float32)
        zf = rng.integers(0, 16, nchunk).astype(np.float32)
        zf2 = rng.integers(0, 16, nchunk).astype(np.float32)
        for r1, r2 in ((0, 1), (4, 1), (2, 5)):
            one, two, pair1, pair2 = _rows(w, r1 * nchunk * 16, r2 * nchunk * 16, nchunk, sc_arg, r1 * nchunk,
                                           r2 * nchunk, skind, zf, zf2, xa, xb, xs, per_block)
            assert (pair1, pair2) == (one, two), (nchunk, r1, r2)
            # and the one-row kernel is the dot product it should be (so that equal is not equally wrong)
            codes = np.stack([w[r1 * nchunk * 16:(r1 + 1) * nchunk * 16] & 15,
                              w[r1 * nchunk * 16:(r1 + 1) * nchunk * 16] >> 4], axis=1).astype(np.float64)
            zero = np.repeat(zf if per_block else np.full(nchunk, zf[0]), 16)[:, None]
            scale = np.repeat(sc[r1 * nchunk:(r1 + 1) * nchunk].astype(np.float64), 16)[:, None]
            want = float(((codes - zero) * scale * np.stack([xa, xb], axis=1)).sum())
            assert abs(one - want) <= 1e-4 * max(1.0, float(np.abs((codes - zero) * scale).sum())), (nchunk, r1)
