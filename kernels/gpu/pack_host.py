"""One expert packed into the GPU kernels' layout on the host, fast: the offload engine's swaps (GpuQMoE.pack_expert).

``pack_expert_host(spec, tensors, fc1, fc2, e)`` returns, byte for byte, what ``kernels.gpu.layout.pack`` makes of
``layout.raw_sources`` for expert ``e`` (NumPy there; still the reference, and with CuPy the initial upload's path),
without their intermediate arrays: Numba kernels read the expert's stored rows and write each output byte once.

* ``w``: per 16-row tile and g = 0..7, the stored rows g and g + 8 are read front to back as uint64 words
  (little-endian, as every machine this runs on), split into the two nibble planes (int4) and transposed in
  registers into the lanes' words (SWAR). benchmarks/bench_pack_host.py times it against the NumPy path.
* ``s`` / ``z``: the [row tile][block][g][hi] relay, copied as bit patterns (fp32 as uint32, fp16 / bf16 as uint16);
  ``h``: NumPy's float32 -> float16 rounding on bits (checked against NumPy on all 2^32 fp32 patterns).
* ``b`` and the unpacking of zero points stay in NumPy (small; the reference's own operations).

Padding rows carry what the reference's mask multiplication gives them: ``source row 0 * 0`` (-0.0 where the first
row's scale or bias is negative, NaN where it is inf or NaN); padding blocks and codes at k >= K are zero. NaN scales
may differ from the reference in their payload bits (the reference multiplies valid rows by 1, which may quiet a
signalling NaN; these kernels copy bits).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# Importing kernels.cpu points Numba's cache at the CPU kernels' folder (kernels.cpu.numba_cache) before the kernels
# below are decorated; they call nothing outside this file, so Numba's own time stamp check of it keeps them fresh.
from ..cpu import numba_cache  # noqa: F401
from ..qmoe_spec import QMoESpec
from .layout import DT_BF16, ProjLayout, _unpack

__all__ = ["pack_expert_host", "pack_projection_host"]

_BITS_VIEW = {4: np.uint32, 2: np.uint16, 1: np.uint8}  # scale / zero point itemsize -> the dtype its bits copy as


# ----------------------------------------------------------------------------- Numba kernels
@njit(inline="always")
def _source_row(rows_a, rows_b, n_a, src, zero_row):
    """Row ``src`` of the merged source [rows_a; rows_b] (FC1 then FC3), ``zero_row`` for padding (src < 0)."""
    if src < 0:
        return zero_row
    if src < n_a:
        return rows_a[src]
    return rows_b[src - n_a]


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_LOW32 = np.uint64(0xFFFFFFFF)
_U16_02 = np.uint64(0x0000FFFF0000FFFF)  # 16-bit elements 0 and 2 of a word
_U8_13 = np.uint64(0x00000000FF00FF00)  # bytes 1 and 3
_U32, _U24, _U16, _U4 = np.uint64(32), np.uint64(24), np.uint64(16), np.uint64(4)


@njit(inline="always")
def _word(row, i, code_mask):
    """Stored word i of a row (zero past its end), codes at k >= K cleared."""
    return (row[i] if i < row.size else np.uint64(0)) & code_mask[i]


@njit(inline="always")
def _swap_bits(x, y, shift, mask):
    """Exchange the bits ``mask << shift`` of x with the bits ``mask`` of y."""
    t = ((x >> shift) ^ y) & mask
    return x ^ (t << shift), y ^ t


@njit(inline="always")
def _swap_inside(x, shift, mask):
    """Exchange the bits ``mask << shift`` of x with its bits ``mask``."""
    t = ((x >> shift) ^ x) & mask
    return x ^ t ^ (t << shift)


@njit(inline="always")
def _transpose_bytes(x, y):
    """4 x 4 byte matrix, rows 0-1 in x and 2-3 in y (4 bytes each, low first) -> its transpose, same places."""
    x, y = _swap_bits(x, y, _U16, _U16_02)  # the off-diagonal 2 x 2 blocks
    return _swap_inside(x, _U24, _U8_13), _swap_inside(y, _U24, _U8_13)  # in each 2 x 2 block: bytes 1, 3 <-> 4, 6


@njit(inline="always")
def _transpose_u16(r0, r1, r2, r3):
    """4 x 4 matrix of 16-bit elements, one row a word -> its transpose."""
    r0, r2 = _swap_bits(r0, r2, _U32, _LOW32)
    r1, r3 = _swap_bits(r1, r3, _U32, _LOW32)
    r0, r1 = _swap_bits(r0, r1, _U16, _U16_02)
    r2, r3 = _swap_bits(r2, r3, _U16, _U16_02)
    return r0, r1, r2, r3


@njit(inline="always")
def _w4_lanes(lo, hi, kt, code_mask, out, o):
    """Lanes 4 g .. 4 g + 3 of an int4 k tile (16 uint32 words of ``out`` from ``o``, in lane-major order) from the
    tile's stored rows g (lo) and g + 8 (hi). Word j of lane 4 g + t, byte 2 p + h8, holds rows g (low nibble) and
    g + 8 (high nibble) at k = 64 kt + 16 j + 8 h8 + 2 t + p: nibble p of stored byte 8 j + 4 h8 + t of the k tile."""
    for j in range(4):
        a = _word(lo, kt * 4 + j, code_mask)
        b = _word(hi, kt * 4 + j, code_mask)
        even = (a & _LOW_NIBBLES) | ((b & _LOW_NIBBLES) << _U4)  # byte 4 h8 + t: p = 0
        odd = ((a >> _U4) & _LOW_NIBBLES) | (b & _HIGH_NIBBLES)  # p = 1
        x, y = _transpose_bytes(even, odd)  # rows 2 p + h8, columns t -> lane t's word j
        out[o + j] = x & _LOW32
        out[o + 4 + j] = x >> _U32
        out[o + 8 + j] = y & _LOW32
        out[o + 12 + j] = y >> _U32


@njit(inline="always")
def _w8_lanes(lo, hi, kt, code_mask, out, o):
    """Lanes 4 g .. 4 g + 3 of an int8 k tile (16 uint64 words of ``out`` from ``o``) from the tile's stored rows g
    (lo) and g + 8 (hi). Word j of lane 4 g + t, byte 4 h8 + 2 hi + p, is the code of row g + 8 hi at
    k = 64 kt + 16 j + 8 h8 + 2 t + p: bytes 2 t, 2 t + 1 of stored word 8 kt + 2 j + h8."""
    for j in range(4):
        i = kt * 8 + j * 2
        # rows 2 h8 + hi, columns t (16-bit code pairs) -> lane t's word j
        r0, r1, r2, r3 = _transpose_u16(_word(lo, i, code_mask), _word(hi, i, code_mask),
                                        _word(lo, i + 1, code_mask), _word(hi, i + 1, code_mask))
        out[o + j] = r0
        out[o + 4 + j] = r1
        out[o + 8 + j] = r2
        out[o + 12 + j] = r3


@njit(inline="always")
def _pack_tiles(rows_a, rows_b, n_a, row_src, code_mask, words_per_tile, lanes, out):
    """Every 16-row tile (in parallel): for g = 0..7, stored rows g and g + 8 of the tile, read front to back
    (k tiles inner: two sequential streams the hardware prefetches), give lanes 4 g .. 4 g + 3 of each k tile."""
    zero_row = np.zeros(rows_a.shape[1], np.uint64)
    KT = code_mask.size // words_per_tile
    for tile in prange(row_src.size // 16):
        for g in range(8):
            lo = _source_row(rows_a, rows_b, n_a, row_src[tile * 16 + g], zero_row)
            hi = _source_row(rows_a, rows_b, n_a, row_src[tile * 16 + 8 + g], zero_row)
            for kt in range(KT):
                lanes(lo, hi, kt, code_mask, out, ((tile * KT + kt) * 32 + g * 4) * 4)


@njit(parallel=True, cache=True, nogil=True)
def _pack_w4(rows_a, rows_b, n_a, row_src, code_mask, out):
    """int4 weight tiles (layout.pack, bits 4) of stored int4 rows (uint64 words of 16 codes, low nibble = even k);
    ``out``: uint32 [w_bytes / 4]."""
    _pack_tiles(rows_a, rows_b, n_a, row_src, code_mask, 4, _w4_lanes, out)


@njit(parallel=True, cache=True, nogil=True)
def _pack_w8(rows_a, rows_b, n_a, row_src, code_mask, out):
    """int8 weight tiles (layout.pack, bits 8) of stored int8 rows (uint64 words of 8 codes); ``out``: uint64
    [w_bytes / 8]."""
    _pack_tiles(rows_a, rows_b, n_a, row_src, code_mask, 8, _w8_lanes, out)


@njit(parallel=True, cache=True, nogil=True)
def _relay(rows_a, rows_b, n_a, row_src, pad_row, NB, out):
    """Per-block values [n, nb] (scales or zero points, as bits) -> [row tile][block][g][hi] with NB blocks;
    padding rows take ``pad_row``, padding blocks zero."""
    nb = rows_a.shape[1]
    NT = row_src.size // 16
    for tile in prange(NT):
        for i in range(16):  # tile row: hi = i // 8, g = i % 8
            row = _source_row(rows_a, rows_b, n_a, row_src[tile * 16 + i], pad_row)
            o = tile * NB * 16 + (i % 8) * 2 + i // 8
            for blk in range(nb):
                out[o + blk * 16] = row[blk]
            for blk in range(nb, NB):
                out[o + blk * 16] = 0


@njit(inline="always")
def _half_bits(f):
    """fp16 bits of the fp32 with bits ``f`` (uint32), rounded to nearest even as NumPy's float32 -> float16 cast
    (npy_floatbits_to_halfbits): overflow to inf, underflow to subnormals / signed zero."""
    sign = np.uint32((f >> np.uint32(16)) & np.uint32(0x8000))
    f_exp = f & np.uint32(0x7F800000)
    f_sig = f & np.uint32(0x007FFFFF)
    if f_exp >= np.uint32(0x47800000):  # inf, NaN, or too large
        if f_exp == np.uint32(0x7F800000) and f_sig != 0:
            nan = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
            return sign | (nan + np.uint32(nan == np.uint32(0x7C00)))  # a NaN stays a NaN
        return sign | np.uint32(0x7C00)
    if f_exp <= np.uint32(0x38000000):  # subnormal half or zero
        if f_exp < np.uint32(0x33000000):
            return sign
        e = f_exp >> np.uint32(23)
        sig = (np.uint32(0x00800000) + f_sig) >> (np.uint32(113) - e)
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return sign | (sig >> np.uint32(13))
    if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        f_sig += np.uint32(0x1000)
    return sign | (((f_exp - np.uint32(0x38000000)) >> np.uint32(13)) + (f_sig >> np.uint32(13)))


@njit(parallel=True, cache=True, nogil=True)
def _to_half(bits, shift, out):
    """out[i] = fp16 bits of the float whose fp32 bits are bits[i] << shift (fp32: uint32, shift 0; bf16: uint16,
    shift 16)."""
    for i in prange(bits.size):
        out[i] = _half_bits(np.uint32(bits[i]) << np.uint32(shift))


# ----------------------------------------------------------------------------- stored sources of one expert
def _source_projections(spec: QMoESpec, lay: ProjLayout) -> list[tuple[str, int]]:
    """(projection, rows) merged into ``lay`` in source row order: FC1 then FC3 for a gated FC1 with FC3."""
    if lay.name == "fc2":
        return [("fc2", spec.hidden_size)]
    return [("fc1", spec.fc1_rows)] + ([("fc3", spec.inter_size)] if spec.has_fc3 else [])


def _weight_words(tensors: dict, proj: str, e: int, n: int) -> np.ndarray:
    """Stored rows of one expert as uint64 words [n, words] (rows of a byte count not a multiple of 8 are copied,
    zero-padded)."""
    w = np.asarray(tensors[f"{proj}_experts_weights"][e]).astype(np.uint8, copy=False).reshape(n, -1)
    pad = -w.shape[1] % 8
    if pad:
        w = np.concatenate([w, np.zeros((n, pad), np.uint8)], axis=1)
    return np.ascontiguousarray(w).view(np.uint64)


def _code_mask(lay: ProjLayout) -> np.ndarray:
    """uint64 words over the padded k range of a row (KP codes): all ones for codes k < K, zero beyond."""
    valid = np.arange(lay.KP) < lay.K
    if lay.bits == 4:
        mask = np.where(valid[0::2], 0x0F, 0) | np.where(valid[1::2], 0xF0, 0)
    else:
        mask = np.where(valid, 0xFF, 0)
    return mask.astype(np.uint8).view(np.uint64)


def _scale_rows(tensors: dict, proj: str, e: int, lay: ProjLayout, n: int, nb: int) -> np.ndarray:
    s = np.asarray(tensors[f"{proj}_scales"][e])
    s = s.view(np.uint16) if lay.sdtype == np.uint16 else s.astype(lay.sdtype, copy=False)
    return np.ascontiguousarray(s.reshape(n, nb))


def _zero_point_rows(tensors: dict, proj: str, e: int, lay: ProjLayout, n: int, nb: int) -> np.ndarray:
    """Unpacked zero points uint8 [n, nb] (the default 2^(bits-1) where the projection has none)."""
    z = tensors.get(f"{proj}_zero_points")
    if z is None:
        return np.full((n, nb), 1 << (lay.bits - 1), np.uint8)
    zc = _unpack(np, np.asarray(z[e]).astype(np.uint8, copy=False), lay.bits)
    return np.ascontiguousarray((zc[..., :nb] if lay.block_size else zc[:n, None]).reshape(n, nb))


def _bias_rows(tensors: dict, proj: str, e: int, n: int) -> np.ndarray:
    b = tensors.get(f"{proj}_experts_bias")
    return np.zeros(n, np.float32) if b is None else np.asarray(b[e], dtype=np.float32)


# ----------------------------------------------------------------------------- one projection
def _two(parts: list) -> tuple:
    """(first, second, rows of first) for the kernels' merged source; one part stands in for both."""
    return parts[0], parts[-1], parts[0].shape[0]


def _relayed(parts: list, lay: ProjLayout, row_src: np.ndarray) -> np.ndarray:
    """``layout.pack``'s relay of per-block values [n, nb] (one array per source projection), in their dtype."""
    first = parts[0]
    with np.errstate(invalid="ignore"):  # inf * 0: NaN, as in the reference
        pad_row = first[0] * np.zeros((), first.dtype)  # the reference masks padding rows: row 0 times 0
    bits = _BITS_VIEW[first.dtype.itemsize]
    out = np.empty(lay.s_len, bits)
    a, b, n_a = _two([p.view(bits) for p in parts])
    _relay(a, b, n_a, row_src, pad_row.view(bits), lay.NB, out)
    return out.view(first.dtype)


def _half_copy(s: np.ndarray, lay: ProjLayout) -> np.ndarray:
    """fp16 copy of fp32 / bf16 block scales (layout.pack's "h")."""
    h = np.empty(s.size, np.uint16)
    if lay.sdt == DT_BF16:
        _to_half(s, 16, h)
    else:
        _to_half(s.view(np.uint32), 0, h)
    return h.view(np.float16)


def pack_projection_host(spec: QMoESpec, tensors: dict, lay: ProjLayout, e: int) -> dict:
    """Expert ``e`` of one projection in the kernel layout: {"w", "s", ["h"], ["z"], ["b"]} of 1-D NumPy arrays,
    the bytes of ``layout.pack(lay, *layout.raw_sources(spec, tensors, lay, [e]))`` (row 0 of each)."""
    projs = _source_projections(spec, lay)
    nb = lay.K // lay.block_size if lay.block_size else 1
    row_src = lay.row_src
    w = np.empty(lay.w_bytes, np.uint8)
    a, b, n_a = _two([_weight_words(tensors, p, e, n) for p, n in projs])
    if lay.bits == 4:
        _pack_w4(a, b, n_a, row_src, _code_mask(lay), w.view(np.uint32))
    else:
        _pack_w8(a, b, n_a, row_src, _code_mask(lay), w.view(np.uint64))
    out = {"w": w, "s": _relayed([_scale_rows(tensors, p, e, lay, n, nb) for p, n in projs], lay, row_src)}
    if lay.has_h:
        out["h"] = _half_copy(out["s"], lay)
    if lay.has_zp:
        out["z"] = _relayed([_zero_point_rows(tensors, p, e, lay, n, nb) for p, n in projs], lay, row_src)
    if lay.has_bias:
        bias = np.concatenate([_bias_rows(tensors, p, e, n) for p, n in projs])
        valid = row_src >= 0
        out["b"] = bias[np.where(valid, row_src, 0)] * valid.astype(np.float32)
    return out


def pack_expert_host(spec: QMoESpec, tensors: dict, fc1: ProjLayout, fc2: ProjLayout, e: int) -> dict:
    """Expert ``e`` in the kernel layout on the host: {"fc1": {...}, "fc2": {...}} (see ``pack_projection_host``)."""
    return {lay.name: pack_projection_host(spec, tensors, lay, int(e)) for lay in (fc1, fc2)}
