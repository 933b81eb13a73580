"""kernels.gpu.convert: the host-side conversion, at upload, of the layouts the GPU kernels do not read into raw
int4 / int8 rows (issue #3). CPU only (NumPy): no CuPy, no GPU.

For every converted layout: the NumPy reference on the converted spec / tensors (what GpuQMoE sees) equals the
reference on the stored ones bit for bit (dequantised weights and node outputs), the converted spec passes the GPU
layout's own check (kernels.gpu.layout.check_supported / make_layouts), the converted tensors are a valid raw QMoE
layout for QMoESpec, and the kernel layout that GpuQMoE uploads (layout.raw_sources + layout.pack, emulated back
to weights here) holds the reference weights. nvfp4 with a global scale whose significand has more than 20 bits
cannot be exact (the fp32 scale e4m3 * global / 2 is rounded): there the weights are within 2^-24 relative.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels import layouts as L
from kernels.gpu import convert as C
from kernels.gpu import layout as LY
from kernels.qmoe_spec import QMoESpec, UnsupportedLayout
from kernels.reference import _proj_weight, qmoe_reference
from tests.qmoe_oracle import make_layout_case

BF16 = ml_dtypes.bfloat16
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BF16}

# layouts GpuQMoE now accepts through the conversion (make_layout_case arguments)
LAYOUTS = {
    "int2-row": dict(bits=2),
    "int2-row-zp": dict(bits=2, zero_points=True),
    "int2-block32-zp": dict(bits=2, block_size=32, zero_points=True),
    "int3-row-ragged-zp": dict(bits=3, zero_points=True, H=120, I=56),
    "int3-block32": dict(bits=3, block_size=32),
    "int3-block64-zp": dict(bits=3, block_size=64, zero_points=True, H=128, I=128),
    "int4-sm80-block64": dict(bits=4, block_size=64, packing="sm80", H=128),
    "int4-sm80-row-zp": dict(bits=4, packing="sm80", zero_points=True, H=128),
    "int8-sm80-row": dict(bits=8, packing="sm80", H=128),
    "int8-sm80-block32-zp": dict(bits=8, block_size=32, packing="sm80", zero_points=True, H=128, I=128),
    "mixed-4-8-zp": dict(bits=4, fc2_bits=8, block_size=32, zero_points=True),
    "mixed-8-2-row": dict(bits=8, fc2_bits=2),
    "mixed-4-2-3": dict(bits=4, fc2_bits=2, fc3_bits=3, block_size=32, fc3=True),
    "nvfp4-kpacked": dict(quant_type="nvfp4", packing="k_packed", global_pow2=True),
    "nvfp4-kpacked-kn-dims": dict(quant_type="nvfp4", packing="k_packed", kpacked_dims="kn", global_pow2=True),
    "nvfp4-npacked": dict(quant_type="nvfp4", packing="n_packed", global_pow2=True, H=96, I=48),
    "mxfp4": dict(quant_type="fp4"),
    "mxfp4-pow2": dict(quant_type="fp4", global_pow2=True, H=96, I=96),
}
ACTS = {  # activations the GPU kernels implement
    "relu": dict(activation="relu"),
    "gelu": dict(activation="gelu"),
    "identity": dict(activation="identity"),
    "silu-fc3": dict(activation="silu", fc3=True),
    "swiglu0": dict(activation="swiglu", swiglu_fusion=0, alpha=1.702, beta=1.0, swiglu_limit=0.5),
    "swiglu1": dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0),
    "swiglu2": dict(activation="swiglu", swiglu_fusion=2, alpha=1.0, beta=0.5),
}
_GLOBAL = ("nvfp4", "mxfp4")  # no FC3 (the contract has no fc3 global scale)


def _acts_for(layout):
    if layout == "mixed-4-2-3":
        return ["silu-fc3", "swiglu0"]
    names = [a for a in ACTS if not (layout.startswith(_GLOBAL) and a in ("silu-fc3", "swiglu0"))]
    i = list(LAYOUTS).index(layout)
    return [names[(i + j) % len(names)] for j in range(3)]  # three per layout, rotating


GRID = [(lay, act, dt) for lay in LAYOUTS for j, act in enumerate(_acts_for(lay))
        for dt in [list(DTYPES)[(list(LAYOUTS).index(lay) + j) % 3]]]


def _case(layout, act="swiglu1", dtype="fp32", seed=0, **extra):
    kw = {"H": 64, "I": 64, **LAYOUTS[layout], **ACTS[act], **extra}
    attrs, t, x, lg = make_layout_case(seed=seed, E=6, k=2, T=20, bias=seed % 2 == 0, dtype=DTYPES[dtype], **kw)
    return attrs, t, x, lg, QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)


def _weights(spec, tensors, proj, e):
    return _proj_weight(spec, tensors, proj, e)


# ----------------------------------------------------------------------------- exactness against the reference
@pytest.mark.parametrize("layout,act,dtype", GRID, ids=[f"{a}-{b}-{c}" for a, b, c in GRID])
def test_converted_reference_is_bit_identical(layout, act, dtype):
    idx = GRID.index((layout, act, dtype))
    attrs, t, x, lg, spec = _case(layout, act, dtype, seed=idx)
    assert not C.gpu_native(spec)
    conv = C.for_gpu(spec, t)
    assert conv.converted and conv.exact and conv.source_spec is spec
    LY.check_supported(conv.spec)  # the GPU layout's own acceptance check (GpuQMoE builds its layouts from it)
    f1, f2 = LY.make_layouts(conv.spec, conv.tensors)
    assert f1.bits == f2.bits == conv.spec.fc1_bits
    for proj, n, k, _ in spec.projections:
        for e in range(spec.num_experts):
            np.testing.assert_array_equal(_weights(conv.spec, conv.tensors, proj, e), _weights(spec, t, proj, e),
                                          err_msg=f"{proj} expert {e}")
    for T in (1, 20):  # decode- and prefill-sized batches
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        got = qmoe_reference(x[:T], lg[:T], conv.spec, conv.tensors)
        assert got.dtype == ref.dtype
        assert float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max()) == 0.0
    assert conv.inexact_scales == 0


def _round_significand(g, bits: int) -> np.ndarray:
    m, ex = np.frexp(np.asarray(g, np.float64))
    return np.ldexp(np.round(np.ldexp(m, bits)), ex - bits).astype(np.float32)


def test_nvfp4_arbitrary_global_scale_is_within_half_an_fp32_ulp():
    """A global scale with a 24-bit significand: e4m3 (4 bits) x global / 2 needs up to 28 bits, more than fp32's
    24, so an exact fp32 block scale does not exist. The converter rounds to nearest: each dequantised weight is
    within 2^-24 relative of the reference (measured: ~5e-8), the node output within fp32 rounding."""
    attrs, t, x, lg, spec = _case("nvfp4-kpacked", seed=3, global_pow2=False)
    conv = C.for_gpu(spec, t)
    assert not conv.exact
    for proj, n, k, _ in spec.projections:
        for e in range(spec.num_experts):
            want = _weights(spec, t, proj, e)
            got = _weights(conv.spec, conv.tensors, proj, e)
            assert np.all(np.abs(got - want) <= 2.0 ** -24 * np.abs(want))
    assert conv.inexact_scales > 0 and 0 < conv.max_scale_rel_err <= 2.0 ** -24
    ref = qmoe_reference(x, lg, spec, t).astype(np.float64)
    got = qmoe_reference(x, lg, conv.spec, conv.tensors).astype(np.float64)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-6
    # a global scale of <= 20 significant bits is exact again
    t20 = dict(t, **{f"{p}_global_scale": _round_significand(t[f"{p}_global_scale"], 20) for p in ("fc1", "fc2")})
    conv = C.for_gpu(spec, t20)
    assert conv.exact
    ref = qmoe_reference(x, lg, spec, t20)
    assert np.array_equal(qmoe_reference(x, lg, conv.spec, conv.tensors), ref)


# ----------------------------------------------------------------------------- the converted layout is a valid one
def _converted_attrs(attrs, conv):
    a = {k: v for k, v in attrs.items() if k not in ("quant_type", "fc1_expert_weight_bits", "fc2_expert_weight_bits",
                                                      "fc3_expert_weight_bits")}
    a.update(expert_weight_bits=conv.spec.fc1_bits, weights_prepacked=0)
    if conv.spec.block_size:
        a["block_size"] = conv.spec.block_size
    return a


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_converted_tensors_form_a_raw_int_layout(layout):
    """QMoESpec, reading the materialised converted tensors as a plain int QMoE node, describes them exactly as the
    converted spec does (shapes validated by the spec's own admission), one width for every projection."""
    attrs, t, x, lg, spec = _case(layout, "swiglu1" if "fc3" not in LAYOUTS[layout] else "silu-fc3")
    conv = C.for_gpu(spec, t)
    dense = {name: (None if v is None else np.asarray(v)) for name, v in conv.tensors.items()}
    again = QMoESpec.from_tensors("test/QMoE", "QMoE", _converted_attrs(attrs, conv), dense, x.shape)
    assert again == conv.spec
    assert again.is_fast_int_layout and C.gpu_native(again)
    assert conv.spec.fc1_bits == (8 if spec.quant_type != "int" or 8 in
                                  [b for _, _, _, b in spec.projections] else 4)
    for name, v in conv.tensors.items():  # ExpertArray metadata == what it produces
        if isinstance(v, C.ExpertArray):
            assert dense[name].shape == v.shape and dense[name].dtype == v.dtype
            assert not any(n.endswith("_global_scale") for n in conv.tensors)


# ----------------------------------------------------------------------------- what GpuQMoE uploads
_PERM8 = (0, 1, 4, 3, 7, 5, 6, 2, 8)  # layout.pack: (e, tile, hi, g, ktile, j, h8, t, p) -> byte order
_PERM4 = (0, 1, 4, 3, 7, 5, 8, 6, 2)


def _unpack_kernel_layout(lay: LY.ProjLayout, packed: dict):
    """Inverse of layout.pack (written from its docstring): (codes [e, NP, KP], scales float64 [e, NP, NB],
    zero points [e, NP, NB] or None, bias [e, NP] or None)."""
    w = packed["w"]
    e = w.shape[0]
    NT, KT, NB = lay.NT, lay.KT, lay.NB
    if lay.bits == 8:
        c = w.reshape(e, NT, KT, 8, 4, 4, 2, 2, 2).transpose(np.argsort(_PERM8))
    else:
        nib = np.stack([w & 15, w >> 4], axis=-1).reshape(e, NT, KT, 8, 4, 4, 2, 2, 2)
        c = nib.transpose(np.argsort(_PERM4))
    codes = c.reshape(e, NT * 16, KT * 64)

    def relay_back(a):
        return a.reshape(e, NT, NB, 8, 2).transpose(0, 1, 4, 3, 2).reshape(e, NT * 16, NB)

    s = packed["s"]
    s = L.bf16_bits_to_float(s) if lay.sdtype == np.uint16 else s.astype(np.float64)
    z = relay_back(packed["z"]) if lay.has_zp else None
    return codes, relay_back(np.asarray(s, np.float64)), z, packed.get("b")


def _kernel_weights(lay, packed):
    codes, s, z, b = _unpack_kernel_layout(lay, packed)
    e, NP, KP = codes.shape
    blk = KP // lay.NB if lay.block_size == 0 else lay.block_size
    col_block = np.minimum(np.arange(KP) // blk, lay.NB - 1)
    zz = (1 << (lay.bits - 1)) if z is None else z[:, :, col_block].astype(np.float64)
    return (codes.astype(np.float64) - zz) * s[:, :, col_block], b


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uploaded_kernel_layout_holds_the_reference_weights(layout):
    """raw_sources + pack on the converted tensors (GpuQMoE's path, on the host as in pack_expert) decode back to the
    stored layout's reference weights; one expert at a time (pack_expert) == a chunk (the initial upload)."""
    act = "silu-fc3" if "fc3" in LAYOUTS[layout] else ("swiglu1" if layout.startswith(_GLOBAL) else "swiglu0")
    attrs, t, x, lg, spec = _case(layout, act, seed=2)
    conv = C.for_gpu(spec, t)
    experts = np.array([4, 1, 5], np.int64)
    for lay in LY.make_layouts(conv.spec, conv.tensors):
        packed = LY.pack(lay, *LY.raw_sources(conv.spec, conv.tensors, lay, experts))
        for j, e in enumerate(experts):
            one = LY.pack(lay, *LY.raw_sources(conv.spec, conv.tensors, lay, np.array([e])))
            for key in packed:
                np.testing.assert_array_equal(one[key][0], packed[key][j])
        got, bias = _kernel_weights(lay, packed)
        projs = [lay.name] + (["fc3"] if lay.name == "fc1" and spec.has_fc3 else [])
        valid = lay.row_src >= 0
        for j, e in enumerate(experts):
            src = np.concatenate([_weights(spec, t, p, int(e)) for p in projs], axis=0)
            np.testing.assert_array_equal(got[j][valid, :lay.K], src[lay.row_src[valid]])
            assert not got[j][~valid].any()  # padding rows (zero scales); padding k meets zero activations
            if lay.has_bias:
                b_src = np.concatenate([np.asarray(t[f"{p}_experts_bias"][e], np.float32)
                                        if t.get(f"{p}_experts_bias") is not None else
                                        np.zeros(lay.n_src // len(projs), np.float32) for p in projs])
                np.testing.assert_array_equal(bias[j][valid], b_src[lay.row_src[valid]])


# ----------------------------------------------------------------------------- helpers, laziness, bytes, refusals
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("count", [1, 5, 8, 37, 56, 120, 129])
def test_fast_bit_rows_match_layouts(bits, count):
    """convert.unpack_rows / pack_rows (byte-wide shifts) == kernels.layouts.unpack_bits / pack_bits."""
    codes = np.random.default_rng(bits * 1000 + count).integers(0, 1 << bits, size=(3, 2, count))
    packed = L.pack_bits(codes, bits)
    got = C.unpack_rows(packed, bits, count)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, L.unpack_bits(packed, bits, count))
    if bits in (4, 8):
        np.testing.assert_array_equal(C.pack_rows(codes.astype(np.uint8), bits), packed)
class _Recorder:
    """Wraps a stored tensor; records which experts were read."""

    def __init__(self, a, log):
        self.a, self.log = a, log
        self.shape, self.dtype = a.shape, a.dtype

    def __getitem__(self, idx):
        self.log.append(idx)
        return self.a[idx]


@pytest.mark.parametrize("layout", ["int3-block32", "int4-sm80-block64", "nvfp4-npacked", "mxfp4"])
def test_conversion_reads_one_expert_at_a_time(layout):
    attrs, t, x, lg, spec = _case(layout)
    log = []  # the E global scales (nvfp4 / mxfp4) are read whole, up front: one float per expert
    wrapped = {n: (v if v is None or n.endswith("_global_scale") else _Recorder(v, log)) for n, v in t.items()}
    conv = C.for_gpu(spec, wrapped)
    assert log == []  # building the conversion reads no expert
    w = conv.tensors["fc1_experts_weights"]
    assert isinstance(w, C.ExpertArray)
    chunk = w[np.array([2, 4])]
    assert chunk.shape == (2,) + w.shape[1:]
    assert all(isinstance(i, int) for i in log) and sorted(log) == [2, 4]
    np.testing.assert_array_equal(chunk[1], w[4])
    np.testing.assert_array_equal(w[-1], w[spec.num_experts - 1])


def _bytes_case(**kw):
    attrs, t, x, lg = make_layout_case(seed=0, E=2, H=128, I=64, bias=True, activation="swiglu", swiglu_fusion=1, **kw)
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape), t


@pytest.mark.parametrize("stored,native", [
    (dict(bits=2, block_size=32), dict(bits=4, block_size=32)),
    (dict(bits=3, block_size=32, zero_points=True), dict(bits=4, block_size=32, zero_points=True)),
    (dict(bits=4, fc2_bits=8), dict(bits=8)),
    (dict(bits=4, block_size=64, packing="sm80"), dict(bits=4, block_size=64)),
    (dict(quant_type="nvfp4", packing="k_packed"), dict(bits=8, block_size=16)),
    (dict(quant_type="nvfp4", packing="n_packed"), dict(bits=8, block_size=16)),
    (dict(quant_type="fp4"), dict(bits=8, block_size=32)),
])
def test_gpu_expert_bytes_is_the_converted_size(stored, native):
    """GpuQMoE.expert_bytes (and gpu_expert_bytes, which needs no CuPy) count the converted layout: the same bytes
    as a node stored natively in the target layout (fp32 scales), more than the stored bytes."""
    spec, t = _bytes_case(**stored)
    nspec, nt = _bytes_case(**native)
    assert C.gpu_expert_bytes(spec, t) == C.gpu_expert_bytes(nspec, nt)
    assert C.gpu_expert_bytes(spec, t, resident=True) == C.gpu_expert_bytes(nspec, nt, resident=True)
    assert C.gpu_expert_bytes(spec, t, resident=True) >= C.gpu_expert_bytes(spec, t)
    if stored.get("packing") != "sm80":
        assert C.gpu_expert_bytes(spec, t) > spec.expert_bytes()
    w_bytes = sum(lay.w_bytes for lay in LY.make_layouts(C.for_gpu(spec, t).spec, C.for_gpu(spec, t).tensors))
    if "quant_type" in stored or stored.get("bits") == 2:  # fp4 -> int8 and int2 -> int4: twice the weight bytes
        stored_w = sum(np.asarray(t[f"{p}_experts_weights"][0]).nbytes for p in ("fc1", "fc2"))
        assert w_bytes == 2 * stored_w


def test_native_layout_is_not_converted():
    attrs, t, x, lg = make_layout_case(seed=0, bits=4, block_size=32, zero_points=True)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    conv = C.for_gpu(spec, t)
    assert not conv.converted and conv.spec is spec and conv.tensors is t


@pytest.mark.parametrize("block", [0, 32])
def test_fp8_is_refused_by_name(block):
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="fp8", block_size=block, H=120, I=72)
    spec = QMoESpec.from_tensors("layer0/QMoE", "QMoE", attrs, t, x.shape)
    for call in (lambda: C.for_gpu(spec, t), lambda: C.gpu_expert_bytes(spec, t)):
        with pytest.raises(UnsupportedLayout) as ei:
            call()
        msg = str(ei.value)
        assert "layer0/QMoE" in msg and "\n" not in msg
        assert spec.layout_summary() in msg and "fp8 e4m3" in msg
        assert "GPU" in msg and "no exact conversion" in msg and "runs on the CPU" in msg


def test_gpuqmoe_refuses_fp8_without_cupy():
    """The refusal comes from the conversion, before CuPy is imported or a GPU is touched."""
    from kernels.gpu import GpuQMoE

    attrs, t, x, lg = make_layout_case(seed=0, quant_type="fp8")
    spec = QMoESpec.from_tensors("layer0/QMoE", "QMoE", attrs, t, x.shape)
    with pytest.raises(UnsupportedLayout, match="no exact conversion"):
        GpuQMoE(spec, t)


def test_unsupported_activation_is_refused_before_conversion():
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="nvfp4", packing="k_packed", activation="geglu",
                                       swiglu_fusion=1)
    spec = QMoESpec.from_tensors("layer0/QMoE", "QMoE", attrs, t, x.shape)
    with pytest.raises(UnsupportedLayout) as ei:
        C.for_gpu(spec, t)
    assert "nvfp4" in str(ei.value) and "geglu" in str(ei.value) and "layer0/QMoE" in str(ei.value)


def test_layout_check_refuses_unconverted_layouts():
    """check_supported (what make_layouts runs) still refuses what it cannot read as stored."""
    attrs, t, x, lg = make_layout_case(seed=0, bits=2, block_size=32)
    spec = QMoESpec.from_tensors("layer0/QMoE", "QMoE", attrs, t, x.shape)
    with pytest.raises(UnsupportedLayout, match="int2 block 32"):
        LY.check_supported(spec)
    LY.check_supported(C.for_gpu(spec, t).spec)


def test_mxfp4_scale_overflow_is_refused_when_converted():
    attrs, t, x, lg, spec = _case("mxfp4")
    s = np.asarray(t["fc2_scales"]).view(np.uint8).copy()
    s[3, 0, 0] = 254  # 2^127
    t2 = dict(t, fc2_scales=s.view(ml_dtypes.float8_e8m0fnu),
              fc2_global_scale=np.full(spec.num_experts, 8.0, np.float32))
    conv = C.for_gpu(spec, t2)
    conv.tensors["fc2_scales"][2]  # fine
    with pytest.raises(UnsupportedLayout, match="expert 3 fc2.*overflows"):
        conv.tensors["fc2_scales"][3]
