"""kernels.gpu.pack_host (GpuQMoE.pack_expert): one expert packed on the host by the Numba kernels is, byte for byte,
what the NumPy reference (kernels.gpu.layout.raw_sources + layout.pack) gives. CPU only: no CuPy, no GPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels.gpu import convert, layout
from kernels.gpu.pack_host import _to_half, pack_expert_host
from kernels.gpu.qmoe import GpuQMoE
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_layout_case

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
SWIGLU = {0: dict(activation="swiglu", swiglu_fusion=0), 1: dict(activation="swiglu", swiglu_fusion=1),
          2: dict(activation="swiglu", swiglu_fusion=2)}

# raw int4 / int8 layouts the kernels read as stored (make_layout_case arguments): block-wise and per-row scales,
# blocks below 64 (NB padded to KP / block) and above, FC3, zero points, biases, K / rows / I off the tile sizes
# (blocks divide H and I, so the ragged gated I is per row)
NATIVE = {
    "int4-b32-swiglu1": dict(bits=4, block_size=32, **SWIGLU[1]),
    "int4-b16-swiglu2-fp16-zp": dict(bits=4, block_size=16, H=96, I=48, dtype="fp16", zero_points=True, **SWIGLU[2]),
    "int4-b16-ragged-bf16-zp-bias": dict(bits=4, block_size=16, H=80, I=48, dtype="bf16", zero_points=True,
                                         bias=True, **SWIGLU[1]),
    "int4-b64-swiglu0-fc3-bias": dict(bits=4, block_size=64, H=128, I=128, bias=True, **SWIGLU[0]),
    "int4-b128-silu-fc3-zp": dict(bits=4, block_size=128, H=384, I=128, zero_points=True, activation="silu",
                                  fc3=True),
    "int4-row-relu-oddK-zp": dict(bits=4, H=71, I=42, zero_points=True, activation="relu"),
    "int4-row-gelu-fp16-bias": dict(bits=4, H=96, I=40, dtype="fp16", bias=True, activation="gelu"),
    "int8-b32-swiglu1-bias": dict(bits=8, block_size=32, H=160, I=96, bias=True, **SWIGLU[1]),
    "int8-row-identity-bf16-zp": dict(bits=8, H=72, I=50, dtype="bf16", zero_points=True, activation="identity"),
    "int8-b16-swiglu0-fp16-zp-bias": dict(bits=8, block_size=16, H=80, I=48, dtype="fp16", zero_points=True,
                                          bias=True, **SWIGLU[0]),
    "int8-row-swiglu1-ragged": dict(bits=8, H=67, I=33, **SWIGLU[1]),
    "int8-b128-relu": dict(bits=8, block_size=128, H=384, I=128, activation="relu"),
}
# layouts GpuQMoE converts first (kernels.gpu.convert.for_gpu): pack_expert packs the converted tensors
CONVERTED = {
    "int2-block32-zp": dict(bits=2, block_size=32, zero_points=True, **SWIGLU[1]),
    "int3-row-ragged-zp": dict(bits=3, zero_points=True, H=120, I=56, activation="relu"),
    "int4-sm80-block64": dict(bits=4, block_size=64, packing="sm80", H=128, **SWIGLU[2]),
    "int8-sm80-row-bias": dict(bits=8, packing="sm80", H=128, bias=True, activation="gelu"),
    "mixed-4-8-zp": dict(bits=4, fc2_bits=8, block_size=32, zero_points=True, **SWIGLU[1]),
    "mixed-4-2-3-fc3": dict(bits=4, fc2_bits=2, fc3_bits=3, block_size=32, fc3=True, activation="silu"),
    "nvfp4-kpacked": dict(quant_type="nvfp4", packing="k_packed", global_pow2=True, **SWIGLU[1]),
    "mxfp4": dict(quant_type="fp4", dtype="bf16", bias=True, **SWIGLU[2]),
}


def _case(kw: dict, seed: int = 0):
    kw = {"H": 64, "I": 64, **kw}
    kw["dtype"] = DTYPES[kw.get("dtype", "fp32")]
    attrs, t, x, _ = make_layout_case(seed=seed, E=3, k=2, T=2, **kw)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    conv = convert.for_gpu(spec, t)
    tensors = {k: v for k, v in conv.tensors.items() if v is not None}  # as GpuQMoE keeps them
    return conv.spec, tensors


def _reference(spec, tensors, lay, e: int) -> dict:
    packed = layout.pack(lay, *layout.raw_sources(spec, tensors, lay, np.asarray([e]), xp=np), xp=np)
    return {k: np.ascontiguousarray(v[0]) for k, v in packed.items()}


def _assert_identical(got: dict, spec, tensors, fc1, fc2, e: int) -> None:
    assert list(got) == ["fc1", "fc2"]
    for lay in (fc1, fc2):
        want = _reference(spec, tensors, lay, e)
        assert list(got[lay.name]) == list(want)
        for key, ref in want.items():
            arr = got[lay.name][key]
            assert arr.dtype == ref.dtype and arr.shape == ref.shape and arr.flags.c_contiguous, (lay.name, key)
            assert arr.tobytes() == ref.tobytes(), f"{lay.name} {key}: {np.flatnonzero(arr != ref)[:8]}"


@pytest.mark.parametrize("name", list(NATIVE) + list(CONVERTED))
def test_packed_expert_is_the_numpy_layout_byte_for_byte(name):
    spec, tensors = _case({**NATIVE, **CONVERTED}[name], seed=len(name))
    fc1, fc2 = layout.make_layouts(spec, tensors)
    for e in (0, spec.num_experts - 1):
        _assert_identical(pack_expert_host(spec, tensors, fc1, fc2, np.int64(e)), spec, tensors, fc1, fc2, e)


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # the reference's inf * 0
def test_padding_rows_and_codes_follow_the_reference():
    """Padding rows get row 0 * 0 (-0.0 for a negative scale or bias, NaN for an infinite one), as the reference's
    mask multiplication; a stored int4 row's spare high nibble (odd K) is not a code."""
    spec, tensors = _case(dict(bits=4, block_size=0, H=63, I=36, bias=True, dtype="fp16", **SWIGLU[2]))
    for name in ("fc1_scales", "fc2_scales", "fc1_experts_bias"):
        tensors[name] = tensors[name].copy()
    tensors["fc1_scales"][:, 0] = -0.5
    tensors["fc2_scales"][:, 0] = np.inf
    tensors["fc1_experts_bias"][:, 0] = -1.0
    tensors["fc1_experts_weights"] = tensors["fc1_experts_weights"] | np.uint8(0xF0) * (
        np.arange(tensors["fc1_experts_weights"].shape[-1]) == 31)  # K = 63: byte 31's high nibble is k = 63
    fc1, fc2 = layout.make_layouts(spec, tensors)
    assert fc1.NP > 2 * spec.inter_size and fc2.NP > spec.hidden_size and fc1.K % 2 == 1
    for e in range(spec.num_experts):
        got = pack_expert_host(spec, tensors, fc1, fc2, e)
        _assert_identical(got, spec, tensors, fc1, fc2, e)
        assert np.any((got["fc1"]["s"] == 0) & np.signbit(got["fc1"]["s"])) and np.isnan(got["fc2"]["s"]).any()
        assert (got["fc1"]["b"] == 0).any() and np.signbit(got["fc1"]["b"][got["fc1"]["b"] == 0]).all()


@pytest.mark.parametrize("missing", ["fc3", "fc1"])
def test_fc3_or_fc1_without_zero_points_or_bias(missing):
    """One of the merged FC1 / FC3 sources without zero points or bias: the default zero point 2^(bits-1) and a zero
    bias fill its rows, as in the reference."""
    spec, tensors = _case(NATIVE["int8-b16-swiglu0-fp16-zp-bias"])
    del tensors[f"{missing}_zero_points"], tensors[f"{missing}_experts_bias"]
    fc1, fc2 = layout.make_layouts(spec, tensors)
    assert fc1.has_zp and fc1.has_bias
    _assert_identical(pack_expert_host(spec, tensors, fc1, fc2, 2), spec, tensors, fc1, fc2, 2)


def test_gpu_qmoe_pack_expert_uses_the_host_kernels():
    """GpuQMoE.pack_expert (its constructor needs CuPy: the attributes it reads are set by hand)."""
    spec, tensors = _case(NATIVE["int4-b32-swiglu1"])
    gpu = object.__new__(GpuQMoE)
    gpu.spec, gpu._tensors = spec, tensors
    gpu.fc1, gpu.fc2 = layout.make_layouts(spec, tensors)
    _assert_identical(gpu.pack_expert(1), spec, tensors, gpu.fc1, gpu.fc2, 1)


def _fp16_bits(bits32: np.ndarray) -> np.ndarray:
    out = np.empty(bits32.size, np.uint16)
    _to_half(bits32, 0, out)
    return out


def test_fp16_copy_rounds_as_numpy():
    """The "h" copy: float32 -> float16 as NumPy rounds it (ties to even, subnormals, overflow, inf, NaN); all 2^32
    patterns were compared once (no difference); here the edges and a random sample."""
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035156e-05, 6.097555e-05,
                      5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 1e-9, 1.4e-45, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                      3.4e38, np.inf, -np.inf, np.nan], np.float32).view(np.uint32)
    sample = np.random.default_rng(0).integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([edges, edges + 1, edges - 1, sample])
    with np.errstate(all="ignore"):
        want = bits.view(np.float32).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_fp16_bits(bits), want)
