"""Fast CPU paths for MXFP4, NVFP4, int2 and int3 experts (kernels/cpu table kernels) against kernels.reference,
onnxruntime 1.32's CPU QMoE where it is an oracle for the layout (NVFP4 K-packed with power-of-two global
scales, int2 per row and block 16 (measured exact to fp32 rounding; not block 32: it quantises the activations),
int3 blocks with fp16 / bf16 activations: see /work/shared/reference/qmoe.md), and the dispatch that sends these
layouts there."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels.cpu import CpuQMoE
from kernels.cpu import generic as G
from kernels.qmoe_spec import QMoESpec
from kernels.reference import qmoe_reference
from tests.qmoe_oracle import make_layout_case, run_ort

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# layout -> (make_layout_case kwargs, allowed K values (H and I)); the K sets include odd numbers of blocks,
# so rows end in half a 16-byte chunk (NVFP4 / int2 block 32), in one to three of its four blocks (int2 block 16),
# or in ragged bytes (int2 per row); NVFP4 K 144 / 176: the kernel's 4-chunk loop (one scale-code load) and a tail
LAYOUTS = {
    "mxfp4": (dict(quant_type="fp4"), (32, 64, 96, 160)),
    "nvfp4-kpacked": (dict(quant_type="nvfp4", packing="k_packed"), (16, 48, 64, 80, 112, 144, 176)),
    "nvfp4-kpacked-kn": (dict(quant_type="nvfp4", packing="k_packed", kpacked_dims="kn"), (32, 48, 96)),
    "nvfp4-npacked": (dict(quant_type="nvfp4", packing="n_packed"), (16, 48, 80)),
    "int2-row": (dict(bits=2), (36, 68, 100, 132)),
    "int2-row-zp": (dict(bits=2, zero_points=True), (4, 60, 124)),
    "int2-block32-zp": (dict(bits=2, block_size=32, zero_points=True), (32, 96, 160)),
    "int2-block64": (dict(bits=2, block_size=64), (64, 128, 192)),
    "int2-fc1-int4-fc2": (dict(bits=2, fc2_bits=4, block_size=32, zero_points=True), (64, 96, 160)),
    # int2 block 16: four 4-byte blocks per 16-byte chunk; 3, 5, 7 blocks leave 3, 1, 3 in the row's tail
    "int2-block16-zp": (dict(bits=2, block_size=16, zero_points=True), (48, 80, 112, 128)),
    "int2-block16": (dict(bits=2, block_size=16), (16, 64, 80, 112)),
    # int3: 64-code chunks of 24 bytes; per row K of any size (rows end in ragged codes and padding bits), blocks
    # of 32 with odd counts (rows end in half a chunk), blocks of 64 / 128 (whole chunks)
    "int3-row-zp": (dict(bits=3, zero_points=True), (37, 100, 133, 200)),
    "int3-row": (dict(bits=3), (64, 71, 150)),
    "int3-block32-zp": (dict(bits=3, block_size=32, zero_points=True), (32, 96, 160)),
    "int3-block64": (dict(bits=3, block_size=64), (64, 128, 192)),
    "int3-block128-zp": (dict(bits=3, block_size=128, zero_points=True), (128, 256)),
}
_INT3_FEW = ("int3-row", "int3-block128-zp")  # fewer activations / dtypes: keeps the file's runtime moderate
ACTS = {
    "relu": dict(activation="relu"),
    "gelu": dict(activation="gelu"),
    "silu": dict(activation="silu"),
    "identity": dict(activation="identity"),
    "swiglu1": dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0),
    "swiglu2": dict(activation="swiglu", swiglu_fusion=2, alpha=1.0, beta=0.5, swiglu_limit=0.5),
    "swiglu0": dict(activation="swiglu", swiglu_fusion=0, alpha=1.702, beta=1.0),  # FC3: int layouts only
    "silu-fc3": dict(activation="silu", fc3=True),
}
_FP4 = ("mxfp4", "nvfp4-kpacked", "nvfp4-kpacked-kn", "nvfp4-npacked")
GRID = [(lay, act, dt) for lay in LAYOUTS for act in ACTS for dt in DTYPES
        if not (lay in _FP4 and act in ("swiglu0", "silu-fc3"))  # the contract has no fc3 global scale
        and not (lay == "int2-fc1-int4-fc2" and act in ("swiglu0", "silu-fc3"))
        and (dt == "fp32" or act in ("swiglu1", "swiglu2", "gelu"))
        and not (lay in _INT3_FEW and (act not in ("swiglu1", "swiglu0", "relu") or dt == "fp16"))]


def _relerr(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _tol(dtype):
    return {np.float32: 1e-5, np.float16: 4e-3}.get(dtype, 2e-2)


def _spec(attrs, t, x):
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)


def _case(layout, act, dtype, seed, T=24, E=6, k=2):
    kw, ks = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    H, I = int(rng.choice(ks)), int(rng.choice(ks))
    attrs, t, x, lg = make_layout_case(seed=seed, E=E, H=H, I=I, k=k, T=T, bias=seed % 2 == 0, dtype=dtype,
                                       **kw, **ACTS[act])
    return _spec(attrs, t, x), attrs, t, x, lg


def _fast(spec, t):
    m = CpuQMoE(spec, t, num_threads=2)
    inner = m._delegate.inner if isinstance(m._delegate, G._ConvertedFast) else m
    assert inner._delegate is None, "not on the fast path"
    return m, inner


@pytest.mark.parametrize("layout,act,dtype", GRID, ids=[f"{a}-{b}-{c}" for a, b, c in GRID])
def test_fast_paths_match_reference(layout, act, dtype):
    """Default dispatch at 1 and 24 tokens, forced decode kernel (1..8 tokens) and forced GEMM (prefill)."""
    idx = GRID.index((layout, act, dtype))
    spec, attrs, t, x, lg = _case(layout, act, DTYPES[dtype], seed=500 + idx)
    m, inner = _fast(spec, t)
    tol = _tol(DTYPES[dtype])
    for T in (1, x.shape[0]):
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        got = m.forward(x[:T], lg[:T])
        assert got.dtype == x.dtype and got.shape == (T, spec.hidden_size)
        assert _relerr(got, ref) <= tol, f"default T={T}"
    inner.decode_max_tokens = 8  # up to 8 tokens: every expert on the decode kernel (where it applies)
    for order in (0, 1):  # decode chunk orders: one shared counter, own spans then stealing
        inner.gemv_schedule = order
        for T in (2, 5, 8) if dtype == "fp32" else (8,):
            got = m.forward(x[:T], lg[:T])
            assert _relerr(got, qmoe_reference(x[:T], lg[:T], spec, t)) <= tol, f"decode T={T} order {order}"
    inner.decode_max_tokens, inner.gemv_max_rows = 0, 0  # everything on the GEMM: several k-blocks, partial panels
    inner.gemm_kc, inner.gemm_rows, inner.gemm_cols = 64, 12, 32
    assert _relerr(m.forward(x, lg), qmoe_reference(x, lg, spec, t)) <= tol, "forced GEMM"


@pytest.mark.parametrize("layout", ["mxfp4", "nvfp4-kpacked", "int2-row", "int2-block32-zp", "int2-block16-zp",
                                    "int3-block32-zp", "int3-row-zp"])
def test_fast_paths_match_generic_and_accumulate_subsets(layout):
    """The generic path as second implementation; run_experts adding subsets of experts into one accumulator."""
    spec, attrs, t, x, lg = _case(layout, "swiglu1", np.float32, seed=7, T=12, E=8, k=3)
    m, _ = _fast(spec, t)
    gen = G.GenericQMoE(spec, t)
    from kernels.cpu.routing import route
    ids, w = route(lg, spec)
    for T in (1, 12):
        a = m.run_experts(x[:T], ids[:T], w[:T])
        b = gen.run_experts(x[:T], ids[:T], w[:T])
        assert _relerr(a, b) <= 1e-5
    acc = np.zeros(x.shape, np.float32)
    for subset in (range(0, 3), range(3, 8)):
        m.run_experts(x, np.where(np.isin(ids, list(subset)), ids, -1), w, out=acc)
    assert _relerr(acc, qmoe_reference(x, lg, spec, t)) <= 1e-5


ORACLE = [  # onnxruntime 1.32 CPU: exact for these (see qmoe.md; nvfp4 only with power-of-two global scales)
    ("nvfp4-kpacked", dict(quant_type="nvfp4", packing="k_packed", global_pow2=True, bias=True), np.float32, 1e-5),
    ("nvfp4-kpacked-fp16", dict(quant_type="nvfp4", packing="k_packed", global_pow2=True), np.float16, 3e-3),
    ("int2-row", dict(bits=2, bias=True), np.float32, 1e-5),
    ("int2-row-zp-fp16", dict(bits=2, zero_points=True), np.float16, 3e-3),
    ("int2-block16-zp", dict(bits=2, block_size=16, zero_points=True, H=112, I=80, bias=True), np.float32, 1e-5),
    ("int2-block16-fp16", dict(bits=2, block_size=16), np.float16, 3e-3),
    # int3: onnxruntime 1.32 runs it with fp16 / bf16 activations, swiglu fusion 1, blocks of 32 / 64 / 128
    ("int3-block32-fp16", dict(bits=3, block_size=32, nonneg_scales=True, bias=True), np.float16, 3e-3),
    ("int3-block64-fp16", dict(bits=3, block_size=64, I=128, nonneg_scales=True), np.float16, 3e-3),
    ("int3-block128-bf16", dict(bits=3, block_size=128, I=128, nonneg_scales=True), ml_dtypes.bfloat16, 2e-2),
]


@pytest.mark.parametrize("case", ORACLE, ids=[c[0] for c in ORACLE])
def test_fast_paths_match_onnxruntime(case):
    name, kw, dtype, tol = case
    attrs, t, x, lg = make_layout_case(seed=len(name), E=8, k=2, T=9, dtype=dtype, **{"H": 128, "I": 96, **kw},
                                       **ACTS["swiglu1"])
    spec = _spec(attrs, t, x)
    m, _ = _fast(spec, t)
    for T in (1, 9):
        assert _relerr(m.forward(x[:T], lg[:T]), run_ort("QMoE", attrs, t, x[:T], lg[:T])) <= tol, f"T={T}"


def test_delegate_for_picks_the_fast_paths():
    def delegate(**kw):
        attrs, t, x, lg = make_layout_case(seed=0, **{"H": 128, "I": 64, **kw})
        spec = _spec(attrs, t, x)
        return G.delegate_for(spec, t), G.fast_layout(spec)

    for kw in (dict(quant_type="fp4"), dict(quant_type="nvfp4", packing="k_packed"), dict(bits=2),
               dict(bits=2, block_size=32, zero_points=True), dict(bits=2, block_size=64),
               dict(bits=2, fc2_bits=8, block_size=32), dict(bits=2, activation="swiglu", swiglu_fusion=0),
               dict(bits=2, block_size=16), dict(bits=2, block_size=16, zero_points=True, activation="swiglu",
                                                 swiglu_fusion=0)):
        d, fast = delegate(**kw)
        assert d is None and fast, kw
    for kw in (dict(bits=3), dict(bits=3, block_size=32, zero_points=True), dict(bits=3, block_size=64),
               dict(bits=3, block_size=128, I=128), dict(bits=3, fc2_bits=4, block_size=32),
               dict(bits=4, fc2_bits=3, H=126)):
        d, fast = delegate(**kw)
        assert d is None and fast, kw  # int3: CpuQMoE's own int3 projections
    d, fast = delegate(quant_type="nvfp4", packing="n_packed")
    assert isinstance(d, G._ConvertedFast) and d.inner._delegate is None and fast
    # the generic path stays for what the table kernels do not read: other activations, int3 blocks of 16, fp8
    for kw in (dict(quant_type="fp4", activation="geglu", swiglu_fusion=1),
               dict(quant_type="nvfp4", packing="k_packed", activation="relu2"),
               dict(bits=3, activation="relu2"), dict(bits=3, block_size=16), dict(quant_type="fp8")):
        d, fast = delegate(**kw)
        assert isinstance(d, G.GenericQMoE), kw
    d, fast = delegate(bits=2, H=126, I=64)  # K not a multiple of 4: rows end in padding bits
    assert isinstance(d, G.GenericQMoE) and not fast


def test_int2_block16_projections():
    """int2 block 16 runs the four-blocks-per-chunk kernels (bpc 4) in every projection, FC3 included."""
    attrs, t, x, lg = make_layout_case(seed=1, H=112, I=48, bits=2, block_size=16, zero_points=True,
                                       activation="swiglu", swiglu_fusion=0)
    _, inner = _fast(_spec(attrs, t, x), t)
    assert [p.bpc for p in (inner.fc1, inner.fc2, inner.fc3)] == [4, 4, 4]
    assert [p.nchunk for p in (inner.fc1, inner.fc2, inner.fc3)] == [1, 0, 1]  # 7 and 3 blocks: tails of 3
