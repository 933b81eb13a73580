"""Numba kernels of the CPU QMoE path (compiled once per machine: cache=True).

Weights stay in their stored int4/int8 layout; ``gemv_q`` reads the packed bytes once per output row
(decode), ``dequant_rows`` expands an expert's rows into a float32 matrix for BLAS (prefill).
Distinct specialisations are kept few: weights / scales / zero points are always passed as
read-only C-contiguous arrays, scales either float32 or uint16 (fp16 / bf16 bits).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import (MK_NR, dqrow_int4_16, dqrow_int4_8, dqrow_int8_16, load_scale, microkernel_6x16,
                   microkernel_6x32, qrow_int4_16, qrow_int4_8, qrow_int8_16)

__all__ = ["gemv_q", "dequant_rows", "qgemm", "activate", "ROWS_PER_TASK",
           "ACT_RELU", "ACT_GELU", "ACT_SILU", "ACT_IDENTITY", "ACT_SWIGLU"]

ACT_RELU, ACT_GELU, ACT_SILU, ACT_IDENTITY, ACT_SWIGLU = 0, 1, 2, 3, 4
ROWS_PER_TASK = 16


@njit(inline="always")
def _fill_zero_points(zbuf, zp, zmode, e, n, bits, nb, zrb, zdef):
    """Zero points of row n of expert e as float32 into zbuf[0:nb]."""
    if zmode == 0:
        for b in range(nb):
            zbuf[b] = zdef
    elif zmode == 1:  # per row, packed along N
        if bits == 4:
            byte = zp[e, n >> 1]
            zbuf[0] = np.float32((byte >> ((n & 1) * 4)) & 15)
        else:
            zbuf[0] = np.float32(zp[e, n])
    else:  # per block, packed along the block axis
        base = n * zrb
        if bits == 4:
            for b in range(nb):
                byte = zp[e, base + (b >> 1)]
                zbuf[b] = np.float32((byte >> ((b & 1) * 4)) & 15)
        else:
            for b in range(nb):
                zbuf[b] = np.float32(zp[e, base + b])


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def gemv_q(w, sc, skind, zp, zmode, bits, nb, chunk, cshift, nchunk,
           xa, xb, xs, experts, pair_off, src_row, dst_row, coef, bias, has_bias, out):
    """out[dst_row[p], n] += coef[p] * (W_e[n, :] . x[src_row[p]] + bias[e, n]) for the pairs p of expert e.

    w [E, N, Kb] uint8; sc [E, N, nb]; zp [E, Zb] uint8 (zmode 0 none, 1 per row, 2 per block);
    xa / xb [R, Kb] float32 (int4: even / odd k, int8: xa = xb = x); xs [R, nchunk] float32 sums of x over
    each chunk's values; experts [U]; pair_off [U + 1].
    Parallel over output rows; each row's packed bytes are read once for all of its expert's pairs.
    """
    E, N, Kb = w.shape
    U = experts.shape[0]
    ntask = (N + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    zdef = np.float32(1 << (bits - 1))
    zrb = (nb * bits + 7) // 8
    full = nchunk * chunk
    for task in prange(ntask):
        zbuf = np.full(nb, zdef, np.float32)
        n0 = task * ROWS_PER_TASK
        n1 = min(N, n0 + ROWS_PER_TASK)
        for u in range(U):
            e = experts[u]
            p0 = pair_off[u]
            p1 = pair_off[u + 1]
            if p1 <= p0:
                continue
            for n in range(n0, n1):
                if zmode != 0:
                    _fill_zero_points(zbuf, zp, zmode, e, n, bits, nb, zrb, zdef)
                woff = (e * N + n) * Kb
                soff = (e * N + n) * nb
                bval = bias[e, n] if has_bias else np.float32(0.0)
                for p in range(p0, p1):
                    r = src_row[p]
                    xoff = r * Kb
                    if bits == 4:
                        if chunk == 16:
                            acc = qrow_int4_16(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff,
                                           xs, r * nchunk)
                        else:
                            acc = qrow_int4_8(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff,
                                           xs, r * nchunk)
                    else:
                        acc = qrow_int8_16(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff,
                                           xs, r * nchunk)
                    if full < Kb:  # ragged tail (per-row quantisation only): one scale, one zero point
                        s = load_scale(sc, soff + nb - 1, skind)
                        z = zbuf[nb - 1]
                        t = np.float32(0.0)
                        for j in range(full, Kb):
                            q = w[e, n, j]
                            if bits == 4:
                                t += (np.float32(q & 15) - z) * xa[r, j] + (np.float32(q >> 4) - z) * xb[r, j]
                            else:
                                t += (np.float32(q) - z) * xa[r, j]
                        acc += s * t
                    out[dst_row[p], n] += coef[p] * (acc + bval)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def dequant_rows(w, sc, skind, zp, zmode, bits, nb, chunk, cshift, nchunk, e, n0, n1, out):
    """out[n - n0, :] = dequantised row n of expert e (k in the per-chunk permuted order), n0 <= n < n1."""
    K = out.shape[1]
    flat = out.reshape(-1)
    zdef = np.float32(1 << (bits - 1))
    zrb = (nb * bits + 7) // 8
    nrows = n1 - n0
    ntask = (nrows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(ntask):
        zbuf = np.full(nb, zdef, np.float32)
        r0 = task * ROWS_PER_TASK
        r1 = min(nrows, r0 + ROWS_PER_TASK)
        for rr in range(r0, r1):
            if zmode != 0:
                _fill_zero_points(zbuf, zp, zmode, e, n0 + rr, bits, nb, zrb, zdef)
            _dequant_one_row(w, sc, skind, zbuf, bits, nb, chunk, cshift, nchunk, e, n0 + rr, flat, rr * K)


@njit(inline="always")
def _dequant_one_row(w, sc, skind, zbuf, bits, nb, chunk, cshift, nchunk, e, n, out, ooff):
    """Row n of expert e into out (flat float32 array) at ooff, k in the per-chunk permuted order."""
    E, N, Kb = w.shape
    woff = (e * N + n) * Kb
    soff = (e * N + n) * nb
    if bits == 4:
        if chunk == 16:
            dqrow_int4_16(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, out, ooff)
        else:
            dqrow_int4_8(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, out, ooff)
    else:
        dqrow_int8_16(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, out, ooff)
    full = nchunk * chunk
    if full < Kb:
        s = load_scale(sc, soff + nb - 1, skind)
        z = zbuf[nb - 1]
        k0 = ooff + nchunk * chunk * (2 if bits == 4 else 1)
        for j in range(full, Kb):
            q = w[e, n, j]
            if bits == 4:
                kk = k0 + 2 * (j - full)
                out[kk] = (np.float32(q & 15) - z) * s
                out[kk + 1] = (np.float32(q >> 4) - z) * s
            else:
                out[k0 + j - full] = (np.float32(q) - z) * s


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def qgemm(w, sc, skind, zp, zmode, bits, nb, chunk, cshift, nchunk, e, xt, M, bias, has_bias,
          accumulate, dst, coef, out):
    """Quantised GEMM for one expert: v[m, n] = sum_k W_e[n, k] * x[m, k] (+ bias[e, n]).

    xt [K, Mpad] float32 = x^T with k in the per-chunk permuted order, Mpad a multiple of 16, columns
    >= M zero. accumulate = False: out[m, n] = v; True: out[dst[m], n] += coef[m] * v.
    Parallel over panels of MK_NR output rows: each panel is dequantised once into a small float32
    buffer (L1/L2 resident) and multiplied with x^T by the 6x32 / 6x16 register-tile micro-kernels.
    """
    E, N, Kb = w.shape
    K = xt.shape[0]
    Mpad = xt.shape[1]
    NR = MK_NR
    npan = (N + NR - 1) // NR
    ntask = min(npan, 64)
    zdef = np.float32(1 << (bits - 1))
    zrb = (nb * bits + 7) // 8
    for task in prange(ntask):
        panel = np.zeros(NR * K, np.float32)
        ct = np.empty(NR * 32, np.float32)
        zbuf = np.full(nb, zdef, np.float32)
        pa = task * npan // ntask
        pb = (task + 1) * npan // ntask
        for pn in range(pa, pb):
            n0 = pn * NR
            rows = min(NR, N - n0)
            for r in range(rows):
                if zmode != 0:
                    _fill_zero_points(zbuf, zp, zmode, e, n0 + r, bits, nb, zrb, zdef)
                _dequant_one_row(w, sc, skind, zbuf, bits, nb, chunk, cshift, nchunk, e, n0 + r, panel, r * K)
            for r in range(rows, NR):
                for kk in range(K):
                    panel[r * K + kk] = np.float32(0.0)
            for m0 in range(0, Mpad, 32):
                width = 32 if Mpad - m0 >= 32 else 16
                if width == 32:
                    microkernel_6x32(panel, 0, K, xt, m0, Mpad, K, ct, 0)
                else:
                    microkernel_6x16(panel, 0, K, xt, m0, Mpad, K, ct, 0)
                mend = min(M, m0 + width)
                for r in range(rows):
                    n = n0 + r
                    bval = bias[e, n] if has_bias else np.float32(0.0)
                    for m in range(m0, mend):
                        v = ct[r * width + m - m0] + bval
                        if accumulate:
                            out[dst[m], n] += coef[m] * v
                        else:
                            out[m, n] = v


@njit(fastmath=True, inline="always")
def _act(kind, g):
    if kind == ACT_RELU:
        return max(g, np.float32(0.0))
    if kind == ACT_GELU:
        c = np.float32(0.7978845608028654)  # sqrt(2/pi)
        return np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
    if kind == ACT_SILU:
        return g / (np.float32(1.0) + np.exp(-g))
    return g


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def activate(h1, h3, has_h3, kind, fusion, alpha, beta, limit, has_limit, out):
    """out [P, I] = activation of FC1 output h1 [P, fusion * I] (and FC3 output h3 [P, I] when has_h3).

    swiglu: fusion 1 interleaved rows (g0, u0, g1, u1, ...), 2 concatenated [g | u], 0 gate = h1, up = h3.
    Other activations: act(h1), multiplied by h3 when has_h3 (gated FFN).
    """
    P, I = out.shape
    a = np.float32(alpha)
    bt = np.float32(beta)
    lim = np.float32(limit)
    for p in prange(P):
        if kind == ACT_SWIGLU:
            for i in range(I):
                if fusion == 1:
                    g = h1[p, 2 * i]
                    l = h1[p, 2 * i + 1]
                elif fusion == 2:
                    g = h1[p, i]
                    l = h1[p, I + i]
                else:
                    g = h1[p, i]
                    l = h3[p, i]
                if has_limit:
                    g = min(g, lim)
                    l = max(min(l, lim), -lim)
                out[p, i] = g / (np.float32(1.0) + np.exp(-a * g)) * (l + bt)
        else:
            for i in range(I):
                v = _act(kind, h1[p, i])
                if has_h3:
                    v *= h3[p, i]
                out[p, i] = v
