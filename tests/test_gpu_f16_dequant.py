"""CPU emulation (NumPy) of the decode kernels' fp16 dequantisation (dec5h_*, kernels/gpu/source/decode.cu:
deq4_f16, deq8_f16, set_hzd / hzsub / hz4fma): every int4 / int8 code and zero point gives exactly q - z in fp16, and
the fp16 fragments hold, element for element, the values the bf16 ones (deq4_bf16, deq8pair_bf16, set_bz) hold.

The emulation follows the PTX: lop3 (a & m) | o and prmt (__byte_perm) on 32-bit words, then f16x2 sub / fma of the
two 16-bit halves, each rounded once to fp16 (the exact result of an fma of fp16 values is computed in float64,
which holds it exactly here, then rounded once)."""
from __future__ import annotations

import numpy as np

U32 = np.uint32


def _halves(w):
    """32-bit words -> (low, high) 16-bit halves as fp16 values (float64)."""
    w = np.asarray(w, np.uint64)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _bf_halves(w):
    w = np.asarray(w, np.uint64)
    lo = ((w & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = ((w >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def _f16_bits(v):
    """float64 values -> fp16 bit patterns (one rounding to nearest even)."""
    return np.asarray(v, np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)


def _pack(lo_bits, hi_bits):
    return (np.asarray(lo_bits, np.uint64) | (np.asarray(hi_bits, np.uint64) << 16)).astype(np.uint64)


def and_or(a, m, o):
    return (np.asarray(a, np.uint64) & m) | o


def pair16(v):
    v = np.asarray(v, np.uint64)
    return (v << 16) | v


def hzsub(z):
    return pair16(0x6400 | np.asarray(z, np.uint64))


def hz4fma(z):
    return pair16(0xD400 | (np.asarray(z, np.uint64) << 4))


def hsub2(a, b):
    al, ah = _halves(a)
    bl, bh = _halves(b)
    return _pack(_f16_bits(al - bl), _f16_bits(ah - bh))


def hfma2(a, b, c):
    al, ah = _halves(a)
    bl, bh = _halves(b)
    cl, ch = _halves(c)
    return _pack(_f16_bits(al * bl + cl), _f16_bits(ah * bh + ch))


H_SIXTEENTH2 = 0x2C002C00


def deq4_f16(w, zsub_g, zfma_g8):
    lo, hi, o = 0x000F000F, 0x00F000F0, 0x64006400
    w = np.asarray(w, np.uint64)
    w2 = w >> 8
    return [hsub2(and_or(w, lo, o), zsub_g), hfma2(and_or(w, hi, o), H_SIXTEENTH2, zfma_g8),
            hsub2(and_or(w2, lo, o), zsub_g), hfma2(and_or(w2, hi, o), H_SIXTEENTH2, zfma_g8)]


def byte_perm(x, y, sel):
    """__byte_perm(x, y, sel) (selector nibbles 0-7 pick bytes of y:x)."""
    x = np.asarray(x, np.uint64)
    src = x | (np.uint64(y) << np.uint64(32))
    r = np.zeros_like(x)
    for i in range(4):
        b = (sel >> (4 * i)) & 7
        r |= ((src >> np.uint64(8 * b)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return r


def deq8_f16(w0, w1, zsub_g, zsub_g8):
    return [hsub2(byte_perm(w0, 0x64646464, 0x4140), zsub_g), hsub2(byte_perm(w0, 0x64646464, 0x4342), zsub_g8),
            hsub2(byte_perm(w1, 0x64646464, 0x4140), zsub_g), hsub2(byte_perm(w1, 0x64646464, 0x4342), zsub_g8)]


# bf16 path (decode.cu deq4_bf16 / deq8pair_bf16 with set_bz's constants), values only (exact here)
def deq4_bf16_values(w, zg, zg8):
    w = np.asarray(w, np.uint64)
    out = []
    for s, z in ((0, zg), (4, zg8), (8, zg), (12, zg8)):
        lo, hi = _bf_halves(and_or(w >> s, 0x000F000F, 0x43004300))
        out.append((lo - (128 + z), hi - (128 + z)))
    return out


def deq8pair_bf16_values(w, sel, z):
    t = byte_perm(w, 0, sel)
    lo_l, lo_h = _bf_halves(and_or(t, 0x000F000F, 0x43004300))
    hi_l, hi_h = _bf_halves(and_or(t >> np.uint64(4), 0x000F000F, 0x43004300))
    zl, zh = z & 15, z >> 4
    return ((hi_l - (128 + zh)) * 16 + (lo_l - (128 + zl)), (hi_h - (128 + zh)) * 16 + (lo_h - (128 + zl)))


def test_zero_point_constants_are_the_fp16_values():
    z = np.arange(256)
    assert np.array_equal(_halves(hzsub(z))[0], 1024.0 + z)
    z4 = np.arange(16)
    lo, hi = _halves(hz4fma(z4))
    assert np.array_equal(lo, -(64.0 + z4)) and np.array_equal(hi, lo)
    # the prefill's hzfma (f2h(-(64 + z))) gives the same bits
    assert np.array_equal(_f16_bits(-(64.0 + z4)), hz4fma(z4) & np.uint64(0xFFFF))


def test_int4_every_code_and_zero_point_is_exact():
    q = np.arange(16)
    for z in range(16):
        for z8 in (0, 7, 8, 15, z):
            # word with nibble n = q(n) for all 8 nibbles: halves of a[i] are nibbles i and i + 4
            for qa in q:
                w = np.array([int(qa) | (int(qb) << 4) | (int(qa) << 8) | (int(qb) << 12) | (int(qb) << 16)
                              | (int(qa) << 20) | (int(qb) << 24) | (int(qa) << 28) for qb in q], np.uint64)
                a = deq4_f16(w, hzsub(z), hz4fma(z8))
                qb = q.astype(np.float64)
                want = [(qa - z, qb - z), (qb - z8, qa - z8), (qa - z, qb - z), (qb - z8, qa - z8)]
                for i in range(4):
                    lo, hi = _halves(a[i])
                    assert np.array_equal(lo, np.broadcast_to(np.float64(want[i][0]), lo.shape)), (z, z8, qa, i)
                    assert np.array_equal(hi, np.broadcast_to(want[i][1], hi.shape)), (z, z8, qa, i)
                    # and the bit patterns are those of fp16 (q - z)
                    assert np.array_equal(a[i] & np.uint64(0xFFFF), _f16_bits(np.broadcast_to(want[i][0], lo.shape)))


def test_int8_every_code_and_zero_point_is_exact():
    b = np.arange(256, dtype=np.uint64)
    for z in range(256):
        z8 = 255 - z
        # bytes (row g, k), (row g, k+1), (row g+8, k), (row g+8, k+1)
        w0 = b | (((b + 1) % 256) << 8) | (((b + 2) % 256) << 16) | (((b + 3) % 256) << 24)
        a = deq8_f16(w0, w0, hzsub(z), hzsub(z8))
        bf = b.astype(np.float64)
        for i, (rz, off) in enumerate(((z, 0), (z8, 2), (z, 0), (z8, 2))):
            lo, hi = _halves(a[i])
            assert np.array_equal(lo, (bf + off) % 256 - rz) and np.array_equal(hi, (bf + off + 1) % 256 - rz)
            assert np.array_equal(a[i] & np.uint64(0xFFFF), _f16_bits((bf + off) % 256 - rz))


def test_fp16_fragments_match_the_bf16_fragments():
    """Random words and zero points: deq4_f16 / deq8_f16 hold, element for element, what the bf16 kernels'
    deq4_bf16 / deq8pair_bf16 hold (the same A-fragment positions)."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 1 << 32, size=4096, dtype=np.uint64)
    w1 = rng.integers(0, 1 << 32, size=4096, dtype=np.uint64)
    for _ in range(8):
        z, z8 = (int(v) for v in rng.integers(0, 16, 2))
        f = deq4_f16(w, hzsub(z), hz4fma(z8))
        for i, (blo, bhi) in enumerate(deq4_bf16_values(w, z, z8)):
            lo, hi = _halves(f[i])
            assert np.array_equal(lo, blo) and np.array_equal(hi, bhi), (z, z8, i)
        z, z8 = (int(v) for v in rng.integers(0, 256, 2))
        f = deq8_f16(w, w1, hzsub(z), hzsub(z8))
        ref = [deq8pair_bf16_values(w, 0x4140, z), deq8pair_bf16_values(w, 0x4342, z8),
               deq8pair_bf16_values(w1, 0x4140, z), deq8pair_bf16_values(w1, 0x4342, z8)]
        for i in range(4):
            lo, hi = _halves(f[i])
            assert np.array_equal(lo, ref[i][0]) and np.array_equal(hi, ref[i][1]), (z, z8, i)
