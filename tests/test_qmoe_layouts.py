"""Every QMoE weight layout of the contract: dequantisation against independent scalar code, the NumPy
reference against onnxruntime 1.32's CPU QMoE where that is an oracle, CpuQMoE against the reference over
layouts x activations x dtypes, and QMoESpec's admission, summary and byte count per layout."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kernels import layouts as L
from kernels.cpu import CpuQMoE
from kernels.cpu import generic as G
from kernels.qmoe_spec import QMOE_INPUT_NAMES, QMoESpec, UnsupportedLayout
from kernels.reference import qmoe_reference
from tests.qmoe_oracle import make_layout_case, run_ort

BF16 = ml_dtypes.bfloat16
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BF16}


def _relerr(a, b):
    a = np.asarray(a).astype(np.float64)
    b = np.asarray(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _spec(attrs, t, x):
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)


# ----------------------------------------------------------------------------- number formats, scalar checks
def test_e2m1_codes():
    want = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    got = L.e2m1_to_float(np.arange(16))
    assert got.tolist() == want and np.signbit(got[8])
    assert L.e2m1_to_float(L.float_to_e2m1(np.array(want))).tolist() == want


def _e4m3_scalar(b: int) -> float:
    sign = -1.0 if b >> 7 else 1.0
    exp, man = (b >> 3) & 0xF, b & 7
    if exp == 0xF and man == 7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9
    return sign * 2.0 ** (exp - 7) * (8 + man) / 8


def test_e4m3_and_e8m0_decoding():
    codes = np.arange(256, dtype=np.uint8)
    e4 = L.e4m3_to_float(codes)
    for b in (0x00, 0x01, 0x07, 0x08, 0x38, 0x3C, 0x7E, 0x7F, 0x80, 0xB8, 0xFE):
        want = _e4m3_scalar(b)
        assert (math.isnan(want) and math.isnan(e4[b])) or e4[b] == want, hex(b)
    assert e4[0x38] == 1.0 and e4[0x7E] == 448.0 and e4[0x01] == 2.0 ** -9 and e4[0xB8] == -1.0
    np.testing.assert_array_equal(e4, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    e8 = L.e8m0_to_float(codes)
    assert e8[127] == 1.0 and e8[128] == 2.0 and e8[120] == 2.0 ** -7 and e8[0] == 2.0 ** -127 and np.isnan(e8[255])
    np.testing.assert_array_equal(e8, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    v = np.random.default_rng(0).standard_normal(500).astype(np.float32) * 50
    np.testing.assert_array_equal(L.float_to_e4m3(v), v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bit_streams_match_scalar_extraction(bits):
    rng = np.random.default_rng(bits)
    K = 37
    codes = rng.integers(0, 1 << bits, size=(3, K))
    packed = L.pack_bits(codes, bits)
    assert packed.shape == (3, (K * bits + 7) // 8)
    for r in range(3):
        for k in range(K):
            bitpos = k * bits
            word = int(packed[r, bitpos // 8]) | (int(packed[r, bitpos // 8 + 1]) << 8 if bitpos // 8 + 1 < packed.shape[1] else 0)
            assert (word >> (bitpos % 8)) & ((1 << bits) - 1) == codes[r, k]
    np.testing.assert_array_equal(L.unpack_bits(packed, bits, K), codes)


def test_int3_dequantisation_by_hand():
    # codes 1..7, 0 in one 24-bit stream: 001 010 011 100 101 110 111 000 (LSB first)
    codes = [1, 2, 3, 4, 5, 6, 7, 0]
    stream = sum(c << (3 * i) for i, c in enumerate(codes))
    w = np.array([[stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16]], np.uint8)
    got = L.dequantize_int(w, np.array([[0.5]]), None, 3, 0, 1, 8)
    assert got.tolist() == [[(c - 4) * 0.5 for c in codes]]
    zp = L.pack_bits(np.array([[3]]), 3)  # per-block zero point 3 instead of the default 4
    got = L.dequantize_int(w, np.array([[[0.5]]]), zp, 3, 8, 1, 8)
    assert got.tolist() == [[(c - 3) * 0.5 for c in codes]]


def test_int2_per_row_zero_points_packed_along_n():
    w = L.pack_bits(np.array([[0, 1, 2, 3]] * 5), 2)
    zp = L.pack_bits(np.array([[0, 1, 2, 3, 1]]), 2)[0]  # five rows, four per byte
    got = L.dequantize_int(w, np.full(5, 2.0), zp, 2, 0, 5, 4)
    want = [[(c - z) * 2.0 for c in range(4)] for z in (0, 1, 2, 3, 1)]
    assert got.tolist() == want


def test_fp4_and_fp8_dequantisation_by_hand():
    rng = np.random.default_rng(0)
    n, k = 4, 32
    codes = rng.integers(0, 16, size=(n, k))
    sc = L.float_to_e4m3(rng.uniform(-2, 2, size=(n, k // 16)))
    g = np.float32(0.37)
    kp = L.dequantize_fp4(L.pack_bits(codes, 4), sc, g, "e4m3", 16, n, k, "k_packed")
    np_ = L.dequantize_fp4(L.pack_bits(codes.T, 4), sc, g, "e4m3", 16, n, k, "n_packed")
    np.testing.assert_array_equal(kp, np_)
    for nn, kk in ((0, 0), (1, 17), (3, 31), (2, 5)):
        assert kp[nn, kk] == float(L.E2M1_VALUES[codes[nn, kk]]) * _e4m3_scalar(int(sc[nn, kk // 16])) * float(g)
    e8 = np.array([[120], [127], [130], [133]], np.uint8)
    mx = L.dequantize_fp4(L.pack_bits(codes, 4), e8, None, "e8m0", 32, n, k)
    assert mx[2, 3] == float(L.E2M1_VALUES[codes[2, 3]]) * 8.0
    # fp8: square blocks of 16 over [40, 24]: partial edge blocks on both axes
    n, k, bs = 40, 24, 16
    w8 = L.float_to_e4m3(rng.standard_normal((n, k)) * 4)
    s = rng.uniform(-1, 1, size=(3, 2)).astype(np.float32)
    d = L.dequantize_fp8(w8, s, None, bs, n, k)
    for nn, kk in ((0, 0), (17, 3), (39, 23), (33, 16)):
        assert d[nn, kk] == _e4m3_scalar(int(w8[nn, kk])) * float(s[nn // bs, kk // bs])
    assert L.dequantize_fp8(w8, None, np.float32(0.5), 0, n, k)[5, 7] == _e4m3_scalar(int(w8[5, 7])) * 0.5


def _sm80_pack_stepwise(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent NumPy port, step by step, of onnxruntime's SM80 ``preprocess_weights_for_mixed_gemm``
    (onnxruntime/quantization/cuda_quantizer.py, the PyTorch mirror of the CUDA packer)."""
    n, k = codes.shape
    s = (codes.astype(np.int16) - (1 << (bits - 1))).T  # signed [K, N]
    if bits == 4:
        t = ((s[:, 0::2] & 0xF) | ((s[:, 1::2] & 0xF) << 4)).astype(np.uint8)[None]
        pmap = [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15,
                22, 23, 30, 31]
    else:
        t = s.astype(np.int8).view(np.uint8)[None]
        pmap = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    R = len(pmap)
    t = t[:, [(r // R) * R + pmap[r % R] for r in range(k)], :]  # permute_B_rows_for_mixed_gemm
    if bits == 4:  # subbyte_transpose
        high = (t >> 4).transpose(0, 2, 1)[:, :, None, :]
        low = (t & 15).transpose(0, 2, 1)[:, :, None, :]
        m = np.concatenate([low, high], axis=2).reshape(1, n, k).astype(np.int16)
        t = (m[:, :, 0::2] + m[:, :, 1::2] * 16).astype(np.uint8).reshape(1, k, n // 2)
    else:
        t = t.transpose(0, 2, 1).reshape(1, k, n)
    inter = 16 // bits  # interleave_column_major_tensor
    t = t.reshape(1, -1, inter, k // 64, 64 * 4 // (32 // bits)).transpose(0, 1, 3, 2, 4).reshape(1, k, -1)
    if bits == 8:  # add_bias_and_interleave_quantized_tensor_inplace
        v = t.view(np.int8).astype(np.int64) + 128
        return v.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(k, n).astype(np.uint8)
    m = np.stack([t & 15, t >> 4], axis=-1).reshape(1, k, -1)
    m = m.reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(m.shape).astype(np.int16)
    m += np.where(m > 7, -16, 0) + 8
    return (m[:, :, 0::2] + m[:, :, 1::2] * 16).astype(np.uint8).reshape(k, n // 2)


@pytest.mark.parametrize("bits,n,k", [(4, 32, 64), (4, 48, 128), (8, 16, 64), (8, 24, 192)])
def test_sm80_layout_matches_stepwise_packer_and_numba_conversion(bits, n, k):
    codes = np.random.default_rng(bits + n).integers(0, 1 << bits, size=(n, k))
    packed = L.sm80_pack(codes, bits)
    np.testing.assert_array_equal(packed, _sm80_pack_stepwise(codes, bits))
    np.testing.assert_array_equal(L.sm80_unpack(packed, n, k, bits), codes)
    np.testing.assert_array_equal(G.sm80_to_raw(packed[None], n, k, bits)[0], L.pack_bits(codes, bits))


def test_nvfp4_n_to_k_packed_conversion():
    codes = np.random.default_rng(1).integers(0, 16, size=(2, 24, 48))
    n_packed = L.pack_bits(codes.transpose(0, 2, 1), 4)
    np.testing.assert_array_equal(G.n_packed_to_k_packed(n_packed, 24, 48), L.pack_bits(codes, 4))


# ----------------------------------------------------------------------------- reference vs onnxruntime 1.32 CPU
SWIGLU1 = dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0)
ORACLE = [  # (id, make_layout_case kwargs, tolerance)
    ("int2-row", dict(bits=2, activation="gelu", bias=True), 1e-5),
    ("int2-row-zp-fp16", dict(bits=2, zero_points=True, dtype=np.float16, **SWIGLU1), 2e-3),
    ("int2-block32", dict(bits=2, block_size=32, **SWIGLU1), 2e-2),  # ORT quantises activations to int8 here
    ("int3-block32-fp16", dict(bits=3, block_size=32, dtype=np.float16, nonneg_scales=True, bias=True, **SWIGLU1), 3e-3),
    ("int3-block64-fp16", dict(bits=3, block_size=64, I=128, dtype=np.float16, nonneg_scales=True, **SWIGLU1), 3e-3),
    ("int3-block128-bf16", dict(bits=3, block_size=128, I=128, dtype=BF16, nonneg_scales=True, **SWIGLU1), 2e-2),
    ("int4-sm80-block32", dict(bits=4, block_size=32, packing="sm80", bias=True, **SWIGLU1), 1e-5),
    ("int4-sm80-block64-fp16", dict(bits=4, block_size=64, packing="sm80", dtype=np.float16, **SWIGLU1), 3e-3),
    ("int4-sm80-block128-bf16", dict(bits=4, block_size=128, I=128, packing="sm80", dtype=BF16, **SWIGLU1), 2e-2),
    ("nvfp4-kpacked", dict(quant_type="nvfp4", packing="k_packed", bias=True, global_pow2=True, **SWIGLU1), 1e-5),
    ("nvfp4-kpacked-kn-dims-fp16", dict(quant_type="nvfp4", packing="k_packed", kpacked_dims="kn", global_pow2=True,
                                        dtype=np.float16, **SWIGLU1), 3e-3),
    ("nvfp4-kpacked-bf16", dict(quant_type="nvfp4", packing="k_packed", global_pow2=True, dtype=BF16, **SWIGLU1), 2e-2),
]


@pytest.mark.parametrize("case", ORACLE, ids=[c[0] for c in ORACLE])
def test_reference_matches_onnxruntime(case):
    name, kw, tol = case
    kw = {"I": 64, **kw}
    attrs, t, x, lg = make_layout_case(seed=len(name), E=6, H=128, k=2, T=7, **kw)
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t)
    assert ref.dtype == x.dtype
    assert _relerr(ref, run_ort("QMoE", attrs, t, x, lg)) <= tol


def test_nvfp4_global_scale_is_a_plain_multiplier():
    """value = e2m1 * e4m3 scale * global: doubling the global scale of FC2 doubles the output (no FC2 bias)."""
    attrs, t, x, lg = make_layout_case(seed=2, quant_type="nvfp4", packing="k_packed", T=4, **SWIGLU1)
    spec = _spec(attrs, t, x)
    t2 = dict(t, fc2_global_scale=t["fc2_global_scale"] * 2)
    np.testing.assert_allclose(qmoe_reference(x, lg, spec, t2), 2 * qmoe_reference(x, lg, spec, t), rtol=1e-6)


# ----------------------------------------------------------------------------- CpuQMoE vs reference, every layout
LAYOUTS = {
    "int2-row": dict(bits=2),
    "int2-block32-zp": dict(bits=2, block_size=32, zero_points=True),
    "int3-block32-zp": dict(bits=3, block_size=32, zero_points=True),
    "int3-row-ragged": dict(bits=3, zero_points=True, H=120, I=56),
    "int4-raw-block32": dict(bits=4, block_size=32),
    "mixed-4-8": dict(bits=4, fc2_bits=8, block_size=32, zero_points=True),
    "mixed-4-2-3": dict(bits=4, fc2_bits=2, fc3_bits=3, block_size=32),
    "int4-sm80-block64": dict(bits=4, block_size=64, packing="sm80"),
    "int8-sm80-row": dict(bits=8, packing="sm80"),
    "nvfp4-kpacked": dict(quant_type="nvfp4", packing="k_packed"),
    "nvfp4-npacked": dict(quant_type="nvfp4", packing="n_packed"),
    "mxfp4": dict(quant_type="fp4"),
    "fp8-block32": dict(quant_type="fp8", block_size=32, H=120, I=72),
    "fp8-global": dict(quant_type="fp8"),
}
ACTIVATIONS = {
    "relu": dict(activation="relu"),
    "gelu": dict(activation="gelu"),
    "silu-fc3": dict(activation="silu", fc3=True),
    "identity": dict(activation="identity"),
    "relu2": dict(activation="relu2"),
    "swiglu0": dict(activation="swiglu", swiglu_fusion=0, alpha=1.702, beta=1.0, swiglu_limit=0.5),
    "swiglu1": dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0),
    "swiglu2-after": dict(activation="swiglu", swiglu_fusion=2, alpha=1.702, beta=1.0, swiglu_limit=0.3,
                          limit_after=True),
    "geglu1": dict(activation="geglu", swiglu_fusion=1),
    "geglu2": dict(activation="geglu", swiglu_fusion=2),
}
_GLOBAL = ("nvfp4-kpacked", "nvfp4-npacked", "mxfp4", "fp8-global")  # no FC3 (the contract has no fc3 global scale)
GRID = [(lay, act, dt) for lay in LAYOUTS for act in ACTIVATIONS for dt in DTYPES
        if not (lay in _GLOBAL and act in ("silu-fc3", "swiglu0"))
        and not (lay == "mixed-4-2-3" and act not in ("silu-fc3", "swiglu0"))]


def _tol(dtype):
    return {np.float32: 1e-5, np.float16: 4e-3}.get(dtype, 2e-2)


@pytest.mark.parametrize("layout,act,dtype", GRID, ids=[f"{a}-{b}-{c}" for a, b, c in GRID])
def test_cpu_matches_reference(layout, act, dtype):
    idx = GRID.index((layout, act, dtype))
    kw = {"quant_type": "int", "H": 64 if "sm80" not in layout else 128, "I": 64, **LAYOUTS[layout], **ACTIVATIONS[act]}
    attrs, t, x, lg = make_layout_case(seed=idx, E=6, k=2, T=20, bias=idx % 2 == 0, dtype=DTYPES[dtype], **kw)
    spec = _spec(attrs, t, x)
    m = CpuQMoE(spec, t, num_threads=2)
    for T in (1, 20):  # decode and prefill (6 experts, top-2: both the GEMV and the tile path run)
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        got = m.forward(x[:T], lg[:T])
        assert got.dtype == x.dtype and got.shape == (T, spec.hidden_size)
        assert _relerr(got, ref) <= _tol(DTYPES[dtype]), f"T={T}"


@pytest.mark.parametrize("layout", ["int3-block32-zp", "int8-sm80-row", "nvfp4-npacked", "fp8-block32"])
def test_generic_paths_forced(layout):
    """Pairs cut into small chunks (4x4 blocks and single-token remainders), and run_experts accumulating subsets."""
    kw = {"quant_type": "int", "H": 128, "I": 128 if "sm80" in layout else 96, **LAYOUTS[layout], **ACTIVATIONS["swiglu1"]}
    attrs, t, x, lg = make_layout_case(seed=3, E=8, k=3, T=30, bias=True, **kw)
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t)
    gen = G.GenericQMoE(spec, t)
    assert _relerr(CpuQMoE.forward(_as_cpu(spec, gen), x, lg), ref) <= 1e-5
    for chunk in (1, 7):
        gen.pairs_per_call = chunk
        assert _relerr(CpuQMoE.forward(_as_cpu(spec, gen), x, lg), ref) <= 1e-5
    gen.pairs_per_call = 256
    from kernels.cpu.routing import route
    ids, w = route(lg, spec)
    acc = np.zeros(x.shape, np.float32)
    for subset in (range(0, 3), range(3, 8)):
        gen.run_experts(x, np.where(np.isin(ids, list(subset)), ids, -1), w, out=acc)
    assert _relerr(acc, ref) <= 1e-5


def _as_cpu(spec, delegate):
    m = CpuQMoE.__new__(CpuQMoE)
    m.spec, m.num_threads, m._delegate = spec, None, delegate
    return m


def test_dispatch_fast_generic_and_lazy_conversion():
    attrs, t, x, lg = make_layout_case(seed=1, bits=4, fc2_bits=8, block_size=32)
    assert CpuQMoE(_spec(attrs, t, x), t)._delegate is None  # int4 / int8 raw: the fast kernels
    attrs, t, x, lg = make_layout_case(seed=1, bits=4, block_size=32, activation="geglu", swiglu_fusion=1)
    assert isinstance(CpuQMoE(_spec(attrs, t, x), t)._delegate, G.GenericQMoE)
    attrs, t, x, lg = make_layout_case(seed=1, E=8, bits=4, H=128, block_size=64, packing="sm80", T=1, k=1)
    spec = _spec(attrs, t, x)
    m = CpuQMoE(spec, t)
    assert type(m._delegate).__name__ == "_ConvertedFast"
    m.forward(x, lg)
    done = [lz.done.sum() for lz in m._delegate._lazies]
    assert done == [1, 1]  # one token, top-1: only the expert that ran was converted


def test_memmap_weights_used_in_place(tmp_path):
    attrs, t, x, lg = make_layout_case(seed=4, bits=3, block_size=32, zero_points=True, T=9)
    mm = {}
    for name, arr in t.items():
        arr.tofile(tmp_path / f"{name}.bin")
        mm[name] = np.memmap(tmp_path / f"{name}.bin", dtype=arr.dtype, mode="r", shape=arr.shape)
    spec = _spec(attrs, mm, x)
    m = CpuQMoE(spec, mm)
    assert np.shares_memory(m.fc1.w, mm["fc1_experts_weights"])
    assert _relerr(m.forward(x, lg), qmoe_reference(x, lg, spec, t)) <= 1e-5


# ----------------------------------------------------------------------------- admission, summary, bytes
def _shapes(t, x):
    s = {n: (None if t.get(n) is None else tuple(t[n].shape)) for n in QMOE_INPUT_NAMES}
    s["input"] = tuple(x.shape)
    return s


SUMMARIES = {
    "int2-row": "int2 per row", "int3-block32-zp": "int3 block 32", "mixed-4-8": "fc1 int4 / fc2 int8 block 32",
    "int4-sm80-block64": "int4 block 64 (SM80 prepacked)", "int8-sm80-row": "int8 per row (SM80 prepacked)",
    "nvfp4-kpacked": "nvfp4 K-packed (e4m3 block 16", "nvfp4-npacked": "nvfp4 N-packed (e4m3 block 16",
    "mxfp4": "mxfp4 (e8m0 block 32", "fp8-block32": "fp8 e4m3 square block 32x32", "fp8-global": "fp8 e4m3 per-expert",
}


@pytest.mark.parametrize("layout", list(SUMMARIES))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_spec_summary_and_expert_bytes(layout, dtype):
    kw = {"H": 128, "I": 64, **LAYOUTS[layout], **ACTIVATIONS["swiglu1"]}
    attrs, t, x, lg = make_layout_case(seed=0, E=4, bias=True, dtype=DTYPES[dtype], **kw)
    shapes = _shapes(t, x)
    shapes["input"] = ("batch", "seq", kw["H"])
    spec = QMoESpec.from_node("n", "QMoE", attrs, shapes)
    assert (spec.num_experts, spec.hidden_size, spec.inter_size) == (4, kw["H"], kw["I"])
    assert SUMMARIES[layout] in spec.supported_summary()
    nbytes = np.dtype(DTYPES[dtype]).itemsize
    assert spec.expert_bytes(scale_bytes=nbytes, bias_bytes=nbytes) == sum(a[0].nbytes for a in t.values())
    del shapes["input"]  # the engine passes initializer shapes only
    assert QMoESpec.from_node("n", "QMoE", attrs, shapes) == spec


def test_prepacked_inferred_from_shapes_when_weights_prepacked_is_unset():
    attrs, t, x, lg = make_layout_case(seed=0, H=128, I=64, bits=4, block_size=64, packing="sm80")
    attrs["weights_prepacked"] = -1
    spec = _spec(attrs, t, x)
    assert spec.packing == "sm80" and "SM80" in spec.supported_summary()
    attrs, t, x, lg = make_layout_case(seed=0, H=128, I=64, bits=4, block_size=64)
    attrs["weights_prepacked"] = -1
    assert _spec(attrs, t, x).packing == "raw"  # raw shapes fit: raw, as onnxruntime's CPU kernel reads them


def _refusal(attrs, shapes) -> str:
    with pytest.raises(UnsupportedLayout) as ei:
        QMoESpec.from_node("layer0/QMoE", "QMoE", attrs, shapes)
    msg = str(ei.value)
    assert "layer0/QMoE" in msg and "\n" not in msg
    return msg


def test_refusals_name_the_feature():
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="fp4")
    assert "wfp4afp8" in _refusal(dict(attrs, quant_type="wfp4afp8"), _shapes(t, x))
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="fp8")
    assert "fc1_act_scale" in _refusal(attrs, dict(_shapes(t, x), fc1_act_scale=(1,)))
    assert "fc2_act_block_scale" in _refusal(attrs, dict(_shapes(t, x), fc2_act_block_scale=(6, 8, 2)))
    assert "zero points" in _refusal(attrs, dict(_shapes(t, x), fc1_zero_points=(6, 64)))
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="nvfp4", activation="swiglu", swiglu_fusion=0)
    assert "fc3_global_scale" in _refusal(attrs, _shapes(t, x))
    attrs, t, x, lg = make_layout_case(seed=0, bits=4)
    assert "global weight scale" in _refusal(attrs, dict(_shapes(t, x), fc1_global_scale=(6,)))
    assert "bits 5" in _refusal(dict(attrs, expert_weight_bits=5), _shapes(t, x))
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="nvfp4", packing="k_packed")
    assert "nvfp4 N-packed" in _refusal(dict(attrs, weights_prepacked=0), _shapes(t, x))
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="nvfp4", packing="k_packed")
    assert "fc2_global_scale" in _refusal(attrs, dict(_shapes(t, x), fc2_global_scale=None))
