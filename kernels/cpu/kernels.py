"""Numba kernels of the CPU QMoE path (compiled once per machine: cache=True).

Weights stay in their stored layout. The batched paths (CpuQMoE's default, kernels/cpu/qmoe.py) are ``moe_gemv``
(decode: FC1, activation and FC2 of every routed expert in one parallel region) and ``qgemm_tasks`` (prefill: a
k-blocked dequant-GEMM per projection); ``gemv_q`` and ``qgemm`` are the older per-expert int4/int8 paths
(CpuQMoE.batched = False), kept for comparison.
Distinct specialisations are kept few: weights / scales / zero points are always passed as
read-only C-contiguous arrays, scales either float32 or uint16 (fp16 / bf16 bits).

Every kernel of this package is compiled with error_model="numpy": a division by zero gives inf or NaN, as in NumPy,
instead of raising. Under fastmath, Python's error model tested divisors that NaN had reached (a damaged model's inf
or NaN scale) as zero and raised ZeroDivisionError inside a parallel region, where the other threads then waited for
the raising one for ever (the fifty-first session's bad-input review); the model's NaN is reported where the logits
are read instead (engine/generation.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import (HAS_AVX512F, MK_NR, TBL_RECORD, atomic_fetch_add, atomic_load, dqrow_fp4_1, dqrow_fp4_2,
                   dqrow_int2_1, dqrow_int2_2, dqrow_int2_4, dqrow_int4_16, dqrow_int4_16_lut, dqrow_int4_8,
                   dqrow_int8_16, load_scale, microkernel_acc_6x16, microkernel_acc_6x32,
                   prefetch_bytes, qrow_fp4_1, qrow_fp4_2, qrow_int2_zblk_1, qrow_int2_zblk_2, qrow_int2_zblk_4,
                   qrow_int2_zrow_1, qrow_int2_zrow_2, qrow_int2_zrow_4,
                   qrow_int4_16, qrow_int4_16_lut_zblk, qrow_int4_16_lut_zrow, qrow_int4_8, qrow_int8_16,
                   qrow2_int4_16_lut_zblk, qrow2_int4_16_lut_zrow,
                   INT3_CHUNK, dqrow_int3_zblk_1, dqrow_int3_zblk_2, dqrow_int3_zrow_1, dqrow_int3_zrow_2,
                   qrow_int3_zblk_1, qrow_int3_zblk_2, qrow_int3_zrow_1, qrow_int3_zrow_2)
from .threads import PRANGE_ONLY

__all__ = ["gemv_q", "qgemm", "activate", "ROWS_PER_TASK",
           "group_pairs", "plan_blocks", "plan_tasks", "pack_cols", "qgemm_tasks", "moe_gemv", "reduce_rows",
           "reduce_tokens", "int3_position", "int3_width", "INT3_CHUNK",
           "ACT_RELU", "ACT_GELU", "ACT_SILU", "ACT_IDENTITY", "ACT_SWIGLU"]

ACT_RELU, ACT_GELU, ACT_SILU, ACT_IDENTITY, ACT_SWIGLU = 0, 1, 2, 3, 4
ROWS_PER_TASK = 16
# code formats of the batched paths: integer codes with zero points (int2 / int4 / int8), or E2M1 codes (fp4:
# MXFP4 / NVFP4) whose values and fp8 block scales come from a per-expert TBL_RECORD in the projection's aux
FMT_INT, FMT_FP4 = 0, 1


@njit(inline="always", error_model="numpy")
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


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
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


@njit(inline="always", error_model="numpy")
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


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
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
                if width == 32:  # the tile overwritten (load_c 0), rows `width` floats apart
                    microkernel_acc_6x32(panel, 0, K, xt, m0, Mpad, K, ct, 0, 32, 0)
                else:
                    microkernel_acc_6x16(panel, 0, K, xt, m0, Mpad, K, ct, 0, 16, 0)
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


@njit(fastmath=True, inline="always", error_model="numpy")
def _act(kind, g):
    if kind == ACT_RELU:
        return max(g, np.float32(0.0))
    if kind == ACT_GELU:
        c = np.float32(0.7978845608028654)  # sqrt(2/pi)
        return np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
    if kind == ACT_SILU:
        return g / (np.float32(1.0) + np.exp(-g))
    return g


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
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


# ============================================================================= batched paths
# One Numba call per projection for all experts of a batch (instead of one per expert), with the work
# split into tasks handed out through an atomic counter (prefill), or into equal contiguous spans of
# the (expert, row) space, one per thread (decode): one fork/join per projection, balanced threads, and
# each thread streaming one contiguous run of packed weights.

@njit(cache=True, nogil=True, error_model="numpy")
def group_pairs(ids, wts, E, small_max):
    """Group the (token, slot) pairs by expert; id -1 = skipped.

    Returns (experts [U], pair_off [U + 1], tok [P], pw [P], n_small, bad, tpair [T, k]): experts with at
    most small_max pairs come first (ascending id), then the others (ascending id); within an expert the
    pairs are in token order; tpair[t, j] = the pair of slot j of token t (-1: skipped). bad = 1 when an id
    is >= E (nothing else is then meaningful).
    """
    T, k = ids.shape
    cnt = np.zeros(E, np.int64)
    bad = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            if e >= E:
                bad = 1
                continue
            cnt[e] += 1
    U = 0
    n_small = 0
    for e in range(E):
        if cnt[e] > 0:
            U += 1
            if cnt[e] <= small_max:
                n_small += 1
    experts = np.empty(U, np.int64)
    slot = np.full(E, -1, np.int64)
    a = 0
    b = n_small
    for e in range(E):
        if cnt[e] > 0:
            if cnt[e] <= small_max:
                slot[e] = a
                a += 1
            else:
                slot[e] = b
                b += 1
            experts[slot[e]] = e
    pair_off = np.zeros(U + 1, np.int64)
    for u in range(U):
        pair_off[u + 1] = pair_off[u] + cnt[experts[u]]
    P = pair_off[U]
    tok = np.empty(P, np.int64)
    pw = np.empty(P, np.float32)
    tpair = np.full((T, k), -1, np.int64)
    fill = pair_off[:U].copy()
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or e >= E:
                continue
            q = fill[slot[e]]
            tok[q] = t
            pw[q] = wts[t, j]
            tpair[t, j] = q
            fill[slot[e]] = q + 1
    return experts, pair_off, tok, pw, n_small, bad, tpair


@njit(cache=True, nogil=True, error_model="numpy")
def plan_blocks(pair_off, u0, u1, p_base):
    """Column blocks of 32 (the last one of an expert 16 when at most 16 columns remain) over the pairs of
    experts u0..u1-1. Returns (ublk [U + 1] first block of each expert, relative to u0; blk_col: first
    packed column; blk_w: width 16 / 32; blk_pair: first pair, minus p_base; blk_valid: pairs in it)."""
    nu = u1 - u0
    ublk = np.zeros(nu + 1, np.int64)
    for u in range(nu):
        c = pair_off[u0 + u + 1] - pair_off[u0 + u]
        ublk[u + 1] = ublk[u] + (c + 31) // 32
    nblk = ublk[nu]
    blk_col = np.zeros(nblk + 1, np.int64)
    blk_w = np.zeros(nblk, np.int64)
    blk_pair = np.zeros(nblk, np.int64)
    blk_valid = np.zeros(nblk, np.int64)
    j = 0
    for u in range(nu):
        p = pair_off[u0 + u]
        left = pair_off[u0 + u + 1] - p
        while left > 0:
            wdt = 32 if left > 16 else 16
            v = min(left, 32)
            blk_w[j] = wdt
            blk_pair[j] = p - p_base
            blk_valid[j] = v
            blk_col[j + 1] = blk_col[j] + wdt
            p += v
            left -= v
            j += 1
    return ublk, blk_col, blk_w, blk_pair, blk_valid


@njit(cache=True, nogil=True, error_model="numpy")
def plan_tasks(experts, u0, ublk, blk_col, N, rt, mt):
    """GEMM tasks (expert id, n0, n1, j0, j1): rows [n0, n1) (rt rows, a multiple of 6) times a group of
    consecutive column blocks of one expert spanning at most mt columns; largest first."""
    nu = ublk.shape[0] - 1
    nrt = (N + rt - 1) // rt
    ngrp = 0
    for u in range(nu):
        j = ublk[u]
        while j < ublk[u + 1]:
            j1 = j + 1
            while j1 < ublk[u + 1] and blk_col[j1 + 1] - blk_col[j] <= mt:
                j1 += 1
            ngrp += 1
            j = j1
    tasks = np.empty((ngrp * nrt, 5), np.int64)
    cost = np.empty(ngrp * nrt, np.int64)
    t = 0
    for u in range(nu):
        j = ublk[u]
        while j < ublk[u + 1]:
            j1 = j + 1
            while j1 < ublk[u + 1] and blk_col[j1 + 1] - blk_col[j] <= mt:
                j1 += 1
            for r in range(nrt):
                n0 = r * rt
                n1 = min(N, n0 + rt)
                tasks[t, 0] = experts[u0 + u]
                tasks[t, 1] = n0
                tasks[t, 2] = n1
                tasks[t, 3] = j
                tasks[t, 4] = j1
                cost[t] = (n1 - n0) * (blk_col[j1] - blk_col[j])
                t += 1
            j = j1
    order = np.argsort(-cost, kind="mergesort")
    return tasks[order]


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, error_model="numpy")
def pack_cols(x, rows, perm, blk_col, blk_w, blk_pair, blk_valid, xp):
    """Packed activation panels: xp[blk_col[j]*K + kk*w + c] = x[rows[blk_pair[j] + c], perm[kk]] for the
    valid columns c of block j (w = blk_w[j]), 0 in its padding columns. Block j's panel for k-range
    [k0, k1) is then the contiguous run of (k1 - k0) * w floats at blk_col[j]*K + k0*w."""
    K = perm.shape[0]
    nblk = blk_w.shape[0]
    nkt = (K + 255) // 256
    for task in prange(nblk * nkt):
        j = task // nkt
        k0 = (task % nkt) * 256
        k1 = min(K, k0 + 256)
        wdt = blk_w[j]
        base = blk_col[j] * K
        v = blk_valid[j]
        rr = np.empty(32, np.int64)
        for c in range(v):
            rr[c] = rows[blk_pair[j] + c]
        for kk in range(k0, k1):  # contiguous writes; the block's 32 source rows stay in L1
            pk = perm[kk]
            o = base + kk * wdt
            for c in range(v):
                xp[o + c] = x[rr[c], pk]
            for c in range(v, wdt):
                xp[o + c] = np.float32(0.0)


@njit(inline="always", error_model="numpy")
def _bits3(a, bp):
    """The 3-bit code at bit position bp of the LSB-first bit stream in the 1-d uint8 array a."""
    j = bp >> 3
    v = np.int64(a[j])
    if (bp & 7) > 5:
        v |= np.int64(a[j + 1]) << 8
    return (v >> (bp & 7)) & 7


@njit(inline="always", error_model="numpy")
def int3_position(k, nchunk):
    """Where input k of an int3 row sits in the activation layout of the int3 kernels (nchunk whole 64-code
    chunks): slot s = k & 3 of lane (k >> 3 & 7) + 8 (k >> 2 & 1) of chunk k >> 6, i.e. s * 16 nchunk + 16 (k >> 6)
    + lane; after the chunks (k >= 64 nchunk) the tail in order at 80 nchunk + k - 64 nchunk (a fifth stream,
    the lane sums, sits at 64 nchunk). The prefill panels hold chunk i's slots together: 64 i + 16 s + lane."""
    if k >= 64 * nchunk:
        return 16 * nchunk + k
    return (k & 3) * 16 * nchunk + 16 * (k >> 6) + ((k >> 3) & 7) + 8 * ((k >> 2) & 1)


@njit(inline="always", error_model="numpy")
def int3_width(Kb, nchunk):
    """Floats per activation row of an int3 projection (see int3_position): 5 streams + the tail up to the
    last code that the row's bytes can hold."""
    return 16 * nchunk + (8 * Kb) // 3


@njit(inline="always", error_model="numpy")
def _fill_zp_range(zbuf, zp, zmode, e, n, bits, zrb, b0, b1):
    """Zero points of blocks b0..b1-1 of row n (zmode 1: the row's one zero point into zbuf[0])."""
    if zmode == 1:
        if bits == 4:
            zbuf[0] = np.float32((zp[e, n >> 1] >> ((n & 1) * 4)) & 15)
        elif bits == 2:
            zbuf[0] = np.float32((zp[e, n >> 2] >> ((n & 3) * 2)) & 3)
        elif bits == 3:
            zbuf[0] = np.float32(_bits3(zp[e], 3 * n))
        else:
            zbuf[0] = np.float32(zp[e, n])
    elif zmode == 2:
        base = n * zrb
        if bits == 4:
            for b in range(b0, b1):
                zbuf[b] = np.float32((zp[e, base + (b >> 1)] >> ((b & 1) * 4)) & 15)
        elif bits == 2:
            for b in range(b0, b1):
                zbuf[b] = np.float32((zp[e, base + (b >> 2)] >> ((b & 3) * 2)) & 3)
        elif bits == 3:
            for b in range(b0, b1):
                zbuf[b] = np.float32(_bits3(zp[e], 8 * base + 3 * b))
        else:
            for b in range(b0, b1):
                zbuf[b] = np.float32(zp[e, base + b])


@njit(inline="always", error_model="numpy")
def _chunk_block(c, cshift, bpc):
    """First quantisation block of chunk c (bpc = 2 / 4: two 8-byte / four 4-byte blocks per 16-byte chunk)."""
    return c * bpc if bpc > 1 else c >> cshift


@njit(inline="always", error_model="numpy")
def _int2_b16_tail_dot(w, sc, skind, zbuf, e, n, soff, full, xa, r):
    """Row n of expert e's ragged tail (bytes full.. after the last whole chunk) . x_r for int2 block 16: up to
    three 4-byte blocks, each with its own scale and zero point."""
    Kb = w.shape[2]
    acc = np.float32(0.0)
    for j0 in range(full, Kb, 4):
        b = j0 >> 2
        z = zbuf[b]
        t = np.float32(0.0)
        for j in range(j0, j0 + 4):
            q = w[e, n, j]
            for c in range(4):
                t += (np.float32((q >> (2 * c)) & 3) - z) * xa[r, c * Kb + j]
        acc += load_scale(sc, soff + b, skind) * t
    return acc


@njit(inline="always", error_model="numpy")
def _code_value(q, fmt, z, aux, aoff):
    """Value of code q before the block scale: q - z (integer codes) or the record's table (fp4)."""
    if fmt == FMT_FP4:
        return aux[aoff + q]
    return np.float32(q) - z


@njit(inline="always", error_model="numpy")
def _block_scale(sc, idx, skind, fmt, aux, aoff):
    """Scale at flat index idx of sc: float / fp16 / bf16, or an fp8 code through the record's scale table."""
    s = load_scale(sc, idx, skind)
    if fmt == FMT_FP4:
        return aux[aoff + 16 + np.int64(s)]
    return s


@njit(inline="always", error_model="numpy")
def _dequant_row_range(w, sc, skind, zbuf, bits, nb, chunk, cshift, nchunk, fmt, bpc, aux, e, n, c0, c1, tail,
                       out, ooff, zmode):
    """Chunks c0..c1-1 of row n of expert e (k permuted per chunk) into out[ooff:], then, when tail, the
    ragged bytes after the last whole chunk (in the row's last block; int2 block 16: its last one to three).
    c0 is a multiple of 2**cshift."""
    E, N, Kb = w.shape
    row = e * N + n
    woff = row * Kb + c0 * chunk
    b0 = _chunk_block(c0, cshift, bpc)
    soff = row * nb + b0
    aoff = e * TBL_RECORD
    nck = c1 - c0
    vpb = 8 // bits if bits != 3 else 64
    if nck > 0:
        if fmt == FMT_FP4:
            if bpc == 2:
                dqrow_fp4_2(w, woff, nck, cshift, sc, soff, skind, aux, aoff, out, ooff)
            else:
                dqrow_fp4_1(w, woff, nck, cshift, sc, soff, skind, aux, aoff, out, ooff)
        elif bits == 3:
            if zmode == 2:
                if bpc == 2:
                    dqrow_int3_zblk_2(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
                else:
                    dqrow_int3_zblk_1(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
            elif bpc == 2:
                dqrow_int3_zrow_2(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
            else:
                dqrow_int3_zrow_1(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
        elif bits == 2:
            if bpc == 4:
                dqrow_int2_4(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
            elif bpc == 2:
                dqrow_int2_2(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
            else:
                dqrow_int2_1(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
        elif bits == 4:
            if chunk == 16:
                dqrow_int4_16_lut(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
            else:
                dqrow_int4_8(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
        else:
            dqrow_int8_16(w, woff, nck, cshift, sc, soff, skind, zbuf, b0, out, ooff)
    if tail:
        full = nchunk * chunk
        s = _block_scale(sc, row * nb + nb - 1, skind, fmt, aux, aoff)
        z = zbuf[nb - 1]
        mask = (1 << bits) - 1
        if bits == 3:  # the codes after the last whole 64-code chunk (padding codes read as 0, never multiplied)
            k0 = ooff + nck * 64
            for j in range(nchunk * 64, (8 * Kb) // 3):
                q = _bits3(w[e, n], 3 * j)
                out[k0 + j - nchunk * 64] = _code_value(q, fmt, z, aux, aoff) * s
            return
        k0 = ooff + nck * chunk * vpb
        for j in range(full, Kb):
            q = w[e, n, j]
            if bpc == 4:  # int2 block 16: the tail holds up to three 4-byte blocks
                s = _block_scale(sc, row * nb + (j >> 2), skind, fmt, aux, aoff)
                z = zbuf[j >> 2]
            for c in range(vpb):
                out[k0 + vpb * (j - full) + c] = _code_value((q >> (c * bits)) & mask, fmt, z, aux, aoff) * s


@njit(fastmath=True, inline="always", error_model="numpy")
def _swiglu(g, l, alpha, beta, limit, has_limit):
    if has_limit:
        g = min(g, limit)
        l = max(min(l, limit), -limit)
    return g / (np.float32(1.0) + np.exp(-alpha * g)) * (l + beta)


MODE_STORE, MODE_SWIGLU, MODE_SCALE, MODE_ACT = 0, 1, 2, 3


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
def qgemm_tasks(w, sc, skind, zp, zmode, bits, nb, chunk, cshift, nchunk, fmt, bpc, aux, K, kcc,
                xp, blk_col, blk_w, blk_pair, blk_valid, tasks, rt, mt,
                bias, has_bias, mode, coef, act_kind, alpha, beta, limit, has_limit, pinv, knext, out, nth):
    """Quantised GEMM of many experts at once: v[p, n] = W_e[n, :] . x_p (+ bias[e, n]) for the pairs p in
    the column blocks of each task (see pack_cols for xp, plan_tasks for tasks).

    Per task: for each k-block of kcc chunks, the task's rows are dequantised into a thread-local buffer
    (L2), then for each column block the X panel (k-block x 32 floats, L1) multiplies the 6-row W panels
    with the register-tile micro-kernels, accumulating into a [rt, mt] C buffer. Epilogue by mode:
    0 out[p*N + n] = v; 2 out[p*N + n] = coef[p] * v; 1 (swiglu, rows interleaved g, u): a_i packed
    for the next GEMM (out[blk_col[j]*knext + pinv[i]*w + c]); 3 act(v) packed likewise.
    Tasks are taken from an atomic counter: one fork/join, dynamic balance. fmt / bpc / aux: see _qdot.
    """
    E, N, Kb = w.shape
    V = chunk * 8 // bits  # values per chunk (int3: 24 bytes = 64 codes)
    ldw = kcc * V + V
    nkb = max(1, (nchunk + kcc - 1) // kcc)
    ragged = nchunk * chunk < Kb
    rtp = (rt + MK_NR - 1) // MK_NR * MK_NR
    zdef = np.float32(1 << (bits - 1))
    zrb = (nb * bits + 7) // 8
    ntask = tasks.shape[0]
    counter = np.zeros(1, np.int64)
    a_ = np.float32(alpha)
    b_ = np.float32(beta)
    l_ = np.float32(limit)
    for th in prange(nth):
        wbuf = np.zeros(rtp * ldw, np.float32)
        cbuf = np.empty(rtp * mt, np.float32)
        zbuf = np.full(nb, zdef, np.float32)
        while True:
            ti = atomic_fetch_add(counter, 0, 1)
            if ti >= ntask:
                break
            e = tasks[ti, 0]
            n0 = tasks[ti, 1]
            n1 = tasks[ti, 2]
            j0 = tasks[ti, 3]
            j1 = tasks[ti, 4]
            rows = n1 - n0
            npan = (rows + MK_NR - 1) // MK_NR
            col0 = blk_col[j0]
            for kb in range(nkb):
                c0 = kb * kcc
                c1 = min(nchunk, c0 + kcc)
                last = kb == nkb - 1
                tail = last and ragged
                kc = (c1 - c0) * V + ((K - nchunk * V) if last else 0)
                for r in range(rows):
                    if zmode != 0:
                        _fill_zp_range(zbuf, zp, zmode, e, n0 + r, bits, zrb, _chunk_block(c0, cshift, bpc),
                                       nb if last else min(nb, _chunk_block(c1, cshift, bpc)))
                    _dequant_row_range(w, sc, skind, zbuf, bits, nb, chunk, cshift, nchunk, fmt, bpc, aux, e, n0 + r,
                                       c0, c1, tail, wbuf, r * ldw, zmode)
                for r in range(rows, npan * MK_NR):
                    for kk in range(kc):
                        wbuf[r * ldw + kk] = np.float32(0.0)
                for j in range(j0, j1):
                    wdt = blk_w[j]
                    xoff = blk_col[j] * K + c0 * V * wdt
                    ccol = blk_col[j] - col0
                    for q in range(npan):
                        if wdt == 32:
                            microkernel_acc_6x32(wbuf, q * MK_NR * ldw, ldw, xp, xoff, wdt, kc, cbuf,
                                                 q * MK_NR * mt + ccol, mt, kb)
                        else:
                            microkernel_acc_6x16(wbuf, q * MK_NR * ldw, ldw, xp, xoff, wdt, kc, cbuf,
                                                 q * MK_NR * mt + ccol, mt, kb)
            # epilogue
            for j in range(j0, j1):
                wdt = blk_w[j]
                ccol = blk_col[j] - col0
                v = blk_valid[j]
                pb = blk_pair[j]
                if mode == MODE_STORE or mode == MODE_SCALE:
                    for cc in range(v):
                        p = pb + cc
                        f = coef[p] if mode == MODE_SCALE else np.float32(1.0)
                        for r in range(rows):
                            val = cbuf[r * mt + ccol + cc]
                            if has_bias:
                                val += bias[e, n0 + r]
                            out[p * N + n0 + r] = f * val
                elif mode == MODE_SWIGLU:
                    obase = blk_col[j] * knext
                    for r in range(0, rows, 2):
                        i = (n0 + r) >> 1
                        bg = bias[e, n0 + r] if has_bias else np.float32(0.0)
                        bu = bias[e, n0 + r + 1] if has_bias else np.float32(0.0)
                        o = obase + pinv[i] * wdt
                        for cc in range(v):
                            out[o + cc] = _swiglu(cbuf[r * mt + ccol + cc] + bg, cbuf[(r + 1) * mt + ccol + cc] + bu,
                                                  a_, b_, l_, has_limit)
                        for cc in range(v, wdt):
                            out[o + cc] = np.float32(0.0)
                else:
                    obase = blk_col[j] * knext
                    for r in range(rows):
                        bval = bias[e, n0 + r] if has_bias else np.float32(0.0)
                        o = obase + pinv[n0 + r] * wdt
                        for cc in range(v):
                            out[o + cc] = _act(act_kind, cbuf[r * mt + ccol + cc] + bval)
                        for cc in range(v, wdt):
                            out[o + cc] = np.float32(0.0)


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
def reduce_tokens(y, tpair, p0, out, nth):
    """out[t, :] += y[p - p0, :] for the pairs p >= p0 of token t (tpair from group_pairs): parallel over
    tokens, each thread reading whole contiguous rows."""
    T, k = tpair.shape
    PL, H = y.shape
    for th in prange(nth):
        for t in range(th * T // nth, (th + 1) * T // nth):
            for j in range(k):
                p = tpair[t, j] - p0
                if p >= 0 and p < PL:
                    for h in range(H):
                        out[t, h] += y[p, h]


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, error_model="numpy")
def reduce_rows(y, dst, out, nth):
    """out[dst[p], :] += y[p, :] (parallel over column spans: no two threads write one element)."""
    P, H = y.shape
    for th in prange(nth):
        h0 = th * H // nth
        h1 = (th + 1) * H // nth
        for p in range(P):
            d = dst[p]
            for h in range(h0, h1):
                out[d, h] += y[p, h]


@njit(inline="always", error_model="numpy")
def _int4_lut_dot(w, sc, skind, zbuf, zmode, nb, cshift, nchunk, e, n, xa, xb, xs, r, c0):
    """The dot product over chunks [c0, nchunk) of an int4 row of 16-byte chunks (bits 4, chunk 16, FMT_INT): _qdot's
    call for that layout, which a loop over such rows makes directly (without the other layouts' branches) where the
    row has no ragged tail. c0 > 0 (a part of the row: _fc2_first_chunk) starts a block: the row kernel starts at its
    bytes, its activations and its scale block (zero-point block)."""
    E, N, Kb = w.shape
    b0 = c0 >> cshift  # (per-row scales: cshift 62, block 0)
    woff = (e * N + n) * Kb + 16 * c0
    soff = (e * N + n) * nb + b0
    xoff = r * xa.shape[1] + 16 * c0
    if zmode == 2:
        return qrow_int4_16_lut_zblk(w, woff, nchunk - c0, cshift, sc, soff, skind, zbuf, b0, xa, xb, xoff, xs,
                                     r * nchunk)
    return qrow_int4_16_lut_zrow(w, woff, nchunk - c0, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, r * nchunk)


@njit(inline="always", error_model="numpy")
def _int4_lut_dot2(w, sc, skind, zbuf, zbuf2, zmode, nb, cshift, nchunk, e, n, n2, xa, xb, xs, r, c0):
    """(_int4_lut_dot of row n, the same of row n2 with zero points zbuf2), bit for bit, by one row kernel that
    loads the activations once for both rows."""
    E, N, Kb = w.shape
    b0 = c0 >> cshift
    woff = (e * N + n) * Kb + 16 * c0
    woff2 = (e * N + n2) * Kb + 16 * c0
    soff = (e * N + n) * nb + b0
    soff2 = (e * N + n2) * nb + b0
    xoff = r * xa.shape[1] + 16 * c0
    if zmode == 2:
        return qrow2_int4_16_lut_zblk(w, woff, woff2, nchunk - c0, cshift, sc, soff, soff2, skind, zbuf, zbuf2, b0, xa,
                                      xb, xoff, xs, r * nchunk)
    return qrow2_int4_16_lut_zrow(w, woff, woff2, nchunk - c0, cshift, sc, soff, soff2, skind, zbuf, zbuf2, 0, xa, xb,
                                  xoff, xs, r * nchunk)


@njit(inline="always", error_model="numpy")
def _fc2_first_chunk(spans, e, cshift2):
    """The first FC2 chunk (32 int4 codes) an expert's part reads in the int4-rows loop: its first row (moe_gemv's
    spans) where that starts a chunk and a scale block (per-row scales: any chunk), else 0 (the whole row, its
    activations below the span 0)."""
    if spans.shape[0] == 0:
        return 0
    r0 = spans[e, 0]
    c0 = r0 >> 5
    if c0 << 5 != r0 or (cshift2 < 62 and c0 & ((1 << cshift2) - 1) != 0):
        return 0
    return c0


@njit(inline="always", error_model="numpy")
def _qdot(w, sc, skind, zbuf, zmode, bits, nb, chunk, cshift, nchunk, fmt, bpc, aux, e, n, xa, xb, xs, r):
    """W_e[n, :] . x_r with x given as (xa, xb, xs) rows r (see _split_row; xs unused where _uses_lut).

    fmt FMT_INT: codes minus zero points (zbuf) times the block scales; FMT_FP4: E2M1 codes and fp8 block-scale
    codes decoded through expert e's TBL_RECORD in aux. bpc: quantisation blocks per 16-byte chunk (1, 2 or 4).
    """
    E, N, Kb = w.shape
    woff = (e * N + n) * Kb
    soff = (e * N + n) * nb
    aoff = e * TBL_RECORD
    xoff = r * xa.shape[1]
    if fmt == FMT_FP4:
        if bpc == 2:
            acc = qrow_fp4_2(w, woff, nchunk, cshift, sc, soff, skind, aux, aoff, xa, xb, xoff, xs, 0)
        else:
            acc = qrow_fp4_1(w, woff, nchunk, cshift, sc, soff, skind, aux, aoff, xa, xb, xoff, xs, 0)
    elif bits == 3:  # four slot streams (+ the lane sums) 16 nchunk apart in xa
        S = 16 * nchunk
        if zmode == 2:
            if bpc == 2:
                acc = qrow_int3_zblk_2(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, S)
            else:
                acc = qrow_int3_zblk_1(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, S)
        elif bpc == 2:
            acc = qrow_int3_zrow_2(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, S)
        else:
            acc = qrow_int3_zrow_1(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, S)
    elif bits == 2:  # the four slot streams of row r (and the lane sums, see _lane_sums) lie Kb apart in xa
        if zmode == 2:
            if bpc == 4:
                acc = qrow_int2_zblk_4(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
            elif bpc == 2:
                acc = qrow_int2_zblk_2(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
            else:
                acc = qrow_int2_zblk_1(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
        elif bpc == 4:
            acc = qrow_int2_zrow_4(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
        elif bpc == 2:
            acc = qrow_int2_zrow_2(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
        else:
            acc = qrow_int2_zrow_1(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, Kb)
    elif bits == 4:
        if chunk == 16:
            acc = _int4_lut_dot(w, sc, skind, zbuf, zmode, nb, cshift, nchunk, e, n, xa, xb, xs, r, 0)
        else:
            acc = qrow_int4_8(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, r * nchunk)
    else:
        acc = qrow_int8_16(w, woff, nchunk, cshift, sc, soff, skind, zbuf, 0, xa, xb, xoff, xs, r * nchunk)
    full = nchunk * chunk
    if full < Kb and bpc == 4:
        acc += _int2_b16_tail_dot(w, sc, skind, zbuf, e, n, soff, full, xa, r)
    elif full < Kb:  # ragged tail: the bytes after the last whole chunk, all in the row's last block
        s = _block_scale(sc, soff + nb - 1, skind, fmt, aux, aoff)
        z = zbuf[nb - 1]
        t = np.float32(0.0)
        if bits == 3:  # codes past K (padding bits) meet zero activations
            wr = w[e, n]
            for j in range(nchunk * 64, (8 * Kb) // 3):
                t += (np.float32(_bits3(wr, 3 * j)) - z) * xa[r, 16 * nchunk + j]
        for j in range(full, Kb if bits != 3 else 0):
            q = w[e, n, j]
            if bits == 4:
                t += _code_value(q & 15, fmt, z, aux, aoff) * xa[r, j] + _code_value(q >> 4, fmt, z, aux, aoff) * xb[r, j]
            elif bits == 2:
                for c in range(4):
                    t += _code_value((q >> (2 * c)) & 3, fmt, z, aux, aoff) * xa[r, c * Kb + j]
            else:
                t += _code_value(q, fmt, z, aux, aoff) * xa[r, j]
        acc += s * t
    return acc


@njit(inline="always", error_model="numpy")
def _uses_lut(bits, chunk, fmt):
    """Rows read through the table kernels (no per-chunk activation sums needed): fp4, int2, and int4 rows of
    16-byte chunks where AVX-512F is available."""
    return fmt == FMT_FP4 or bits == 2 or bits == 3 or (HAS_AVX512F and bits == 4 and chunk == 16)


@njit(inline="always", error_model="numpy")
def _x_width(bits, Kb, nchunk):
    """Floats per row of the xa array the GEMV reads: int2 keeps its four slot streams (Kb each) and a fifth
    for the lane sums (_lane_sum_stride) in xa; int3 its five streams and tail (int3_width)."""
    if bits == 3:
        return int3_width(Kb, nchunk)
    return 5 * Kb if bits == 2 else Kb


@njit(inline="always", error_model="numpy")
def _put_x(v, i, p, bits, Kb, aa, ab, nchunk):
    """Value of input k = i of row p into the GEMV's activation layout (int4: even / odd k in aa / ab;
    int2: slot i & 3 of byte i >> 2 in aa; int8: aa)."""
    if bits == 4:
        if i & 1:
            ab[p, i >> 1] = v
        else:
            aa[p, i >> 1] = v
    elif bits == 2:
        aa[p, (i & 3) * Kb + (i >> 2)] = v
    elif bits == 3:
        aa[p, int3_position(i, nchunk)] = v
    else:
        aa[p, i] = v


@njit(inline="always", error_model="numpy")
def _lane_sum_stride(bits, zmode, bpc, Kb, nchunk):
    """Length S of the four slot streams of a row whose kernel reads each lane's sum over them as a fifth stream
    at 4 S (per-block zero points folded out of the lookups): int3 (S = 16 nchunk), int2 block 16 with zero
    points (S = Kb); 0 for the others."""
    if bits == 3:
        return 16 * nchunk
    if bits == 2 and zmode == 2 and bpc == 4:
        return Kb
    return 0


@njit(inline="always", error_model="numpy")
def _lane_sums(xa, o, S):
    """Fifth activation stream of row o: each lane's sum over the four slot streams of length S."""
    for j in range(S):
        xa[o, 4 * S + j] = xa[o, j] + xa[o, S + j] + xa[o, 2 * S + j] + xa[o, 3 * S + j]


@njit(inline="always", error_model="numpy")
def _split_row(x, r, bits, chunk, nchunk, fmt, xa, xb, xs, o):
    """Row r of x into row o of (xa, xb, xs) in the GEMV's activation layout (_put_x); per-chunk sums (the lane
    sums: _lane_sums)."""
    K = x.shape[1]
    Kb = xb.shape[1]
    if bits == 3:  # padding positions (codes past K) must read as 0
        for i in range(xa.shape[1]):
            xa[o, i] = np.float32(0.0)
    for i in range(K):
        _put_x(x[r, i], i, o, bits, Kb, xa, xb, nchunk)
    vals = chunk * (8 // bits)
    for c in range(nchunk if not _uses_lut(bits, chunk, fmt) else 0):
        s = np.float32(0.0)
        for j in range(c * vals, (c + 1) * vals):
            s += x[r, j]
        xs[o, c] = s


@njit(cache=True, nogil=True, error_model="numpy")
def _claim_init(cnt, nck, nth, order):
    """Chunk counters of one region (see _claim): order 0 one shared counter at cnt[0]; 1 one counter per
    thread (64 bytes apart) starting at the thread's own contiguous span of chunks."""
    if order == 0:
        cnt[0] = 0
    else:
        for t in range(nth):
            cnt[t * 8] = t * nck // nth


@njit(cache=True, nogil=True, error_model="numpy")
def _claim(cnt, vic, th, nth, nck, order):
    """Next chunk for thread th, or -1. order 0: from the shared counter (chunks interleave between
    threads). order 1: from the thread's own span first (one contiguous stream per thread), then from the
    other threads' spans (vic[0] = the span it is working on)."""
    if order == 0:
        ci = atomic_fetch_add(cnt, 0, 1)
        return ci if ci < nck else -1
    while True:
        v = vic[0]
        ci = atomic_fetch_add(cnt, v * 8, 1)
        if ci < (v + 1) * nck // nth:
            return ci
        v = v + 1 if v + 1 < nth else 0
        if v == th:
            return -1
        vic[0] = v


@njit(inline="always", error_model="numpy")
def _row_kernel_prefetches(bits, chunk, fmt):
    """Whether the row kernel prefetches its own weight bytes ahead as it reads (simd.ROW_PREFETCH_AHEAD: the
    table kernels of fp4, int2, and int4 rows of 16-byte chunks where AVX-512F is available)."""
    return fmt == FMT_FP4 or bits == 2 or (HAS_AVX512F and bits == 4 and chunk == 16)


@njit(inline="always", error_model="numpy")
def _prefetch_row(w, sc, e, n, ahead, weights):
    """Prefetch the scales of row n + ahead of expert e, and with `weights` its packed bytes (clipped to the
    arrays)."""
    E, N, Kb = w.shape
    nb = sc.shape[2]
    row = e * N + n + ahead
    if weights:
        prefetch_bytes(w, row * Kb, Kb)
    prefetch_bytes(sc, row * nb * sc.itemsize, nb * sc.itemsize)


@njit(inline="always", error_model="numpy")
def _fc2_input_sums(aa, ab, xs2, p, lanes2, bits2, chunk2, nchunk2, fmt2):
    """What FC2's kernels read besides pair p's activations (written by FC1): the lane sums (int3, int2 block 16
    with zero points), or the per-chunk sums (layouts without the table kernels)."""
    if lanes2:
        _lane_sums(aa, p, lanes2)
    if not _uses_lut(bits2, chunk2, fmt2):
        for c in range(nchunk2):
            s = np.float32(0.0)
            for j in range(c * chunk2, (c + 1) * chunk2):
                s += aa[p, j]
                if bits2 == 4:
                    s += ab[p, j]
            xs2[p, c] = s


@njit(inline="always", error_model="numpy")
def _fc2_row_start(w2, sc2, zp2, b2, zmode2, bits2, nb2, zrb2, hb2, e, n, pf_rows, pfw, zbuf):
    """FC2 row n of expert e before its dot products: the rows ahead prefetched, its zero points into zbuf; returns
    its bias."""
    if pf_rows > 0:
        _prefetch_row(w2, sc2, e, n, pf_rows, pfw)
    if zmode2 != 0:
        _fill_zp_range(zbuf, zp2, zmode2, e, n, bits2, zrb2, 0, nb2)
    return b2[e, n] if hb2 else np.float32(0.0)


# The per-thread loops run without NRT reference counting (_nrt=False; they allocate nothing): with it, every
# inlined _qdot call increfs and decrefs its six array arguments, 12 atomic operations per weight row on cache lines
# that all threads share (one core: ~50 ns a row of the 20-70 ns of work in a 384-1440-byte row).
@njit(fastmath=True, cache=True, nogil=True, _nrt=False, error_model="numpy")
def _gemv_fc1_thread(w1, sc1, zp1, b1, skind1, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, fmt1, bpc1, aux1, hb1,
                     zrb1, zdef1, experts, pair_off, src, rowmap, spans, xa1, xb1, xs1, aa, ab, xs2, bits2, chunk2,
                     nchunk2, fmt2, lanes2, G, I, swiglu, fusion, act_kind, a_, b_, l_, has_limit, pf_rows, done, cnt,
                     th, nth, nck, ch, order, zg, zu, vic):
    """Thread th's share of FC1 + activation: chunks of ch row groups of the (expert, group) space claimed from cnt
    until none is left (see moe_gemv). done[8 u] counts expert u's finished groups; the thread that finishes the
    last one also writes FC2's input sums of u's pairs, then adds 1 (done[8 u] = G + 1: FC2 may read expert u).
    zg / zu: nb1 floats of zero-point scratch; vic: the thread's _claim state. Rows outside an expert's span
    (moe_gemv's spans) get activation 0."""
    zg[:] = zdef1
    zu[:] = zdef1
    vic[0] = th
    pfw = not _row_kernel_prefetches(bits1, chunk1, fmt1)
    # int4 rows of whole 16-byte chunks in a pair loop of their own, holding their row kernel alone (as in
    # _gemv_fc2_thread): ~3% less time on the dev VM (ab_kernel_source.py, NOTES-cpu-kernels "Forty-sixth session").
    # A gated pair's gate and up rows go through one two-row kernel (the activations loaded once for both), as FC2's
    # rows in pairs: with both, 5-10% less time on the H200 machine's Xeon, 16 threads (NOTES-cpu-kernels,
    # "Forty-seventh session")
    int4_rows = bits1 == 4 and chunk1 == 16 and fmt1 == FMT_INT and nchunk1 * 16 == w1.shape[2]
    total = experts.shape[0] * G
    ci = _claim(cnt, vic, th, nth, nck, order)
    while ci >= 0:
        idx = ci * ch
        hi = min(total, idx + ch)
        while idx < hi:  # the chunk's part in one expert at a time
            u = idx // G
            end = min(hi, (u + 1) * G)
            e = experts[u]
            r0, r1 = (spans[e, 0], spans[e, 1]) if spans.shape[0] else (0, G)
            for i in range(idx - u * G, end - u * G):
                if i < r0 or i >= r1:
                    for p in range(pair_off[u], pair_off[u + 1]):
                        _put_x(np.float32(0.0), i, p, bits2, ab.shape[1], aa, ab, nchunk2)
                    continue
                if swiglu:
                    if fusion == 1:
                        ng = 2 * i
                        nu = 2 * i + 1
                    else:
                        ng = i
                        nu = I + i
                else:
                    ng = i
                    nu = i
                if pf_rows > 0:
                    _prefetch_row(w1, sc1, e, ng, pf_rows, pfw)
                    if swiglu and fusion == 2:
                        _prefetch_row(w1, sc1, e, nu, pf_rows, pfw)
                bg = b1[e, ng] if hb1 else np.float32(0.0)
                bu = b1[e, nu] if hb1 else np.float32(0.0)
                if zmode1 != 0:
                    _fill_zp_range(zg, zp1, zmode1, e, ng, bits1, zrb1, 0, nb1)
                    if swiglu:
                        _fill_zp_range(zu, zp1, zmode1, e, nu, bits1, zrb1, 0, nb1)
                if int4_rows:
                    for p in range(pair_off[u], pair_off[u + 1]):
                        r = rowmap[src[p]]
                        if swiglu:
                            g, l = _int4_lut_dot2(w1, sc1, skind1, zg, zu, zmode1, nb1, cshift1, nchunk1, e, ng, nu,
                                                  xa1, xb1, xs1, r, 0)
                            a = _swiglu(g + bg, l + bu, a_, b_, l_, has_limit)
                        else:
                            a = _act(act_kind, _int4_lut_dot(w1, sc1, skind1, zg, zmode1, nb1, cshift1, nchunk1, e, ng,
                                                             xa1, xb1, xs1, r, 0) + bg)
                        _put_x(a, i, p, bits2, ab.shape[1], aa, ab, nchunk2)
                else:
                    for p in range(pair_off[u], pair_off[u + 1]):
                        r = rowmap[src[p]]
                        g = _qdot(w1, sc1, skind1, zg, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, fmt1, bpc1, aux1,
                                  e, ng, xa1, xb1, xs1, r) + bg
                        if swiglu:
                            l = _qdot(w1, sc1, skind1, zu, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, fmt1, bpc1,
                                      aux1, e, nu, xa1, xb1, xs1, r) + bu
                            a = _swiglu(g, l, a_, b_, l_, has_limit)
                        else:
                            a = _act(act_kind, g)
                        _put_x(a, i, p, bits2, ab.shape[1], aa, ab, nchunk2)
            if atomic_fetch_add(done, 8 * u, end - idx) + end - idx == G:
                for p in range(pair_off[u], pair_off[u + 1]):
                    _fc2_input_sums(aa, ab, xs2, p, lanes2, bits2, chunk2, nchunk2, fmt2)
                atomic_fetch_add(done, 8 * u, 1)
            idx = end
        ci = _claim(cnt, vic, th, nth, nck, order)


@njit(fastmath=True, cache=True, nogil=True, _nrt=False, error_model="numpy")
def _gemv_fc2_thread(w2, sc2, zp2, b2, skind2, zmode2, bits2, nb2, chunk2, cshift2, nchunk2, fmt2, bpc2, aux2, hb2,
                     zrb2, zdef2, experts, pair_off, spans, coef, aa, ab, xs2, y, G, pf_rows, done, cnt, th, nth, nck,
                     ch, order, zbuf, zbuf2, vic):
    """Thread th's share of FC2: chunks of ch rows of the (expert, row) space claimed from cnt into y (see
    moe_gemv), each expert's rows once its FC1 is finished (done[8 u] = G + 1, see _gemv_fc1_thread).
    zbuf, zbuf2 (the second row's of a pair), vic: as zg, zu, vic of _gemv_fc1_thread. An expert whose span
    (moe_gemv's spans) starts past row 0 gets no bias."""
    H = w2.shape[1]
    Kb2 = w2.shape[2]
    zbuf[:] = zdef2
    zbuf2[:] = zdef2
    vic[0] = th
    pfw = not _row_kernel_prefetches(bits2, chunk2, fmt2)
    # int4 rows of whole 16-byte chunks (the common layout) run in a loop of their own, which holds their row kernel
    # alone, not every layout's through _qdot: 5-11% less time for the whole call on the dev VM, measured in one
    # process (ab_kernel_source.py; NOTES-cpu-kernels.md, "Forty-sixth session"); 6-9% on the Xeon with FC1's loop
    # (8c80dd8). They go two rows to a row kernel call (Qwen3-30B-A3B's rows are 384 bytes: the per-row work weighs)
    int4_rows = bits2 == 4 and chunk2 == 16 and fmt2 == FMT_INT and nchunk2 * 16 == Kb2
    total = experts.shape[0] * H
    ci = _claim(cnt, vic, th, nth, nck, order)
    while ci >= 0:
        idx = ci * ch
        hi = min(total, idx + ch)
        while idx < hi:
            u = idx // H
            end = min(hi, (u + 1) * H)
            e = experts[u]
            hbe = hb2 if spans.shape[0] == 0 or spans[e, 0] == 0 else 0
            c0 = _fc2_first_chunk(spans, e, cshift2) if int4_rows else 0
            if atomic_load(done, 8 * u) <= G:
                # expert u's FC1 is still running: fetch this part's rows and scales meanwhile (they do not depend on
                # it), so that in a small call the threads do not all start cold streams at once when it ends
                row0 = e * H + idx - u * H
                prefetch_bytes(w2, row0 * Kb2, (end - idx) * Kb2)
                prefetch_bytes(sc2, row0 * nb2 * sc2.itemsize, (end - idx) * nb2 * sc2.itemsize)
                while atomic_load(done, 8 * u) <= G:
                    pass
            if int4_rows:
                n = idx - u * H
                while n + 1 < end - u * H:  # rows n, n + 1 by one row kernel
                    bval = _fc2_row_start(w2, sc2, zp2, b2, zmode2, bits2, nb2, zrb2, hbe, e, n, pf_rows, pfw, zbuf)
                    bval2 = _fc2_row_start(w2, sc2, zp2, b2, zmode2, bits2, nb2, zrb2, hbe, e, n + 1, pf_rows, pfw,
                                           zbuf2)
                    for p in range(pair_off[u], pair_off[u + 1]):
                        d, d2 = _int4_lut_dot2(w2, sc2, skind2, zbuf, zbuf2, zmode2, nb2, cshift2, nchunk2, e, n, n + 1,
                                               aa, ab, xs2, p, c0)
                        y[p, n] = coef[p] * (d + bval)
                        y[p, n + 1] = coef[p] * (d2 + bval2)
                    n += 2
                if n < end - u * H:
                    bval = _fc2_row_start(w2, sc2, zp2, b2, zmode2, bits2, nb2, zrb2, hbe, e, n, pf_rows, pfw, zbuf)
                    for p in range(pair_off[u], pair_off[u + 1]):
                        y[p, n] = coef[p] * (_int4_lut_dot(w2, sc2, skind2, zbuf, zmode2, nb2, cshift2, nchunk2, e, n,
                                                           aa, ab, xs2, p, c0) + bval)
            else:
                for n in range(idx - u * H, end - u * H):
                    bval = _fc2_row_start(w2, sc2, zp2, b2, zmode2, bits2, nb2, zrb2, hbe, e, n, pf_rows, pfw, zbuf)
                    for p in range(pair_off[u], pair_off[u + 1]):
                        y[p, n] = coef[p] * (_qdot(w2, sc2, skind2, zbuf, zmode2, bits2, nb2, chunk2, cshift2,
                                                   nchunk2, fmt2, bpc2, aux2, e, n, aa, ab, xs2, p) + bval)
            idx = end
        ci = _claim(cnt, vic, th, nth, nck, order)


@njit(parallel=PRANGE_ONLY, fastmath=True, cache=True, nogil=True, error_model="numpy")
def moe_gemv(w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2, x, experts, pair_off, src, coef, dst, spans,
             act_kind, fusion, alpha, beta, limit, has_limit, pf_rows, chunk_bytes, order, ws, y, out,
             do_reduce, nth):
    """Fused decode: for each pair p (token src[p], expert experts[u], pair_off[u] <= p < pair_off[u + 1])
    y[p] = coef[p] * (W2_e act(W1_e x + b1_e) + b2_e); with do_reduce also out[dst[p]] += y[p].

    q1 / q2: int64 [skind, zmode, bits, nb, chunk, cshift, nchunk, has_bias, fmt, bpc] of fc1 / fc2, aux1 / aux2
    their per-expert TBL_RECORDs (fp4; see _qdot); act: swiglu
    (fusion 1: rows 2i, 2i+1; fusion 2: rows i, I + i) or a non-gated activation (no FC3).
    FC1 + activation, then FC2, over the (expert, row) space, handed out in contiguous chunks of ~chunk_bytes
    through atomic counters (order: see _claim); pf_rows > 0 prefetches that many rows ahead (the scales only where
    the row kernel prefetches its weight bytes itself: _row_kernel_prefetches). One parallel region:
    a thread goes on to FC2 once it finds no FC1 chunk left and waits only for experts whose FC1 is still running
    (per-expert counters); two regions cost a second fork / join (waking 16 passively waiting omp threads: tens of
    µs on the Xeon).
    spans: int64 [E, 2], or no rows for whole experts: expert e's intermediate rows [spans[e, 0], spans[e, 1]) only,
    a part of the expert whose parts over all rows add up to it (the offload engine's pair split between the CPU and
    the GPU, kernels/cold_split.py). The other rows' activations are 0; FC2 reads its rows from the span's start in
    the int4-rows loop (_fc2_first_chunk), whole elsewhere. FC2's bias is added only by the part from row 0.
    ws: float32 scratch.
    """
    Kb1 = w1.shape[2]
    H, Kb2 = w2.shape[1], w2.shape[2]
    T = x.shape[0]
    P = src.shape[0]
    U = experts.shape[0]
    # inputs of FC2 (int3 rows end in padding bits: I from FC1's rows, 2 I for swiglu, I otherwise)
    I = w2.shape[2] * (8 // q2[2]) if q2[2] != 3 else (w1.shape[1] // 2 if act_kind == ACT_SWIGLU else w1.shape[1])
    skind1, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, hb1 = q1[0], q1[1], q1[2], q1[3], q1[4], q1[5], q1[6], q1[7]
    skind2, zmode2, bits2, nb2, chunk2, cshift2, nchunk2, hb2 = q2[0], q2[1], q2[2], q2[3], q2[4], q2[5], q2[6], q2[7]
    fmt1, bpc1, fmt2, bpc2 = q1[8], q1[9], q2[8], q2[9]
    xw1 = _x_width(bits1, Kb1, q1[6])
    xw2 = _x_width(bits2, Kb2, q2[6])
    # scratch: x rows (deduplicated tokens) split for fc1, activations split for fc2
    rowmap = np.full(T, -1, np.int64)
    nrows = 0
    for p in range(P):
        if rowmap[src[p]] < 0:
            rowmap[src[p]] = nrows
            nrows += 1
    o = 0
    xa1 = ws[o:o + nrows * xw1].reshape(nrows, xw1)
    o += nrows * xw1
    xb1 = ws[o:o + nrows * Kb1].reshape(nrows, Kb1)
    o += nrows * Kb1
    xs1 = ws[o:o + nrows * nchunk1].reshape(nrows, nchunk1)
    o += nrows * nchunk1
    aa = ws[o:o + P * xw2].reshape(P, xw2)
    o += P * xw2
    ab = ws[o:o + P * Kb2].reshape(P, Kb2)
    o += P * Kb2
    xs2 = ws[o:o + P * nchunk2].reshape(P, nchunk2)
    lanes1 = _lane_sum_stride(bits1, zmode1, bpc1, Kb1, nchunk1)
    lanes2 = _lane_sum_stride(bits2, zmode2, bpc2, Kb2, nchunk2)
    for t in range(T):
        if rowmap[t] >= 0:
            _split_row(x, t, bits1, chunk1, nchunk1, fmt1, xa1, xb1, xs1, rowmap[t])
            _lane_sums(xa1, rowmap[t], lanes1)
    if bits1 == 8:
        xb1 = xa1
    if bits2 == 3:  # FC2's padding positions (codes past I) must read as 0
        for p in range(P):
            for j in range(xw2):
                aa[p, j] = np.float32(0.0)
    if bits2 == 8:  # FC1 writes int8 activations into aa only; FC2's kernels read them as both streams
        ab = aa
    swiglu = act_kind == ACT_SWIGLU
    a_ = np.float32(alpha)
    b_ = np.float32(beta)
    l_ = np.float32(limit)
    zdef1 = np.float32(1 << (bits1 - 1))
    zdef2 = np.float32(1 << (bits2 - 1))
    zrb1 = (nb1 * bits1 + 7) // 8
    zrb2 = (nb2 * bits2 + 7) // 8
    # work handed out in chunks of packed rows through atomic counters: a thread that is descheduled or slowed
    # (SMT sibling, other tenants) does not hold up the whole region
    rpg = 2 if swiglu else 1
    ch1 = max(1, chunk_bytes // (rpg * (Kb1 + nb1 * sc1.itemsize)))
    nck1 = (U * I + ch1 - 1) // ch1
    ch2 = max(1, chunk_bytes // (Kb2 + nb2 * sc2.itemsize))
    nck2 = (U * H + ch2 - 1) // ch2
    cnt1 = np.zeros(8 * nth, np.int64)
    cnt2 = np.zeros(8 * nth, np.int64)
    _claim_init(cnt1, nck1, nth, order)
    _claim_init(cnt2, nck2, nth, order)
    done = np.zeros(8 * U, np.int64)  # per expert, 64 bytes apart: FC1 groups finished (see _gemv_fc1_thread)
    # per-thread scratch (zero points, _claim state): rows of arrays made here (the thread loops allocate nothing)
    zs = np.empty((nth, 2 * nb1 + 2 * nb2), np.float32)
    vics = np.empty((nth, 8), np.int64)
    for th_loop in prange(nth):
        # the thread's index as int64: Numba types a prange index int64 first and uint64 in the parallel loop it makes,
        # and would compile each thread function for both (~20 s a layout on a cold cache, one of them never run)
        th = np.int64(th_loop)
        _gemv_fc1_thread(w1, sc1, zp1, b1, skind1, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, fmt1, bpc1, aux1, hb1,
                         zrb1, zdef1, experts, pair_off, src, rowmap, spans, xa1, xb1, xs1, aa, ab, xs2, bits2, chunk2,
                         nchunk2, fmt2, lanes2, I, I, swiglu, fusion, act_kind, a_, b_, l_, has_limit, pf_rows, done,
                         cnt1, th, nth, nck1, ch1, order, zs[th, :nb1], zs[th, nb1:2 * nb1], vics[th])
        _gemv_fc2_thread(w2, sc2, zp2, b2, skind2, zmode2, bits2, nb2, chunk2, cshift2, nchunk2, fmt2, bpc2, aux2, hb2,
                         zrb2, zdef2, experts, pair_off, spans, coef, aa, ab, xs2, y, I, pf_rows, done, cnt2, th, nth,
                         nck2, ch2, order, zs[th, 2 * nb1:2 * nb1 + nb2], zs[th, 2 * nb1 + nb2:], vics[th])
    if do_reduce:
        for p in range(P):
            d = dst[p]
            for h in range(H):
                out[d, h] += y[p, h]
