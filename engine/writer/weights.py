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

import numpy as np
import onnx

from engine.writer.external_data import TensorPlan

BAND_BYTES = 8 << 20   # dense tensors are generated in bands of rows of at most this many bytes


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
    """Pack uint8 codes along the last axis: int4 = two per byte, low nibble = even index."""
    if bits == 8:
        return codes.astype(np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _zero_point_codes(rng: np.random.Generator, shape, bits: int) -> np.ndarray:
    """Zero points near the middle code (mid-1, mid or mid+1), so dequantised values stay centred."""
    mid = 1 << (bits - 1)
    return (mid - 1 + rng.integers(0, 3, size=shape)).astype(np.uint8)


def _bands(rows: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, BAND_BYTES // max(1, row_bytes))
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

    return TensorPlan(name, onnx_type(dtype), tuple(shape), chunks)


def rotary_caches(context_length: int, head_size: int, dtype: str, theta: float = 150000.0) -> list[TensorPlan]:
    half = head_size // 2
    inv_freq = 1.0 / theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / head_size)
    npd = np_dtype(dtype)

    def make(fn):
        def chunks():
            for a, b in _bands(context_length, half * 4):
                yield fn(np.outer(np.arange(a, b, dtype=np.float64), inv_freq)).astype(npd)
        return chunks

    return [TensorPlan("cos_cache", onnx_type(dtype), (context_length, half), make(np.cos)),
            TensorPlan("sin_cache", onnx_type(dtype), (context_length, half), make(np.sin))]


def matmul_nbits(prefix: str, n: int, k: int, bits: int, seed: int, dtype: str, accuracy_level: int, gain: float = 1.0,
                 block: int = 32, row_gain: np.ndarray | None = None) -> tuple[list[TensorPlan], dict]:
    """A random MatMulNBits weight [N, ceil(K/block), block*bits/8] and its scales [N, K/block].

    row_gain (length N), when given, multiplies each output row's scales on top of gain."""
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
                s *= np.asarray(row_gain, np.float32)[a:b, None]
            yield s.astype(npd)

    plans = [TensorPlan(qname, onnx.TensorProto.UINT8, (n, blocks, blob), qchunks),
             TensorPlan(sname, onnx_type(dtype), (n, blocks), schunks)]
    attrs = {"K": k, "N": n, "accuracy_level": accuracy_level, "bits": bits, "block_size": block}
    return plans, attrs


# ---- expert tensors (one piece per expert) ------------------------------------------------------

def _per_expert(name: str, elem_type: int, dims: tuple[int, ...], seed: int,
                make: Callable[[np.random.Generator], np.ndarray]) -> TensorPlan:
    experts, inner = dims[0], dims[1:]

    def chunks():
        for e in range(experts):
            yield make(rng_for(seed, name, e)).reshape((1,) + inner)

    return TensorPlan(name, elem_type, dims, chunks)


def expert_projection(prefix: str, experts: int, n: int, k: int, bits: int, block: int, zero_points: bool,
                      bias: bool, seed: int, dtype: str, gain: float = 1.0) -> dict[str, TensorPlan]:
    """qweight [E, N, K*bits/8], scales [E, N, K/block] (or [E, N]), bias [E, N], zero points packed."""
    npd = np_dtype(dtype)
    base = gain / (code_rms(bits) * math.sqrt(k))
    row_bytes = k * bits // 8
    out = {"qweight": _per_expert(
        f"{prefix}.qweight", onnx.TensorProto.UINT8, (experts, n, row_bytes), seed,
        lambda rng: random_codes(rng, n * row_bytes, bits))}
    scale_shape = (n, k // block) if block else (n,)
    out["scales"] = _per_expert(f"{prefix}.scales", onnx_type(dtype), (experts,) + scale_shape, seed,
                                lambda rng: _signed_magnitudes(rng, scale_shape, base).astype(npd))
    if bias:
        out["bias"] = _per_expert(f"{prefix}.bias", onnx_type(dtype), (experts, n), seed,
                                  lambda rng: centred(rng, (n,), 0.1).astype(npd))
    if zero_points:
        if block:
            zp_codes = (n, k // block)
            zp_dims = (n, -(-(k // block) * bits // 8))
        else:
            zp_codes = (n,)
            zp_dims = (-(-n * bits // 8),)
        out["zero_points"] = _per_expert(f"{prefix}.zero_points", onnx.TensorProto.UINT8, (experts,) + zp_dims,
                                         seed, lambda rng: _pack_codes(_zero_point_codes(rng, zp_codes, bits), bits))
    return out
