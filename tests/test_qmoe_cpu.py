"""kernels.cpu.CpuQMoE against kernels.reference.qmoe_reference, and QMoESpec.from_node admission."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels.cpu import CpuQMoE
from kernels.cpu.routing import route as cpu_route
from kernels.qmoe_spec import QMOE_INPUT_NAMES, QMoESpec, UnsupportedLayout
from kernels.reference import qmoe_reference, route as ref_route
from tests.qmoe_oracle import make_case

ACTS = {
    "relu": dict(activation="relu"),
    "gelu": dict(activation="gelu"),
    "silu": dict(activation="silu"),
    "identity": dict(activation="identity"),
    "swiglu0": dict(activation="swiglu", swiglu_fusion=0, alpha=1.702, beta=1.0),
    "swiglu0-limit": dict(activation="swiglu", swiglu_fusion=0, alpha=1.702, beta=1.0, swiglu_limit=0.5),
    "swiglu1": dict(activation="swiglu", swiglu_fusion=1, alpha=1.0, beta=0.0),
    "swiglu1-limit": dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=0.5),
    "swiglu2": dict(activation="swiglu", swiglu_fusion=2, alpha=1.0, beta=0.5),
    "swiglu2-limit": dict(activation="swiglu", swiglu_fusion=2, alpha=1.702, beta=1.0, swiglu_limit=0.5),
}


def _relerr(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 4e-3


def _spec(attrs, t, x, op_type="QMoE"):
    return QMoESpec.from_tensors("test/QMoE", op_type, attrs, t, x.shape)


def _shapes(rng, block):
    if block:
        return int(rng.choice(range(block, 129, block))), int(rng.choice(range(block, 129, block)))
    # per row: any even size, often not a multiple of the 16-byte chunk (ragged tails)
    return int(rng.integers(16, 65)) * 2, int(rng.integers(16, 65)) * 2


def _check_paths(spec, t, x, lg, rw=None, tol=1e-5):
    """Default paths at 1 and many tokens, plus forced GEMV-only and GEMM-only runs."""
    m = CpuQMoE(spec, t, num_threads=2)
    for T in (1, x.shape[0]):
        xs, ls = x[:T], lg[:T]
        r = None if rw is None else rw[:T]
        ref = qmoe_reference(xs, ls, spec, t, router_weights=r)
        got = m.forward(xs, ls, router_weights=r)
        assert got.dtype == xs.dtype and got.shape == xs.shape
        assert _relerr(got, ref) <= tol, f"T={T}"
    ref = qmoe_reference(x, lg, spec, t, router_weights=rw)
    gemv = CpuQMoE(spec, t)
    gemv.decode_max_tokens = 10**9
    gemv.gemv_prefetch_rows, gemv.gemv_chunk_kb = 2, 1
    # 1 KB chunks: FC2 chunks meet experts whose FC1 chunks are still running (moe_gemv's per-expert hand-off);
    # chunk orders: one shared counter, own spans then stealing
    for order in (0, 1):
        gemv.gemv_schedule = order
        assert _relerr(gemv.forward(x, lg, router_weights=rw), ref) <= tol, f"forced GEMV, order {order}"
    gemm = CpuQMoE(spec, t)
    gemm.decode_max_tokens = 0
    gemm.gemv_max_rows = 0
    gemm.gemm_max_rows = 16  # legacy path: several GEMM calls per expert, 16-wide micro-kernel tail
    # batched path: several k-blocks, partial 6-row panels, several column groups per expert
    gemm.gemm_kc, gemm.gemm_rows, gemm.gemm_cols = 64, 12, 32
    assert _relerr(gemm.forward(x, lg, router_weights=rw), ref) <= tol, "forced GEMM"


GRID = [(bits, block, zp, act) for bits in (4, 8) for block in (0, 32, 64) for zp in (False, True) for act in ACTS]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bits,block,zp,act", GRID, ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in GRID])
def test_cpu_matches_reference(bits, block, zp, act, dtype):
    idx = GRID.index((bits, block, zp, act))
    seed = 1000 + idx * 2 + (dtype == np.float16)
    rng = np.random.default_rng(seed)
    H, I = _shapes(rng, block)
    attrs, t, x, lg = make_case(seed=seed, E=int(rng.integers(4, 9)), H=H, I=I, k=int(rng.integers(1, 4)),
                                bits=bits, block_size=block, zero_points=zp, bias=bool((idx + (dtype == np.float16)) % 2),
                                dtype=dtype, T=37, **ACTS[act])
    _check_paths(_spec(attrs, t, x), t, x, lg, tol=_tol(dtype))


LEGACY = [(bits, block, act) for bits in (4, 8) for block in (0, 32) for act in ("swiglu1-limit", "gelu", "swiglu0")]


@pytest.mark.parametrize("bits,block,act", LEGACY, ids=[f"int{b}-blk{k}-{a}" for b, k, a in LEGACY])
def test_cpu_legacy_per_expert_paths(bits, block, act):
    """The per-expert paths (CpuQMoE.batched = False), kept for comparison, stay correct."""
    seed = 5000 + LEGACY.index((bits, block, act))
    rng = np.random.default_rng(seed)
    H, I = _shapes(rng, block)
    attrs, t, x, lg = make_case(seed=seed, E=6, H=H, I=I, k=2, bits=bits, block_size=block, zero_points=bool(seed % 2),
                                bias=True, T=37, **ACTS[act])
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t)
    for T_dec, rows in ((0, 6), (10**9, 6), (0, 0)):
        m = CpuQMoE(spec, t)
        m.batched = False
        m.decode_max_tokens, m.gemv_max_rows = T_dec, rows
        assert _relerr(m.forward(x, lg), ref) <= 1e-5


def test_cpu_kernels_without_avx512():
    """Code generated for a CPU without AVX-512 computes the same: tests/haswell_check.py in a subprocess with Numba
    targeting Haswell, started by conftest.py when collection ends (it compiles beside the other tests), or here."""
    from tests import haswell_check

    check, haswell_check.running = haswell_check.running or haswell_check.Check(), None
    status, printed = check.result(timeout=900)
    assert status == 0 and printed.rstrip().endswith("all cases agree"), printed


@pytest.mark.parametrize("normalize", [0, 1])
def test_cpu_router_weights(normalize):
    attrs, t, x, lg = make_case(seed=7, E=8, H=64, I=96, k=3, bits=4, block_size=32, normalize=normalize, T=37,
                                activation="swiglu", swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, beta=1.0)
    rw = np.random.default_rng(8).uniform(0.0, 1.0, size=lg.shape).astype(np.float32)
    _check_paths(_spec(attrs, t, x), t, x, lg, rw=rw)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_sparse_mixer(bits):
    attrs, t, x, lg = make_case(seed=9, E=16, H=64, I=64, k=2, bits=bits, sparse_mixer=True, normalize=0, T=37,
                                activation="silu", bias=True)
    lg = (lg * 0.05).astype(np.float32)  # close logits so the jitter threshold masks some experts
    spec = _spec(attrs, t, x)
    ids_c, w_c = cpu_route(lg, spec)
    ids_r, w_r = ref_route(lg, spec)
    assert ids_c.tolist() == ids_r.tolist()
    np.testing.assert_allclose(w_c, w_r, rtol=1e-6)
    _check_paths(spec, t, x, lg)


def test_cpu_routing_matches_reference_routing():
    rng = np.random.default_rng(3)
    for k, normalize in ((1, 0), (2, 1), (4, 0), (4, 1)):
        attrs, t, x, lg = make_case(E=12, k=k, normalize=normalize)
        spec = _spec(attrs, t, x)
        z = rng.standard_normal((50, 12)).astype(np.float32)
        z[0, :] = 1.0  # all tied
        a = cpu_route(z, spec)
        b = ref_route(z, spec)
        assert a[0].tolist() == b[0].tolist()
        np.testing.assert_allclose(a[1], b[1], rtol=1e-6)


def test_cpu_3d_input_and_fp16():
    attrs, t, x, lg = make_case(seed=4, E=6, H=64, I=64, k=2, bits=4, block_size=32, dtype=np.float16, T=12,
                                activation="swiglu", swiglu_fusion=1, bias=True)
    x3 = x.reshape(3, 4, 64)
    spec = _spec(attrs, t, x3)
    got = CpuQMoE(spec, t).forward(x3, lg)
    assert got.shape == (3, 4, 64) and got.dtype == np.float16
    assert _relerr(got, qmoe_reference(x3, lg, spec, t)) <= 4e-3


def test_cpu_float_moe():
    for kw in (dict(activation="gelu", bias=True, normalize=0), dict(activation="swiglu", swiglu_fusion=2),
               dict(activation="silu", fc3=True)):
        attrs, t, x, lg = make_case(seed=5, E=5, H=48, I=40, k=2, op_type="MoE", T=20, **kw)
        spec = _spec(attrs, t, x, "MoE")
        m = CpuQMoE(spec, t)
        for T in (1, 20):
            assert _relerr(m.forward(x[:T], lg[:T]), qmoe_reference(x[:T], lg[:T], spec, t)) <= 1e-5


def test_run_experts_skips_minus_one_and_accumulates_subsets():
    attrs, t, x, lg = make_case(seed=6, E=8, H=64, I=64, k=3, bits=4, block_size=32, T=23, activation="gelu",
                                bias=True)
    spec = _spec(attrs, t, x)
    m = CpuQMoE(spec, t)
    ids, w = ref_route(lg, spec)
    full = m.run_experts(x, ids, w)
    # -1 = skipped: equal to the reference with those weights zeroed
    ids_m = ids.copy()
    ids_m[::2, 1] = -1
    w_m = np.where(ids_m >= 0, w, 0).astype(np.float32)
    want = np.zeros_like(x, dtype=np.float64)
    from kernels.reference import expert_ffn
    for i in range(x.shape[0]):
        for j in range(3):
            if ids_m[i, j] >= 0:
                want[i] += w_m[i, j] * expert_ffn(x[i:i + 1], int(ids_m[i, j]), spec, t)[0]
    for T_dec in (0, 10**9):  # GEMM and GEMV paths
        m.decode_max_tokens = T_dec
        m.gemv_max_rows = 0
        assert _relerr(m.run_experts(x, ids_m, w), want) <= 1e-5
    # subsets of experts accumulate into one float32 buffer
    acc = np.zeros(x.shape, np.float32)
    for subset in (range(0, 3), range(3, 8)):
        sel = np.where(np.isin(ids, list(subset)), ids, -1)
        m.run_experts(x, sel, w, out=acc)
    assert _relerr(acc, full) <= 1e-5
    # all skipped
    assert not np.any(m.run_experts(x, np.full_like(ids, -1), w))


def test_cpu_memmap_weights_are_used_in_place(tmp_path):
    attrs, t, x, lg = make_case(seed=10, E=4, H=64, I=64, k=2, bits=4, block_size=32, zero_points=True, T=9,
                                activation="swiglu", swiglu_fusion=1)
    mm = {}
    for name, arr in t.items():
        path = tmp_path / f"{name}.bin"
        arr.tofile(path)
        mm[name] = np.memmap(path, dtype=arr.dtype, mode="r", shape=arr.shape)
    spec = _spec(attrs, mm, x)
    m = CpuQMoE(spec, mm)
    assert np.shares_memory(m.fc1.w, mm["fc1_experts_weights"])
    assert np.shares_memory(m.fc2.sc, mm["fc2_scales"])
    assert _relerr(m.forward(x, lg), qmoe_reference(x, lg, spec, t)) <= 1e-5


# ----------------------------------------------------------------------------- from_node admission
def _shapes_of(t, x):
    s = {n: (None if t.get(n) is None else tuple(t[n].shape)) for n in QMOE_INPUT_NAMES}
    s["input"] = tuple(x.shape)
    s["router_probs"] = (x.shape[0], 8)
    return s


BASE = dict(seed=0, E=8, H=64, I=64, k=2, bits=4, block_size=32)


def _node_error(attrs_update=None, shapes_update=None, case=None):
    attrs, t, x, lg = make_case(**(case or BASE))
    attrs.update(attrs_update or {})
    shapes = _shapes_of(t, x)
    shapes.update(shapes_update or {})
    with pytest.raises(UnsupportedLayout) as ei:
        QMoESpec.from_node("/model/layers.0/moe/QMoE", "QMoE", attrs, shapes)
    msg = str(ei.value)
    assert "/model/layers.0/moe/QMoE" in msg and "\n" not in msg
    return msg


# Layouts that are supported now (int2/int3, mixed widths, prepacked, fp4/nvfp4/fp8, geglu, relu2, limit after
# activation) are admitted in tests/test_qmoe_layouts.py; a mismatching shape still names the layout.
@pytest.mark.parametrize("attrs_update,needle", [
    ({"quant_type": b"nvfp4"}, "nvfp4"),
    ({"quant_type": "fp4"}, "mxfp4"),
    ({"quant_type": "fp8"}, "fp8"),
    ({"quant_type": "wfp4afp8"}, "wfp4afp8"),
    ({"expert_weight_bits": 2}, "int2"),
    ({"expert_weight_bits": 3}, "int3"),
    ({"fc2_expert_weight_bits": 8}, "int4/int8"),
    ({"activation_type": b"geglu"}, "geglu"),
    ({"block_size": 24}, "block_size"),
    ({"use_sparse_mixer": 1, "k": 3}, "sparse mixer"),
])
def test_from_node_rejects_unsupported_layouts_by_name(attrs_update, needle):
    case = dict(BASE)
    if attrs_update.get("activation_type") == "swiglu":
        case.update(activation="swiglu", swiglu_fusion=1)
    assert needle in _node_error(attrs_update, case=case)


@pytest.mark.parametrize("name,needle", [("fc1_act_scale", "fp8 activation scales"),
                                         ("fc2_act_block_scale", "fp8 activation"),
                                         ("fc1_global_scale", "global")])
def test_from_node_rejects_extra_inputs(name, needle):
    msg = _node_error(shapes_update={name: (8,)})
    assert needle in msg and name in msg


def test_from_node_rejects_prepacked_shaped_tensors():
    # CUDA-prepacked FC1 is [E, K, N/2] instead of raw [E, N, K/2]
    msg = _node_error({"weights_prepacked": -1}, {"fc1_experts_weights": (8, 64, 64)},
                      case=dict(BASE, I=128))
    assert "fc1_experts_weights" in msg and "prepacked" in msg


def test_from_node_rejects_swiglu_fusion0_without_fc3():
    msg = _node_error({"activation_type": "swiglu", "swiglu_fusion": 0})
    assert "fc3" in msg


def test_from_node_accepts_and_describes():
    attrs, t, x, lg = make_case(E=32, H=64, I=128, k=4, bits=4, block_size=32, activation="swiglu",
                                swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, beta=1.0, zero_points=True, bias=True)
    attrs = {k: (v.encode() if isinstance(v, str) else v) for k, v in attrs.items()}  # strings may be bytes
    attrs["weights_prepacked"] = -1
    spec = QMoESpec.from_node("n", "QMoE", attrs, _shapes_of(t, x) | {"input": ("batch", "seq", 64),
                                                                       "router_probs": ("tokens", 32)})
    assert (spec.num_experts, spec.hidden_size, spec.inter_size, spec.k) == (32, 64, 128, 4)
    assert spec.fc1_bits == spec.fc2_bits == 4 and spec.block_size == 32 and spec.swiglu_limit == 7.0
    assert spec.has_zero_points and spec.has_bias and not spec.has_fc3
    s = spec.supported_summary()
    assert "int4 block 32" in s and "swiglu (interleaved)" in s and "zero points: yes" in s
    one = sum(a[0].nbytes for n, a in t.items())
    assert spec.expert_bytes() == one
    fspec = QMoESpec.from_node("m", "MoE", {"activation_type": "gelu", "k": 2},
                               {"input": (3, 48), "fc1_experts_weights": (4, 40, 48),
                                "fc2_experts_weights": (4, 48, 40)})
    assert (fspec.num_experts, fspec.hidden_size, fspec.inter_size) == (4, 48, 40)
    assert "float weights" in fspec.supported_summary()


ROW_SCALES = [("fp16", np.float16, 416, 288), ("bf16", ml_dtypes.bfloat16, 416, 288),
              ("fp16-wide", np.float16, 32 * 1025, 32), ("bf16-wide", ml_dtypes.bfloat16, 32 * 1025, 32)]


@pytest.mark.parametrize("name,dtype,H,I", ROW_SCALES, ids=[r[0] for r in ROW_SCALES])
def test_16_bit_scales_converted_per_row_match_reference(name, dtype, H, I):
    """The table kernels convert a row's fp16 / bf16 scales eight at a time before its chunks (13 and 9 blocks a
    row: one group of eight and a tail); a row of more blocks than they convert up front (1025 > MAX_ROW_BLOCKS)
    has its scales kept in float32 instead. int4 block 32, decode and prefill, against the reference."""
    from kernels.cpu import simd

    attrs, t, x, lg = make_case(seed=77, E=3, H=H, I=I, k=2, bits=4, block_size=32, bias=True, dtype=dtype, T=9,
                                **ACTS["swiglu1-limit"])
    spec = _spec(attrs, t, x)
    wide = H // 32 > simd.MAX_ROW_BLOCKS
    node = CpuQMoE(spec, t, num_threads=2)
    assert (node.fc1.sc.dtype == np.float32) == wide and (node.fc2.sc.dtype == np.uint16)
    tol = 4e-3 if dtype is np.float16 else 2e-2
    for T in (1, x.shape[0]):
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        assert _relerr(node.forward(x[:T], lg[:T]), ref) <= tol, (name, T)


def test_a_bias_read_in_place_and_a_converted_one_share_the_compiled_kernels():
    """Numba compiles a kernel once per argument type, read-only arrays being a type of their own: a bias used in
    place from the weight file (read-only) and one converted from float16 (a new array) reach the kernels as the same
    type, else every CPU kernel is compiled twice (about a minute each); the caller's arrays are left as they were."""
    import numba

    attrs, t, x, lg = make_case(seed=3, E=4, H=64, I=32, k=2, bits=4, block_size=32, T=1, bias=True,
                                activation="swiglu", swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702)
    in_place = dict(t)
    for name in ("fc1_experts_bias", "fc2_experts_bias"):
        in_place[name] = np.ascontiguousarray(t[name], np.float32)
        in_place[name].flags.writeable = False  # as numpy_helper gives an initializer mapped from the file
    converted = dict(t, fc1_experts_bias=t["fc1_experts_bias"].astype(np.float16),
                     fc2_experts_bias=t["fc2_experts_bias"].astype(np.float16))
    spec = QMoESpec.from_tensors("t", "QMoE", attrs, t, x.shape)
    first, second = CpuQMoE(spec, in_place), CpuQMoE(spec, converted)
    for proj in ("fc1", "fc2"):
        assert numba.typeof(getattr(first, proj).bias) == numba.typeof(getattr(second, proj).bias)
        assert converted[f"{proj}_experts_bias"].flags.writeable
    np.testing.assert_allclose(second.forward(x, lg), first.forward(x, lg), rtol=1e-3, atol=1e-3)
