"""Weight layouts of com.microsoft QMoE in NumPy: number formats, bit streams, packings, dequantisation.

One function per layout family, written for clarity; kernels/reference.py dequantises with these, the
CPU kernels (kernels/cpu) are tested against them and the writer (engine/writer) packs with them.

- number formats: E2M1 (fp4 codes), float8 e4m3fn and e8m0 (block scales, fp8 weights), fp16 / bf16 bits;
- int2 / int3 / int4 / int8 codes: row-local LSB-first bit streams (int4: low nibble = even k);
- SM80 prepacked int4 / int8: CUTLASS's mixed-GEMM layout [K, N*bits/8] (onnxruntime's
  ``preprocess_weights_for_mixed_gemm`` for SM80: permute rows of K in tiles of 32 (int4) / 16 (int8),
  transpose, interleave 4 (int4) / 2 (int8) columns per 64-deep K tile, then reorder the codes inside
  each 32-bit word) -- expressed here as one permutation of the code stream (``sm80_positions``);
- nvfp4 N-packed [K, N/2] (legacy) and K-packed [N, K/2] (weights_prepacked=1);
- fp8 e4m3 [N, K] with square block scales or a per-expert global scale.

The contract: /work/shared/reference/qmoe.md and qmoe-schema-ort-1.32.txt.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = [
    "E2M1_VALUES", "e2m1_to_float", "e4m3_to_float", "e8m0_to_float", "float_to_e4m3", "float_to_e2m1",
    "half_bits_to_float", "bf16_bits_to_float", "scale_values",
    "unpack_bits", "pack_bits", "row_bytes",
    "sm80_positions", "sm80_pack", "sm80_unpack",
    "dequantize_int", "dequantize_fp4", "dequantize_fp8",
]

# ----------------------------------------------------------------------------- number formats
#: E2M1 magnitudes of codes 0..7; bit 3 is the sign (code 8 is -0).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def e2m1_to_float(codes) -> np.ndarray:
    """4-bit E2M1 codes (0..15) -> float32."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 15]


def float_to_e2m1(values) -> np.ndarray:
    """Nearest E2M1 code of each value (ties to the lower magnitude); the writer's encoder."""
    v = np.asarray(values, dtype=np.float32)
    mag = np.abs(v)
    idx = np.argmin(np.abs(mag[..., None] - E2M1_VALUES[:8]), axis=-1).astype(np.uint8)
    return idx | (np.signbit(v).astype(np.uint8) << 3)


def _e4m3_table() -> np.ndarray:
    """float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 = NaN."""
    out = np.empty(256, np.float32)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        ex = (b >> 3) & 15
        man = b & 7
        if ex == 15 and man == 7:
            out[b] = np.nan
        elif ex == 0:
            out[b] = s * man / 8.0 * 2.0 ** -6
        else:
            out[b] = s * (1.0 + man / 8.0) * 2.0 ** (ex - 7)
    return out


def _e8m0_table() -> np.ndarray:
    """float8 e8m0 (MX block scales): 2^(e - 127); e = 255 is NaN."""
    out = np.full(256, np.nan, np.float32)
    out[:255] = np.ldexp(np.ones(255, np.float64), np.arange(255) - 127)
    return out


E4M3_TABLE = _e4m3_table()
E8M0_TABLE = _e8m0_table()


def _u8(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 and a.dtype != np.uint8 else a.astype(np.uint8, copy=False)


def e4m3_to_float(codes) -> np.ndarray:
    """float8e4m3fn bytes (uint8 or an ml_dtypes float8_e4m3fn array) -> float32."""
    return E4M3_TABLE[_u8(codes)]


def e8m0_to_float(codes) -> np.ndarray:
    """float8e8m0 bytes (uint8 or ml_dtypes float8_e8m0fnu) -> float32."""
    return E8M0_TABLE[_u8(codes)]


def float_to_e4m3(values) -> np.ndarray:
    """Nearest finite e4m3fn code (uint8) of each value, saturating at +-448; the writer's encoder."""
    v = np.asarray(values, dtype=np.float32)
    finite = np.where(np.isnan(E4M3_TABLE[:128]), np.inf, E4M3_TABLE[:128])  # codes 0..126 (0x7f is NaN)
    mag = np.minimum(np.abs(v), 448.0)
    idx = np.searchsorted(finite[:127], mag)  # finite[:127] is increasing
    lo = np.clip(idx - 1, 0, 126)
    hi = np.clip(idx, 0, 126)
    pick = np.where(np.abs(finite[hi] - mag) < np.abs(mag - finite[lo]), hi, lo).astype(np.uint8)
    return pick | (np.signbit(v).astype(np.uint8) << 7)


def half_bits_to_float(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def bf16_bits_to_float(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def scale_values(scales, fmt: str = "float") -> np.ndarray:
    """Block / row scales as float64: 'float' (float32 / float16 / bfloat16 arrays), 'e4m3' or 'e8m0' bytes."""
    if fmt == "e4m3":
        return e4m3_to_float(scales).astype(np.float64)
    if fmt == "e8m0":
        return e8m0_to_float(scales).astype(np.float64)
    return np.asarray(scales).astype(np.float64)


# ----------------------------------------------------------------------------- bit streams
def row_bytes(count: int, bits: int) -> int:
    """Bytes of a row of ``count`` codes of ``bits`` bits (rows are byte-aligned, no inner padding)."""
    return (count * bits + 7) // 8


def unpack_bits(packed, bits: int, count: int) -> np.ndarray:
    """uint8 [..., B] LSB-first bit stream -> int32 codes [..., count]; code i occupies bits i*bits .. of the row.

    For 2, 4 and 8 bits this is the byte-packed layout (int4: low nibble = even index); 3 bits spill over bytes.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    if bits == 8:
        return packed[..., :count].astype(np.int32)
    if bits in (2, 4):  # whole codes per byte: shift and mask
        per = 8 // bits
        parts = (packed[..., None] >> np.arange(0, 8, bits, dtype=np.uint8)) & np.uint8((1 << bits) - 1)
        return parts.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :count].astype(np.int32)
    bitarr = np.unpackbits(packed, axis=-1, bitorder="little")[..., : count * bits]
    bitarr = bitarr.reshape(*packed.shape[:-1], count, bits).astype(np.int32)
    return (bitarr << np.arange(bits, dtype=np.int32)).sum(axis=-1, dtype=np.int32)


def pack_bits(codes, bits: int) -> np.ndarray:
    """codes [..., C] (0 <= c < 2^bits) -> uint8 [..., ceil(C*bits/8)] LSB-first; unused high bits are zero."""
    codes = np.asarray(codes)
    if bits == 8:
        return codes.astype(np.uint8)
    c = codes.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8) & 1
    c = c.reshape(*codes.shape[:-1], codes.shape[-1] * bits)
    return np.packbits(c, axis=-1, bitorder="little")


# ----------------------------------------------------------------------------- SM80 prepacked (CUTLASS)
_SM80_ROW_PERM = {
    4: (0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15,
        22, 23, 30, 31),
    8: (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15),
}
_SM80_WORD_PERM = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}
SM80_K_TILE = 64  # rows of K per interleaved tile (128 bytes of fp16 activations)


def sm80_check(n: int, k: int, bits: int) -> str | None:
    """Why [N, K] cannot be in the SM80 layout, or None."""
    if bits not in (4, 8):
        return f"SM80 prepacked weights are int4 or int8, not int{bits}"
    if k % SM80_K_TILE:
        return f"SM80 prepacked weights need K % {SM80_K_TILE} == 0 (K = {k})"
    if n % 4:
        return f"SM80 prepacked weights need N % 4 == 0 (N = {n})"
    return None


@lru_cache(maxsize=32)
def _sm80_positions_cached(n: int, k: int, bits: int) -> np.ndarray:
    rp = _SM80_ROW_PERM[bits]
    R = len(rp)
    inv_rp = np.argsort(rp)
    kk = np.arange(k)
    r = (kk // R) * R + inv_rp[kk % R]          # 1. row (K) permutation: logical k sits at row r
    nn = np.arange(n)[:, None]
    I = 16 // bits                                # 3. columns interleaved per K tile (after the transpose, 2.)
    a, b = nn // I, nn % I
    c, d = r[None, :] // SM80_K_TILE, r[None, :] % SM80_K_TILE
    idx = ((a * (k // SM80_K_TILE) + c) * I + b) * SM80_K_TILE + d
    wp = _SM80_WORD_PERM[bits]                    # 4. code order inside each 32-bit word
    G = len(wp)
    inv_wp = np.argsort(wp)
    pos = (idx // G) * G + inv_wp[idx % G]
    pos = pos.astype(np.int64)
    pos.flags.writeable = False
    return pos


def sm80_positions(n: int, k: int, bits: int) -> np.ndarray:
    """int64 [N, K]: the index, in the SM80 code stream, of logical code (n, k).

    The stream is the [K, N*bits/8] tensor's bytes read in order, codes LSB-first within a byte (int4: low
    nibble first). Derived step by step from onnxruntime's SM80 ``preprocess_weights_for_mixed_gemm``.
    """
    why = sm80_check(n, k, bits)
    if why:
        raise ValueError(why)
    return _sm80_positions_cached(int(n), int(k), int(bits))


def sm80_pack(codes, bits: int) -> np.ndarray:
    """Unsigned codes [..., N, K] (raw order, zero point 2^(bits-1)) -> SM80 prepacked uint8 [..., K, N*bits/8]."""
    codes = np.asarray(codes)
    n, k = codes.shape[-2:]
    pos = sm80_positions(n, k, bits)
    stream = np.empty(codes.shape[:-2] + (n * k,), np.uint8)
    stream[..., pos.reshape(-1)] = codes.reshape(codes.shape[:-2] + (n * k,))
    return pack_bits(stream, bits).reshape(codes.shape[:-2] + (k, n * bits // 8))


def sm80_unpack(packed, n: int, k: int, bits: int) -> np.ndarray:
    """SM80 prepacked uint8 [..., K, N*bits/8] -> unsigned codes int32 [..., N, K] (raw order)."""
    packed = np.asarray(packed, dtype=np.uint8)
    lead = packed.shape[:-2]
    stream = unpack_bits(packed.reshape(lead + (-1,)), bits, n * k)
    return stream[..., sm80_positions(n, k, bits)]


# ----------------------------------------------------------------------------- dequantisation
def dequantize_int(weights, scales, zero_points, bits: int, block_size: int, n: int, k: int,
                   packing: str = "raw") -> np.ndarray:
    """Integer codes of one projection, one expert or a stack [..., ...] -> float64 [..., N, K].

    weights: raw uint8 [..., N, ceil(K*bits/8)] or SM80 [..., K, N*bits/8]; scales [..., N] or
    [..., N, K/block]; zero_points None (= 2^(bits-1)) or packed bit streams: per row [..., ceil(N*bits/8)],
    per block [..., N, ceil(blocks*bits/8)]. value = (code - zero point) * scale.
    """
    w = np.asarray(weights, dtype=np.uint8)
    if packing == "sm80":
        q = sm80_unpack(w, n, k, bits)
    else:
        q = unpack_bits(w.reshape(w.shape[:-1] + (-1,)), bits, k)
    lead = q.shape[:-2]
    nb = k // block_size if block_size else 1
    s = scale_values(scales).reshape(lead + (n, nb))
    if zero_points is None:
        z = np.full(lead + (n, nb), 1 << (bits - 1), np.float64)
    elif block_size:
        z = unpack_bits(np.asarray(zero_points, np.uint8).reshape(lead + (n, -1)), bits, nb).astype(np.float64)
    else:
        z = unpack_bits(np.asarray(zero_points, np.uint8).reshape(lead + (-1,)), bits, n).astype(np.float64)
        z = z.reshape(lead + (n, 1))
    qb = q.reshape(lead + (n, nb, k // nb)).astype(np.float64)
    return ((qb - z[..., None]) * s[..., None]).reshape(lead + (n, k))


def dequantize_fp4(weights, scales, global_scale, scale_format: str, block: int, n: int, k: int,
                   packing: str = "k_packed") -> np.ndarray:
    """E2M1 codes (nvfp4 / mxfp4) of one expert -> float64 [N, K]; value = e2m1 * block scale * global scale.

    packing 'k_packed': bytes row-major [N, K/2] (low nibble = even k), whatever the declared shape;
    'n_packed': bytes [K, N/2] (low nibble = even n). scales [N, K/block] in ``scale_format`` ('e4m3', 'e8m0').
    """
    w = np.asarray(weights, dtype=np.uint8).reshape(-1)
    if packing == "n_packed":
        q = unpack_bits(w.reshape(k, n // 2), 4, n).T
    else:
        q = unpack_bits(w.reshape(n, k // 2), 4, k)
    s = scale_values(scales, scale_format).reshape(n, k // block)
    g = 1.0 if global_scale is None else float(np.asarray(global_scale, np.float64).reshape(()))
    v = e2m1_to_float(q).astype(np.float64).reshape(n, k // block, block) * s[..., None] * g
    return v.reshape(n, k)


def dequantize_fp8(weights, scales, global_scale, block_size: int, n: int, k: int) -> np.ndarray:
    """float8 e4m3fn [N, K] of one expert -> float64; square blocks of ``block_size`` (partial edge blocks
    allowed) with scales [ceil(N/bs), ceil(K/bs)], or (block_size 0) one global scale."""
    v = e4m3_to_float(np.asarray(weights).reshape(n, k)).astype(np.float64)
    if block_size:
        s = scale_values(scales).reshape(-(-n // block_size), -(-k // block_size))
        v = v * np.repeat(np.repeat(s, block_size, axis=0), block_size, axis=1)[:n, :k]
    if global_scale is not None:
        v = v * float(np.asarray(global_scale, np.float64).reshape(()))
    return v
