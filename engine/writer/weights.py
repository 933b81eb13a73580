"""Random weights, generated band by band with a NumPy Generator seeded from (seed, tensor, piece).

Every piece (one expert, or one band of rows of a dense tensor) has its own generator, so the bytes
depend only on the spec and the seed, never on how they are streamed, and any expert can be
regenerated alone.

Magnitudes keep activations O(1) through any number of layers: a quantised matrix gets scales of
size gain / (rms(q - zero_point) * sqrt(K)), so y = W x has rms ~ gain * rms(x). Routing must
spread over all experts, as a random model's does (anchors.md: with all-positive scales it collapsed
onto a few): scale signs are random (per block, or per row without blocks), codes are centred on the
zero point, and the embedding and all noise are zero-mean, so no matrix has a mean direction.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
import onnx

from engine.writer.external_data import TensorPlan
from kernels import layouts as L

BAND_BYTES = 8 << 20   # dense tensors are generated in bands of rows of at most this many bytes
# The memory making a chunk takes, in multiples of the chunk's bytes (TensorPlan.work): tracemalloc's peak over chunks
# of megabytes, rounded up. Random codes: the generator's words, its bytes and the codes made of them; an int2/int3
# expert draws a byte a code; a prepacked one unpacks its codes and permutes them with index arrays.
CODES_WORK = 3.5
SMALL_CODES_WORK = 64   # over the bits: a byte a code and its masks (int2: 20 measured, int3: 18.7)
PREPACKED_WORK = 320    # over the bits (int4: 73 measured, int8: 37)
ZERO_POINTS_WORK = 80   # over the bits: int64 draws packed (int2: 36 measured, int4: 18)
FP4_CODES_WORK = {"k_packed": 2.5, "n_packed": 28}  # n_packed: unpacked and transposed (25 measured)
FP4_SCALES_WORK = {"fp4": 27, "nvfp4": 56}  # float64 targets, signs and their e8m0 / e4m3 (24, 52 measured)
FP8_CODES_WORK = 5.5    # float32 noise, then e4m3 (5 measured)
GLOBALS_WORK = 12       # a list of NumPy scalars, one an expert (11 measured)


def _centred_work(npd: np.dtype) -> float:
    """centred's: the random bytes, their float32 noise and that in `npd` (float32 1.25 measured, float16 3)."""
    return (5 + npd.itemsize) / npd.itemsize


def _magnitudes_work(npd: np.dtype) -> float:
    """_signed_magnitudes' float32 draws and arithmetic, in `npd` (float32 2 measured, float16 4)."""
    return 0.5 + 8 / npd.itemsize


def rng_for(seed: int, name: str, *piece: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, zlib.crc32(name.encode()), *piece]))


def code_rms(bits: int) -> float:
    """rms of (q - 2^(bits-1)) for the codes random_codes makes."""
    mid = 1 << (bits - 1)
    return math.sqrt(sum(d * d for d in range(1 - mid, mid)) / (2 * mid))


def random_codes(rng: np.random.Generator, nbytes: int, bits: int) -> np.ndarray:
    """nbytes of packed codes centred on the default zero point, like a symmetric quantiser's.

    Uniform bytes, except that the most negative code of each field (0, which is -8 for int4 and
    -128 for int8) becomes the middle code (0 after dequantisation). The codes then have mean
    exactly 2^(bits-1): uniform codes would give every matrix a -0.5 * scale mean, a rank-one part
    that positive activations (relu, swiglu) turn into a shared direction.
    """
    b = np.frombuffer(rng.bytes(nbytes), np.uint8).copy()
    if bits == 8:
        b[b == 0] = 0x80
    else:
        b |= ((b & 0x0F) == 0).view(np.uint8) << 3
        b |= ((b & 0xF0) == 0).view(np.uint8) << 7
    return b


def random_code_values(rng: np.random.Generator, shape, bits: int) -> np.ndarray:
    """uint8 codes (one per value) centred on 2^(bits-1), like random_codes: uniform, with the lowest code
    replaced by the middle one (int2: -1, 0, 0, +1; int3: -3..+3 with 0 twice as likely)."""
    mid = 1 << (bits - 1)
    c = np.frombuffer(rng.bytes(math.prod(shape)), np.uint8).reshape(shape) & np.uint8((1 << bits) - 1)
    return np.where(c == 0, np.uint8(mid), c)


def np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float16 if dtype == "float16" else np.float32)


def onnx_type(dtype: str) -> int:
    return onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.FLOAT


def _signed_magnitudes(rng: np.random.Generator, shape, base: float) -> np.ndarray:
    """float32 values of random sign and magnitude uniform in [0.5, 1.5) * base."""
    u = rng.random(shape, dtype=np.float32) * 2.0 - 1.0          # sign and magnitude from one draw
    u += np.copysign(np.float32(0.5), u)
    u *= np.float32(base)
    return u


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes along the last axis: int4 = two per byte, low nibble = even index (int2 / int3:
    LSB-first bit stream)."""
    if bits in (2, 3):
        return L.pack_bits(codes, bits)
    if bits == 8:
        return codes.astype(np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _zero_point_codes(rng: np.random.Generator, shape, bits: int) -> np.ndarray:
    """Zero points near the middle code (mid-1, mid or mid+1), so dequantised values stay centred."""
    mid = 1 << (bits - 1)
    return (mid - 1 + rng.integers(0, 3, size=shape)).astype(np.uint8)


def _band_rows(rows: int, row_bytes: int) -> int:
    """The rows of a band (the last may hold fewer)."""
    return min(rows, max(1, BAND_BYTES // max(1, row_bytes)))


def _bands(rows: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    step = _band_rows(rows, row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


# ---- dense tensors ------------------------------------------------------------------------------

def centred(rng: np.random.Generator, shape, std: float, mean: float = 0.0) -> np.ndarray:
    """float32 noise with the given mean and std: 256 evenly spaced levels (uniform, symmetric).

    Made from random bytes, several times faster than standard_normal, which matters for a
    200k x 3k embedding."""
    x = np.frombuffer(rng.bytes(math.prod(shape)), np.int8).astype(np.float32).reshape(shape)
    x += np.float32(0.5)                                   # levels -127.5 .. 127.5, mean 0
    x *= np.float32(std / 73.9002)                         # rms of those levels = 73.9002
    if mean:
        x += np.float32(mean)
    return x


def normal(name: str, shape: tuple[int, ...], seed: int, dtype: str, std: float, mean: float = 0.0) -> TensorPlan:
    """A dense float tensor of zero-mean noise (plus mean), generated in bands of rows."""
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    npd = np_dtype(dtype)

    def chunks():
        for a, b in _bands(rows, cols * npd.itemsize):
            yield centred(rng_for(seed, name, a), (b - a, cols), std, mean).astype(npd, copy=False)

    return TensorPlan(name, onnx_type(dtype), tuple(shape), chunks,
                      _band_rows(rows, cols * npd.itemsize) if len(shape) > 1 else 0, _centred_work(npd))


def rotary_caches(context_length: int, head_size: int, dtype: str, theta: float = 150000.0) -> list[TensorPlan]:
    half = head_size // 2
    npd = np_dtype(dtype)

    def make(fn):
        def chunks():  # (the frequencies made here: a plan holds nothing in proportion to a size, write_sizes' check)
            inv_freq = 1.0 / theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / head_size)
            for a, b in _bands(context_length, half * 4):
                yield fn(np.outer(np.arange(a, b, dtype=np.float64), inv_freq)).astype(npd)
        return chunks

    # float64 angles and their cosines, then `npd` (float32 4 measured, float16 8)
    work, rows = 1 + 16 / npd.itemsize, _band_rows(context_length, half * 4)
    return [TensorPlan("cos_cache", onnx_type(dtype), (context_length, half), make(np.cos), rows, work),
            TensorPlan("sin_cache", onnx_type(dtype), (context_length, half), make(np.sin), rows, work)]


def matmul_nbits(prefix: str, n: int, k: int, bits: int, seed: int, dtype: str, accuracy_level: int, gain: float = 1.0,
                 block: int = 32, row_gain: tuple[int, float] | None = None) -> tuple[list[TensorPlan], dict]:
    """A random MatMulNBits weight [N, ceil(K/block), block*bits/8] and its scales [N, K/block].

    row_gain (rows, gain), when given, multiplies the scales of the first `rows` output rows by `gain` on top of gain
    (an array of N gains was made while planning, in proportion to N before write_sizes' check)."""
    blocks = -(-k // block)
    blob = block * bits // 8
    base = gain / (code_rms(bits) * math.sqrt(k))
    qname, sname = f"{prefix}.weight_Q{bits}", f"{prefix}.weight_scales"
    npd = np_dtype(dtype)

    def qchunks():
        for a, b in _bands(n, blocks * blob):
            rng = rng_for(seed, qname, a)
            yield random_codes(rng, (b - a) * blocks * blob, bits).reshape(b - a, blocks, blob)

    def schunks():
        for a, b in _bands(n, blocks * 4):
            s = _signed_magnitudes(rng_for(seed, sname, a), (b - a, blocks), base)
            if row_gain is not None:
                s[:max(0, min(b, row_gain[0]) - a)] *= np.float32(row_gain[1])
            yield s.astype(npd)

    plans = [TensorPlan(qname, onnx.TensorProto.UINT8, (n, blocks, blob), qchunks, _band_rows(n, blocks * blob),
                        CODES_WORK),
             TensorPlan(sname, onnx_type(dtype), (n, blocks), schunks, _band_rows(n, blocks * 4),
                        _magnitudes_work(npd))]
    attrs = {"K": k, "N": n, "accuracy_level": accuracy_level, "bits": bits, "block_size": block}
    return plans, attrs


# ---- expert tensors (one piece per expert) ------------------------------------------------------

def _per_expert(name: str, elem_type: int, dims: tuple[int, ...], seed: int,
                make: Callable[[np.random.Generator], np.ndarray], work: float) -> TensorPlan:
    experts, inner = dims[0], dims[1:]

    def chunks():
        for e in range(experts):
            yield make(rng_for(seed, name, e)).reshape((1,) + inner)

    return TensorPlan(name, elem_type, dims, chunks, 1, work)


def _int_qweight(rng: np.random.Generator, n: int, k: int, bits: int, prepacked: bool) -> np.ndarray:
    """One expert's integer codes: raw rows [N, ceil(K*bits/8)], or (prepacked) the same codes in the SM80
    layout [K, N*bits/8]."""
    if bits in (4, 8):
        raw = random_codes(rng, n * k * bits // 8, bits)
        if not prepacked:
            return raw
        return L.sm80_pack(L.unpack_bits(raw.reshape(n, -1), bits, k), bits)
    return L.pack_bits(random_code_values(rng, (n, k), bits), bits)


def expert_projection(prefix: str, experts: int, n: int, k: int, bits: int, block: int, zero_points: bool,
                      bias: bool, seed: int, dtype: str, gain: float = 1.0, prepacked: bool = False) -> dict[str, TensorPlan]:
    """qweight [E, N, ceil(K*bits/8)] (prepacked: SM80 [E, K, N*bits/8]), scales [E, N, K/block] (or [E, N]),
    bias [E, N], zero points packed. bits 2, 3, 4 or 8."""
    npd = np_dtype(dtype)
    base = gain / (code_rms(bits) * math.sqrt(k))
    row_bytes = (k * bits + 7) // 8
    qdims = (experts, k, n * bits // 8) if prepacked else (experts, n, row_bytes)
    work = PREPACKED_WORK / bits if prepacked else SMALL_CODES_WORK / bits if bits in (2, 3) else CODES_WORK
    out = {"qweight": _per_expert(
        f"{prefix}.qweight", onnx.TensorProto.UINT8, qdims, seed,
        lambda rng: _int_qweight(rng, n, k, bits, prepacked), work)}
    scale_shape = (n, k // block) if block else (n,)
    out["scales"] = _per_expert(f"{prefix}.scales", onnx_type(dtype), (experts,) + scale_shape, seed,
                                lambda rng: _signed_magnitudes(rng, scale_shape, base).astype(npd),
                                _magnitudes_work(npd))
    if bias:
        out["bias"] = _expert_bias(prefix, experts, n, seed, dtype)
    if zero_points:
        if block:
            zp_codes = (n, k // block)
            zp_dims = (n, -(-(k // block) * bits // 8))
        else:
            zp_codes = (n,)
            zp_dims = (-(-n * bits // 8),)
        out["zero_points"] = _per_expert(f"{prefix}.zero_points", onnx.TensorProto.UINT8, (experts,) + zp_dims,
                                         seed, lambda rng: _pack_codes(_zero_point_codes(rng, zp_codes, bits), bits),
                                         ZERO_POINTS_WORK / bits)
    return out


# ---- floating-point expert layouts (MXFP4, NVFP4, FP8) --------------------------------------------

E2M1_RMS = math.sqrt(float(np.mean(L.E2M1_VALUES.astype(np.float64) ** 2)))   # rms of uniform E2M1 codes
FP8_STD = 16.0                                                                # std of the fp8 weight values


def _global_scale(seed: int, prefix: str, e: int, base: float) -> np.float32:
    """Per-expert global scale: base * uniform(0.5, 2), from its own generator (the block scales recompute it)."""
    return np.float32(base * rng_for(seed, f"{prefix}.global_scale", e).uniform(0.5, 2.0))


def fp4_projection(prefix: str, experts: int, n: int, k: int, quant_type: str, packing: str, bias: bool, seed: int,
                   dtype: str, gain: float = 1.0) -> dict[str, TensorPlan]:
    """E2M1 codes (K-packed [E, N, K/2] or, nvfp4 'n_packed', [E, K, N/2]), block scales (nvfp4: e4m3 of random
    sign, block 16; mxfp4 ('fp4'): e8m0, block 32), global scales [E] and bias [E, N]."""
    blk = 32 if quant_type == "fp4" else 16
    base = gain / (E2M1_RMS * math.sqrt(k))
    gbase = 2.0 ** -6 if quant_type == "nvfp4" else 1.0   # nvfp4: block scales land mid-range of e4m3

    def codes(rng):
        b = np.frombuffer(rng.bytes(n * k // 2), np.uint8).reshape(n, k // 2)
        if packing == "n_packed":
            return L.pack_bits(L.unpack_bits(b, 4, k).T, 4)
        return b

    def scales():
        for e in range(experts):
            rng = rng_for(seed, f"{prefix}.scales", e)
            target = base / _global_scale(seed, prefix, e, gbase) * rng.uniform(0.5, 1.5, size=(n, k // blk))
            if quant_type == "nvfp4":
                target *= rng.choice(np.array([-1.0, 1.0]), size=target.shape)
                yield L.float_to_e4m3(target).view(ml_dtypes.float8_e4m3fn)[None]
            else:
                yield np.clip(np.round(np.log2(target)) + 127, 1, 254).astype(np.uint8).view(
                    ml_dtypes.float8_e8m0fnu)[None]

    def globals_():
        yield np.array([_global_scale(seed, prefix, e, gbase) for e in range(experts)], np.float32)

    qdims = (experts, k, n // 2) if packing == "n_packed" else (experts, n, k // 2)
    out = {
        "qweight": _per_expert(f"{prefix}.qweight", onnx.TensorProto.UINT8, qdims, seed, codes,
                               FP4_CODES_WORK[packing]),
        "scales": TensorPlan(f"{prefix}.scales", onnx.TensorProto.FLOAT8E4M3FN if quant_type == "nvfp4"
                             else onnx.TensorProto.FLOAT8E8M0, (experts, n, k // blk), scales, 1,
                             FP4_SCALES_WORK[quant_type]),
        "global_scale": TensorPlan(f"{prefix}.global_scale", onnx.TensorProto.FLOAT, (experts,), globals_,
                                   work=GLOBALS_WORK),
    }
    if bias:
        out["bias"] = _expert_bias(prefix, experts, n, seed, dtype)
    return out


def fp8_projection(prefix: str, experts: int, n: int, k: int, block: int, bias: bool, seed: int, dtype: str,
                   gain: float = 1.0) -> dict[str, TensorPlan]:
    """float8 e4m3 weights [E, N, K]; square block scales [E, ceil(N/bs), ceil(K/bs)] of random sign in the
    activation type (block > 0) or per-expert global scales [E] (block 0); bias [E, N]."""
    npd = np_dtype(dtype)
    base = gain / (FP8_STD * math.sqrt(k))
    out = {"qweight": _per_expert(f"{prefix}.qweight", onnx.TensorProto.FLOAT8E4M3FN, (experts, n, k), seed,
                                  lambda rng: centred(rng, (n, k), FP8_STD).astype(ml_dtypes.float8_e4m3fn),
                                  FP8_CODES_WORK)}
    if block:
        shape = (-(-n // block), -(-k // block))
        out["scales"] = _per_expert(f"{prefix}.scales", onnx_type(dtype), (experts,) + shape, seed,
                                    lambda rng: _signed_magnitudes(rng, shape, base).astype(npd),
                                    _magnitudes_work(npd))
    else:
        def globals_():
            yield np.array([_global_scale(seed, prefix, e, base) for e in range(experts)], np.float32)
        out["global_scale"] = TensorPlan(f"{prefix}.global_scale", onnx.TensorProto.FLOAT, (experts,), globals_,
                                         work=GLOBALS_WORK)
    if bias:
        out["bias"] = _expert_bias(prefix, experts, n, seed, dtype)
    return out


def _expert_bias(prefix: str, experts: int, n: int, seed: int, dtype: str) -> TensorPlan:
    npd = np_dtype(dtype)
    return _per_expert(f"{prefix}.bias", onnx_type(dtype), (experts, n), seed,
                       lambda rng: centred(rng, (n,), 0.1).astype(npd), _centred_work(npd))
