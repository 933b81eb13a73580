"""CPU execution of the QMoE layouts / activations the fast kernels (kernels.py) do not read, and a second
implementation of those they do (``GenericQMoE`` runs any node; tests and the benchmark compare the two).

Every projection, in any layout of the contract (int2 / int3 / int4 / int8 rows, MXFP4 / NVFP4 E2M1 with
e8m0 / e4m3 block scales and global scales, fp8 e4m3 with square-block or global scales), is dequantised
row by row into float32 inside Numba kernels, never as a whole weight set:

- ``gemm_rows`` (decode and prefill alike, one call per projection for all experts of a batch): each block of
  16 output rows is dequantised 4 rows at a time into a small float32 tile, once per expert, and multiplied
  with that expert's tokens 4 at a time in registers (tile @ x^T); parallel over row blocks;
- ``dequant_tile`` expands rows of one expert (tests, tools).

Two layouts are converted per expert, lazily, the first time an expert runs (``LazyConverted``): SM80
prepacked int4 / int8 -> raw rows, and NVFP4 N-packed [K, N/2] -> K-packed rows (which the fast kernels then
read: ``delegate_for`` returns a CpuQMoE over the converted tensors; GenericQMoE converts them for itself). The converted experts live in
anonymous memory: a model in those layouts costs up to its expert size once more in RAM, only for experts
that have run.

``delegate_for`` is the dispatch CpuQMoE calls: None when the fast kernels handle the node themselves.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
from numba import njit, prange

from .. import layouts as L
from ..qmoe_spec import QMoESpec, UnsupportedLayout
from .threads import PRANGE_ONLY, use_threads

__all__ = ["delegate_for", "fast_layout", "GenericQMoE", "activate", "FAST_ACTIVATIONS", "LazyConverted",
           "sm80_to_raw", "n_packed_to_k_packed"]

#: activations kernels/cpu/kernels.py implements (fused in its epilogues); others run here
FAST_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")

FMT_INT, FMT_FP4, FMT_FP8 = 0, 1, 2
SK_F32, SK_U16, SK_U8, SK_NONE = 0, 1, 2, 3
ROWS_PER_TASK = 16
# ip: integer layout parameters of a projection, one int64 array (one Numba specialisation for all layouts)
IP_FMT, IP_BITS, IP_N, IP_K, IP_ROWB, IP_BSK, IP_NB, IP_BSN, IP_SKIND, IP_ZMODE, IP_ZRB, IP_HASBIAS = range(12)


def _ro(a) -> np.ndarray:
    """Read-only C-contiguous view (the kernels see one array type whatever the source: memmap or not)."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _dummy(dtype, ndim=2):
    return _ro(np.zeros((1,) * ndim, dtype))


_LUT16 = {}


def _lut16(kind: str) -> np.ndarray:
    """float32 value of every 16-bit pattern: 'fp16' or 'bf16'."""
    if kind not in _LUT16:
        bits = np.arange(65536, dtype=np.uint32)
        vals = (L.half_bits_to_float(bits.astype(np.uint16)) if kind == "fp16"
                else L.bf16_bits_to_float(bits.astype(np.uint16)))
        _LUT16[kind] = _ro(vals.astype(np.float32))
    return _LUT16[kind]


# ----------------------------------------------------------------------------- Numba: one row
@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _dq_row(ip, w, sc32, sc16, sc8, lut16, lut8, zp, zdef, gsc, clut, e, n, out):
    """Row n of expert e, dequantised into out[0:K] (float32)."""
    fmt = ip[IP_FMT]
    bits = ip[IP_BITS]
    K = ip[IP_K]
    bsk = ip[IP_BSK]
    nb = ip[IP_NB]
    bsn = ip[IP_BSN]
    skind = ip[IP_SKIND]
    zmode = ip[IP_ZMODE]
    base = n * ip[IP_ROWB]
    srow = n // bsn if bsn > 0 else n
    for b in range(nb):
        k0 = b * bsk
        k1 = min(K, k0 + bsk)
        si = srow * nb + b
        if skind == SK_F32:
            s = sc32[e, si]
        elif skind == SK_U16:
            s = lut16[sc16[e, si]]
        elif skind == SK_U8:
            s = lut8[sc8[e, si]]
        else:
            s = np.float32(1.0)
        s = s * gsc
        if fmt == FMT_INT:
            z = zdef
            if zmode == 1:  # per row, bit stream along N
                bp = n * bits
                v = np.int64(zp[e, bp >> 3]) | (np.int64(zp[e, min((bp >> 3) + 1, zp.shape[1] - 1)]) << 8)
                z = np.float32((v >> (bp & 7)) & ((1 << bits) - 1))
            elif zmode == 2:  # per block, bit stream along the blocks of the row
                bp = b * bits
                zb = n * ip[IP_ZRB] + (bp >> 3)
                v = np.int64(zp[e, zb])
                if (bp & 7) + bits > 8:
                    v |= np.int64(zp[e, zb + 1]) << 8
                z = np.float32((v >> (bp & 7)) & ((1 << bits) - 1))
            zs = z * s
            # whole bytes (whole 3-byte groups for int3) first: blocks start on a byte (group) boundary
            if bits == 8:
                for k in range(k0, k1):
                    out[k] = np.float32(w[e, base + k]) * s - zs
            elif bits == 4:
                j0 = base + (k0 >> 1)
                for j in range((k1 - k0) >> 1):
                    v = w[e, j0 + j]
                    out[k0 + 2 * j] = np.float32(v & 15) * s - zs
                    out[k0 + 2 * j + 1] = np.float32(v >> 4) * s - zs
                if (k1 - k0) & 1:
                    out[k1 - 1] = np.float32(w[e, base + ((k1 - 1) >> 1)] & 15) * s - zs
            elif bits == 2:
                j0 = base + (k0 >> 2)
                for j in range((k1 - k0) >> 2):
                    v = w[e, j0 + j]
                    o = k0 + 4 * j
                    out[o] = np.float32(v & 3) * s - zs
                    out[o + 1] = np.float32((v >> 2) & 3) * s - zs
                    out[o + 2] = np.float32((v >> 4) & 3) * s - zs
                    out[o + 3] = np.float32(v >> 6) * s - zs
                for k in range(k1 - ((k1 - k0) & 3), k1):
                    out[k] = np.float32((w[e, base + (k >> 2)] >> ((k & 3) * 2)) & 3) * s - zs
            else:  # 3 bits: LSB-first stream, 8 codes per 3 bytes; a code may straddle two bytes
                j0 = base + (k0 >> 3) * 3
                for g in range((k1 - k0) >> 3):
                    i = j0 + 3 * g
                    v = np.int64(w[e, i]) | (np.int64(w[e, i + 1]) << 8) | (np.int64(w[e, i + 2]) << 16)
                    o = k0 + 8 * g
                    for c in range(8):
                        out[o + c] = np.float32((v >> (3 * c)) & 7) * s - zs
                last = base + ip[IP_ROWB] - 1
                for k in range(k1 - ((k1 - k0) & 7), k1):
                    bp = 3 * k
                    i = base + (bp >> 3)
                    v = np.int64(w[e, i]) | (np.int64(w[e, min(i + 1, last)]) << 8)
                    out[k] = np.float32((v >> (bp & 7)) & 7) * s - zs
        elif fmt == FMT_FP4:  # K-packed E2M1, low nibble = even k (blocks of 16 / 32: whole bytes)
            j0 = base + (k0 >> 1)
            for j in range((k1 - k0) >> 1):
                v = w[e, j0 + j]
                out[k0 + 2 * j] = clut[v & 15] * s
                out[k0 + 2 * j + 1] = clut[v >> 4] * s
        else:  # fp8 e4m3 bytes
            for k in range(k0, k1):
                out[k] = clut[w[e, base + k]] * s


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _dot4x4(t, x, r0, r1, r2, r3, K, acc):
    """acc[i, j] = t[i, :K] . x[r_j, :K] for 4 dequantised rows and 4 tokens (16 accumulators, k vectorised)."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(K):
        x0 = x[r0, k]
        x1 = x[r1, k]
        x2 = x[r2, k]
        x3 = x[r3, k]
        w0 = t[0, k]
        w1 = t[1, k]
        w2 = t[2, k]
        w3 = t[3, k]
        a00 += w0 * x0
        a01 += w0 * x1
        a02 += w0 * x2
        a03 += w0 * x3
        a10 += w1 * x0
        a11 += w1 * x1
        a12 += w1 * x2
        a13 += w1 * x3
        a20 += w2 * x0
        a21 += w2 * x1
        a22 += w2 * x2
        a23 += w2 * x3
        a30 += w3 * x0
        a31 += w3 * x1
        a32 += w3 * x2
        a33 += w3 * x3
    acc[0, 0], acc[0, 1], acc[0, 2], acc[0, 3] = a00, a01, a02, a03
    acc[1, 0], acc[1, 1], acc[1, 2], acc[1, 3] = a10, a11, a12, a13
    acc[2, 0], acc[2, 1], acc[2, 2], acc[2, 3] = a20, a21, a22, a23
    acc[3, 0], acc[3, 1], acc[3, 2], acc[3, 3] = a30, a31, a32, a33


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _dot4x1(t, x, r, K, acc):
    """acc[i, 0] = t[i, :K] . x[r, :K] for 4 dequantised rows and one token."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(K):
        xv = x[r, k]
        a0 += t[0, k] * xv
        a1 += t[1, k] * xv
        a2 += t[2, k] * xv
        a3 += t[3, k] * xv
    acc[0, 0], acc[1, 0], acc[2, 0], acc[3, 0] = a0, a1, a2, a3


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, fastmath=True, error_model="numpy")
def gemm_rows(ip, w, sc32, sc16, sc8, lut16, lut8, zp, zdef, gs, clut, bias,
              experts, pair_off, src_row, dst_row, coef, x, out):
    """out[dst_row[p], n] += coef[p] * (W_e[n, :] . x[src_row[p]] + bias[e, n]) for the pairs p of each expert.

    Parallel over blocks of output rows (all experts in one call). Each block's rows are dequantised 4 at a time
    into a small float32 tile (once per expert and call) and multiplied with the expert's tokens 4 at a time in
    registers (tile @ x^T): the GEMV of decode and the GEMM of prefill are the same loop.
    """
    N = ip[IP_N]
    K = ip[IP_K]
    has_bias = ip[IP_HASBIAS] != 0
    U = experts.shape[0]
    ntask = (N + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(ntask):
        tile = np.zeros((4, K), np.float32)
        acc = np.empty((4, 4), np.float32)
        n0 = task * ROWS_PER_TASK
        n1 = min(N, n0 + ROWS_PER_TASK)
        for u in range(U):
            e = experts[u]
            p0 = pair_off[u]
            p1 = pair_off[u + 1]
            if p1 <= p0:
                continue
            for nb in range(n0, n1, 4):
                rows = min(4, n1 - nb)
                for i in range(rows):
                    _dq_row(ip, w, sc32, sc16, sc8, lut16, lut8, zp, zdef, gs[e], clut, e, nb + i, tile[i])
                p = p0
                while p < p1:
                    if p + 4 <= p1:
                        _dot4x4(tile, x, src_row[p], src_row[p + 1], src_row[p + 2], src_row[p + 3], K, acc)
                        width = 4
                    else:
                        _dot4x1(tile, x, src_row[p], K, acc)
                        width = 1
                    for i in range(rows):
                        bval = bias[e, nb + i] if has_bias else np.float32(0.0)
                        for j in range(width):
                            out[dst_row[p + j], nb + i] += coef[p + j] * (acc[i, j] + bval)
                    p += width


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, fastmath=True, error_model="numpy")
def dequant_tile(ip, w, sc32, sc16, sc8, lut16, lut8, zp, zdef, gs, clut, e, n0, n1, out):
    """Rows n0..n1 of expert e, dequantised into out[0:n1-n0, 0:K] (parallel over rows)."""
    for i in prange(n1 - n0):
        _dq_row(ip, w, sc32, sc16, sc8, lut16, lut8, zp, zdef, gs[e], clut, e, n0 + i, out[i])


# ----------------------------------------------------------------------------- Numba: per-expert conversions
@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, error_model="numpy")
def _sm80_to_raw_expert(src, N, K, bits, dst):
    """One expert: SM80 prepacked bytes (flat) -> raw rows [N, K*bits/8] (flat); see layouts.sm80_positions."""
    if bits == 4:
        R, I, G = 32, 4, 8
        inv_rp = np.array([0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28, 29,
                           6, 7, 14, 15, 22, 23, 30, 31], np.int64)
        inv_wp = np.array([0, 4, 1, 5, 2, 6, 3, 7], np.int64)
    else:
        R, I, G = 16, 2, 4
        inv_rp = np.array([0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15], np.int64)
        inv_wp = np.array([0, 2, 1, 3], np.int64)
    # inv_rp[k % R]: the row of its tile that logical k moves to; inv_wp: a code's slot in its 32-bit word
    ktiles = K // 64
    rowb = K * bits // 8
    for n in prange(N):
        a = n // I
        bb = n % I
        for k in range(K):
            r = (k // R) * R + inv_rp[k % R]
            idx = ((a * ktiles + r // 64) * I + bb) * 64 + (r % 64)
            pos = (idx // G) * G + inv_wp[idx % G]
            if bits == 4:
                q = (src[pos >> 1] >> ((pos & 1) * 4)) & 15
                o = n * rowb + (k >> 1)
                if k & 1:
                    dst[o] = dst[o] | (q << 4)
                else:
                    dst[o] = q
            else:
                dst[n * rowb + k] = src[pos]


@njit(parallel=PRANGE_ONLY, cache=True, nogil=True, error_model="numpy")
def _n_to_k_packed_expert(src, N, K, dst):
    """One expert: nvfp4 N-packed bytes [K, N/2] -> K-packed rows [N, K/2]."""
    half_n = N // 2
    half_k = K // 2
    for n in prange(N):
        sh = (n & 1) * 4
        for kb in range(half_k):
            lo = (src[(2 * kb) * half_n + (n >> 1)] >> sh) & 15
            hi = (src[(2 * kb + 1) * half_n + (n >> 1)] >> sh) & 15
            dst[n * half_k + kb] = lo | (hi << 4)


def sm80_to_raw(packed, n: int, k: int, bits: int) -> np.ndarray:
    """SM80 prepacked uint8 [(E,) K, N*bits/8] -> raw uint8 [(E,) N, K*bits/8] (Numba; per expert)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    lead = packed.shape[:-2]
    src = packed.reshape(-1, k * n * bits // 8)
    dst = np.zeros((src.shape[0], n * k * bits // 8), np.uint8)
    for e in range(src.shape[0]):
        _sm80_to_raw_expert(src[e], n, k, bits, dst[e])
    return dst.reshape(lead + (n, k * bits // 8))


def n_packed_to_k_packed(packed, n: int, k: int) -> np.ndarray:
    """nvfp4 N-packed uint8 [(E,) K, N/2] -> K-packed uint8 [(E,) N, K/2] (Numba; per expert)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    lead = packed.shape[:-2]
    src = packed.reshape(-1, k * n // 2)
    dst = np.empty((src.shape[0], n * k // 2), np.uint8)
    for e in range(src.shape[0]):
        _n_to_k_packed_expert(src[e], n, k, dst[e])
    return dst.reshape(lead + (n, k // 2))


class LazyConverted:
    """Per-expert conversion of a weight tensor into another layout, done the first time an expert runs.

    ``array`` is the converted [E, ...] uint8 tensor (anonymous memory; pages of experts never run are never
    touched); ``ensure(experts)`` converts those not converted yet.
    """

    def __init__(self, source, shape, convert):
        self.source = source
        self.array = np.empty(shape, np.uint8)
        self.done = np.zeros(shape[0], bool)
        self.convert = convert  # (source[e] flat uint8, destination[e] flat uint8) -> None
        self._lock = threading.Lock()  # callers on several threads must not see a half-written expert

    def ensure(self, experts) -> None:
        todo = [int(e) for e in np.asarray(experts).reshape(-1) if 0 <= int(e) < self.done.size and not self.done[int(e)]]
        if not todo:
            return
        with self._lock:
            for e in todo:
                if not self.done[e]:
                    src = np.ascontiguousarray(self.source[e]).reshape(-1).view(np.uint8)
                    self.convert(src, self.array[e].reshape(-1))
                    self.done[e] = True


def _lazy_layouts(spec: QMoESpec, tensors: dict) -> tuple[dict, list[LazyConverted]]:
    """Tensors with SM80 (-> raw rows) and nvfp4 N-packed (-> K-packed) weights replaced by lazy conversions."""
    t = dict(tensors)
    lazies = []
    for proj, n, k, bits in spec.projections:
        name = f"{proj}_experts_weights"
        w = tensors.get(name)
        if w is None:
            continue
        E = spec.num_experts
        if spec.packing == "sm80":
            def conv(src, dst, n=n, k=k, bits=bits):
                _sm80_to_raw_expert(src, n, k, bits, dst)
            lz = LazyConverted(w, (E, n, k * bits // 8), conv)
        elif spec.packing == "n_packed":
            def conv(src, dst, n=n, k=k):
                _n_to_k_packed_expert(src, n, k, dst)
            lz = LazyConverted(w, (E, n, k // 2), conv)
        else:
            continue
        t[name] = lz.array
        lazies.append(lz)
    return t, lazies


# ----------------------------------------------------------------------------- activations (NumPy)
def _gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)))


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def activate(spec: QMoESpec, h1: np.ndarray, h3: np.ndarray | None) -> np.ndarray:
    """FC1 outputs [P, N1] (and FC3's [P, I]) -> the FC2 input [P, I], float32, every activation of the contract."""
    I = spec.inter_size
    with np.errstate(over="ignore"):
        if spec.gated:
            if spec.swiglu_fusion == 1:
                g, l = h1[:, 0::2], h1[:, 1::2]
            elif spec.swiglu_fusion == 2:
                g, l = h1[:, :I], h1[:, I:]
            else:
                g, l = h1, h3
            if spec.activation == "geglu":
                a = _gelu_tanh(g) * l
            else:
                lim = spec.swiglu_limit
                alpha, beta = np.float32(spec.alpha), np.float32(spec.beta)
                if lim is not None and spec.swiglu_limit_after_activation:
                    lim = np.float32(lim)
                    a = np.minimum(g * _sigmoid(alpha * g), lim) * (np.clip(l, -lim, lim) + beta)
                else:
                    if lim is not None:
                        lim = np.float32(lim)
                        g = np.minimum(g, lim)
                        l = np.clip(l, -lim, lim)
                    a = g * _sigmoid(alpha * g) * (l + beta)
        else:
            kind = spec.activation
            if kind == "relu":
                a = np.maximum(h1, 0)
            elif kind == "relu2":
                a = np.maximum(h1, 0)
                a = a * a
            elif kind == "gelu":
                a = _gelu_tanh(h1)
            elif kind == "silu":
                a = h1 * _sigmoid(h1)
            else:
                a = h1
            if h3 is not None:
                a = a * h3
    return np.ascontiguousarray(a, dtype=np.float32)


# ----------------------------------------------------------------------------- one projection
class _GProj:
    """One projection (fc1 / fc2 / fc3) in any layout: read-only views of the stored tensors + layout params."""

    def __init__(self, spec: QMoESpec, t: dict, name: str, n: int, k: int, bits: int):
        E = spec.num_experts
        self.name, self.N, self.K, self.bits = name, n, k, bits
        qt = spec.quant_type
        w = np.asarray(t[f"{name}_experts_weights"])
        if w.dtype != np.uint8:
            w = w.view(np.uint8) if w.dtype.itemsize == 1 else w
        if w.dtype != np.uint8:
            raise UnsupportedLayout(f"node '{spec.node_name}': {name} weights of type {w.dtype} "
                                    f"are not {spec.quant_type} codes (uint8 / float8 expected)")
        self.w = _ro(w.reshape(E, -1))
        if qt == "int":
            fmt, rowb = FMT_INT, L.row_bytes(k, bits)
            bsk = spec.block_size or k
            nb, bsn = k // bsk, 0
        elif qt in ("fp4", "nvfp4"):
            fmt, rowb = FMT_FP4, k // 2
            bsk, nb, bsn = spec.block_size, k // spec.block_size, 0
        else:
            fmt, rowb = FMT_FP8, k
            bs = spec.block_size
            bsk, nb, bsn = (bs, -(-k // bs), bs) if bs else (k, 1, 0)
        if self.w.shape[1] != n * rowb:
            raise UnsupportedLayout(f"node '{spec.node_name}': {name} weights hold {self.w.shape[1]} bytes per "
                                    f"expert, expected {n * rowb}")
        # scales
        self.sc32, self.sc16, self.sc8 = _dummy(np.float32), _dummy(np.uint16), _dummy(np.uint8)
        self.lut16, self.lut8 = _dummy(np.float32, 1), _dummy(np.float32, 1)
        s = t.get(f"{name}_scales")
        if s is None or (qt == "fp8" and not spec.block_size):
            skind = SK_NONE
        else:
            s = np.asarray(s)
            if spec.scale_format in ("e4m3", "e8m0"):
                skind = SK_U8
                self.sc8 = _ro((s.view(np.uint8) if s.dtype.itemsize == 1 else s.astype(np.uint8)).reshape(E, -1))
                self.lut8 = _ro(L.E4M3_TABLE if spec.scale_format == "e4m3" else L.E8M0_TABLE)
            elif s.dtype == np.float16 or s.dtype.name == "bfloat16":
                skind = SK_U16
                self.sc16 = _ro(s.view(np.uint16).reshape(E, -1))
                self.lut16 = _lut16("fp16" if s.dtype == np.float16 else "bf16")
            else:
                skind = SK_F32
                self.sc32 = _ro(s.astype(np.float32, copy=False).reshape(E, -1))
        # zero points
        zp = t.get(f"{name}_zero_points") if qt == "int" else None
        if zp is None:
            zmode, self.zp, zrb = 0, _dummy(np.uint8), 0
        else:
            zmode = 2 if spec.block_size else 1
            zrb = L.row_bytes(nb, bits) if spec.block_size else 0
            self.zp = _ro(np.asarray(zp, np.uint8).reshape(E, -1))
        self.zdef = np.float32(1 << (bits - 1)) if qt == "int" else np.float32(0.0)
        g = t.get(f"{name}_global_scale") if spec.has_global_scale else None
        self.gs = _ro(np.ones(E, np.float32) if g is None else np.asarray(g, np.float32).reshape(E))
        if fmt == FMT_FP4:
            self.clut = _ro(L.E2M1_VALUES)
        elif fmt == FMT_FP8:
            self.clut = _ro(L.E4M3_TABLE)
        else:
            self.clut = _dummy(np.float32, 1)
        b = t.get(f"{name}_experts_bias")
        self.has_bias = b is not None
        self.bias = _ro(np.asarray(b).astype(np.float32).reshape(E, n) if b is not None else np.zeros((1, 1), np.float32))
        self.ip = _ro(np.array([fmt, bits, n, k, rowb, bsk, nb, bsn, skind, zmode, zrb, int(self.has_bias)],
                               np.int64))

    def _args(self):
        return (self.ip, self.w, self.sc32, self.sc16, self.sc8, self.lut16, self.lut8, self.zp, self.zdef,
                self.gs, self.clut)

    def run(self, experts, pair_off, src_row, dst_row, coef, x, out):
        gemm_rows(*self._args(), self.bias, experts, pair_off, src_row, dst_row, coef, x, out)

    def tile(self, e: int, n0: int, n1: int, buf: np.ndarray) -> np.ndarray:
        out = buf[: (n1 - n0) * self.K].reshape(n1 - n0, self.K)
        dequant_tile(*self._args(), e, n0, n1, out)
        return out

    def dense(self, e: int) -> np.ndarray:
        """Expert e's whole [N, K] float32 matrix (tests)."""
        return self.tile(e, 0, self.N, np.empty(self.N * self.K, np.float32)).copy()

# ----------------------------------------------------------------------------- the node
class GenericQMoE:
    """Runs one QMoE node in any layout; same ``run_experts`` contract as CpuQMoE.

    One ``gemm_rows`` call per projection for all experts of a batch: FC1 (and FC3) into per-pair rows,
    the activation in NumPy, FC2 scatter-added with the routing weights. Batches with many pairs are cut into
    chunks of ``pairs_per_call`` (the tokens of a chunk stay in L2 while the rows stream).
    """

    pairs_per_call = 256

    def __init__(self, spec: QMoESpec, tensors: dict, num_threads: int | None = None):
        self.spec = spec
        self.num_threads = num_threads
        H, I = spec.hidden_size, spec.inter_size
        t, self._lazies = _lazy_layouts(spec, {k: v for k, v in tensors.items() if v is not None})
        if spec.packing in ("sm80", "n_packed"):  # the converted layouts
            spec = dataclasses.replace(spec, packing="raw" if spec.packing == "sm80" else "k_packed",
                                       weights_prepacked=0)
        for need in ["fc1_experts_weights", "fc2_experts_weights"] + (["fc3_experts_weights"] if spec.has_fc3 else []):
            if need not in t:
                raise UnsupportedLayout(f"node '{spec.node_name}': input '{need}' is missing")
        self.fc1 = _GProj(spec, t, "fc1", spec.fc1_rows, H, spec.fc1_bits)
        self.fc2 = _GProj(spec, t, "fc2", H, I, spec.fc2_bits)
        self.fc3 = _GProj(spec, t, "fc3", I, H, spec.proj_bits("fc3")) if spec.has_fc3 else None

    def run_experts(self, x2d, expert_ids, weights, out=None) -> np.ndarray:
        use_threads(self.num_threads)
        x2d = np.asarray(x2d)
        H = self.spec.hidden_size
        T = x2d.shape[0]
        acc = out if out is not None else np.zeros((T, H), np.float32)
        if T == 0:
            return acc if out is not None else acc.astype(x2d.dtype)
        x = np.ascontiguousarray(x2d, dtype=np.float32).reshape(T, H)
        ids = np.asarray(expert_ids).reshape(T, -1).astype(np.int64)
        wts = np.asarray(weights, dtype=np.float32).reshape(T, -1)
        if np.any(ids >= self.spec.num_experts):
            raise ValueError(f"expert id out of range (num_experts={self.spec.num_experts})")
        valid = ids >= 0
        tok = np.nonzero(valid)[0].astype(np.int64)
        eid = ids[valid]
        pw = wts[valid]
        if eid.size:
            order = np.argsort(eid, kind="stable")
            tok, eid, pw = tok[order], eid[order], pw[order].astype(np.float32)
            for lz in self._lazies:
                lz.ensure(np.unique(eid))
            for c0 in range(0, tok.size, self.pairs_per_call):
                c1 = min(tok.size, c0 + self.pairs_per_call)
                self._run_pairs(x, tok[c0:c1], eid[c0:c1], pw[c0:c1], acc)
        return acc if out is not None else acc.astype(x2d.dtype, copy=False)

    def _run_pairs(self, x, tok, eid, pw, acc):
        """(token, expert) pairs sorted by expert: FC1 / FC3 rows per pair, activation, weighted FC2."""
        experts, counts = np.unique(eid, return_counts=True)
        experts = experts.astype(np.int64)
        pair_off = np.zeros(experts.size + 1, np.int64)
        np.cumsum(counts, out=pair_off[1:])
        P = tok.size
        ar = np.arange(P, dtype=np.int64)
        ones = np.ones(P, np.float32)
        h1 = np.zeros((P, self.fc1.N), np.float32)
        self.fc1.run(experts, pair_off, tok, ar, ones, x, h1)
        h3 = None
        if self.fc3 is not None:
            h3 = np.zeros((P, self.fc3.N), np.float32)
            self.fc3.run(experts, pair_off, tok, ar, ones, x, h3)
        a = activate(self.spec, h1, h3)
        self.fc2.run(experts, pair_off, ar, tok, pw, a, acc)


class _ConvertedFast:
    """SM80 prepacked int4 / int8 and nvfp4 N-packed: converted per expert, lazily, to raw / K-packed rows that
    the fast kernels read."""

    def __init__(self, spec: QMoESpec, tensors: dict, num_threads: int | None = None):
        from .qmoe import CpuQMoE

        t, self._lazies = _lazy_layouts(spec, tensors)
        self.spec = spec
        packing = "raw" if spec.packing == "sm80" else "k_packed"
        self.inner = CpuQMoE(dataclasses.replace(spec, packing=packing, weights_prepacked=0), t, num_threads)

    def run_experts(self, x2d, expert_ids, weights, out=None) -> np.ndarray:
        ids = np.asarray(expert_ids)
        used = np.unique(ids[ids >= 0])
        for lz in self._lazies:
            lz.ensure(used)
        return self.inner.run_experts(x2d, expert_ids, weights, out=out)


def _int3_block_ok(bs: int) -> bool:
    """Blocks the int3 kernels read: per row, 32 (two per 64-code chunk) or 64 * 2^j (whole chunks)."""
    return bs == 0 or bs == 32 or (bs % 64 == 0 and (bs // 64) & (bs // 64 - 1) == 0)


def fast_layout(spec: QMoESpec) -> bool:
    """Whether kernels/cpu/kernels.py reads the node's weight layout (raw / K-packed; SM80 and N-packed after a
    lazy conversion): int4 / int8 rows; int2 rows (K a multiple of 4);
    int3 rows (per-row scales, blocks of 32 or 64 * 2^j); MXFP4; NVFP4."""
    if spec.quant_type in ("fp4", "nvfp4"):
        return True
    if spec.quant_type != "int":
        return False
    for _, _, k, b in spec.projections:
        if b == 2 and k % 4 or b not in (2, 3, 4, 8):
            return False
        if b == 3 and not _int3_block_ok(spec.block_size):
            return False
    return spec.packing == "raw" or all(b in (4, 8) for _, _, _, b in spec.projections)


def delegate_for(spec: QMoESpec, tensors: dict, num_threads: int | None = None):
    """What runs a node instead of CpuQMoE's own fast kernels: None for the layouts they read (``fast_layout``:
    int2 / int3 / int4 / int8 raw rows, MXFP4, NVFP4 K-packed; float MoE) with a fast activation; a lazily
    converting wrapper for SM80 prepacked int4 / int8 and NVFP4 N-packed; GenericQMoE for the rest."""
    if not spec.is_quantized:
        return None
    fast_act = spec.activation in FAST_ACTIVATIONS and not spec.swiglu_limit_after_activation
    if not (fast_act and fast_layout(spec)):
        return GenericQMoE(spec, tensors, num_threads)
    if spec.packing in ("sm80", "n_packed"):
        return _ConvertedFast(spec, tensors, num_threads)
    return None
