"""kernels/reference.py against onnxruntime's CPU QMoE (where qmoe.md says it is an exact oracle) and
against small independent NumPy computations elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.qmoe_spec import QMoESpec
from kernels.reference import dequantize, expert_ffn, qmoe_reference, route
from tests.qmoe_oracle import make_case, pack_codes, run_ort

RTOL32 = 1e-4


def _relerr(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _shapes(rng, block):
    """Random (H, I) in 32..128, multiples of the block (or even for per-row quantisation)."""
    if block:
        choices = [m for m in range(block, 129, block)]
        return int(rng.choice(choices)), int(rng.choice(choices))
    return int(rng.integers(16, 65)) * 2, int(rng.integers(16, 65)) * 2


def _spec(attrs, t, x, op_type="QMoE"):
    return QMoESpec.from_tensors("test/QMoE", op_type, attrs, t, x.shape)


# ----------------------------------------------------------------------------- onnxruntime oracle
ORACLE_LAYOUTS = [(4, 0, False), (4, 0, True), (4, 32, False), (4, 32, True), (4, 64, False), (4, 64, True),
                  (8, 0, False), (8, 0, True)]
ORACLE_ACTS = [("relu", {}), ("gelu", {}), ("silu", {}), ("identity", {}),
               ("swiglu", dict(swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0)),
               ("swiglu", dict(swiglu_fusion=1, alpha=1.0, beta=0.0)),
               ("swiglu", dict(swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=0.05))]


@pytest.mark.parametrize("bits,block,zp", ORACLE_LAYOUTS)
@pytest.mark.parametrize("act", range(len(ORACLE_ACTS)))
def test_reference_matches_onnxruntime(bits, block, zp, act):
    seed = hash((bits, block, zp, act)) % 2**31
    rng = np.random.default_rng(seed)
    H, I = _shapes(rng, block)
    name, kw = ORACLE_ACTS[act]
    attrs, t, x, lg = make_case(seed=seed, E=int(rng.integers(4, 9)), H=H, I=I, k=int(rng.integers(1, 4)), bits=bits,
                                block_size=block, zero_points=zp, activation=name, bias=bool(act % 2),
                                T=int(rng.integers(1, 12)), **kw)
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t)
    ort_out = run_ort("QMoE", attrs, t, x, lg)
    assert ref.dtype == x.dtype and ref.shape == x.shape
    assert _relerr(ref, ort_out) <= RTOL32


@pytest.mark.parametrize("bits,block", [(4, 0), (4, 32), (8, 0)])
def test_reference_matches_onnxruntime_fp16(bits, block):
    attrs, t, x, lg = make_case(seed=11 + bits + block, E=6, H=64, I=96, k=2, bits=bits, block_size=block,
                                activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0,
                                bias=True, dtype=np.float16, T=7)
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t)
    assert ref.dtype == np.float16
    assert _relerr(ref, run_ort("QMoE", attrs, t, x, lg)) <= 2e-3


@pytest.mark.parametrize("normalize", [0, 1])
def test_reference_router_weights_matches_onnxruntime(normalize):
    attrs, t, x, lg = make_case(seed=3, E=8, H=64, I=64, k=3, bits=4, block_size=32, normalize=normalize, T=9)
    rw = np.random.default_rng(4).uniform(0.05, 1.0, size=lg.shape).astype(np.float32)
    spec = _spec(attrs, t, x)
    ref = qmoe_reference(x, lg, spec, t, router_weights=rw)
    assert _relerr(ref, run_ort("QMoE", attrs, t, x, lg, router_weights=rw)) <= RTOL32


def test_reference_3d_input_matches_onnxruntime():
    attrs, t, x, lg = make_case(seed=5, E=4, H=64, I=32, k=2, bits=4, T=6, activation="gelu")
    x3 = x.reshape(2, 3, 64)
    spec = _spec(attrs, t, x3)
    ref = qmoe_reference(x3, lg, spec, t)
    assert ref.shape == (2, 3, 64)
    assert _relerr(ref, run_ort("QMoE", attrs, t, x3, lg)) <= RTOL32


@pytest.mark.parametrize("kw", [dict(activation="relu"), dict(activation="gelu", normalize=0, bias=True),
                                dict(activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0)])
def test_reference_float_moe_matches_onnxruntime(kw):
    attrs, t, x, lg = make_case(seed=8, E=6, H=48, I=40, k=2, op_type="MoE", T=5, **kw)
    spec = _spec(attrs, t, x, "MoE")
    assert _relerr(qmoe_reference(x, lg, spec, t), run_ort("MoE", attrs, t, x, lg)) <= RTOL32


# ----------------------------------------------------------------------------- independent NumPy checks
def _dequant_loops(w, s, zp, bits, block, K):
    """Explicit-loop dequantisation of one expert [N, K*bits/8]."""
    N = w.shape[0]
    out = np.zeros((N, K))
    per = 8 // bits
    mask = (1 << bits) - 1
    for n in range(N):
        for k in range(K):
            q = (int(w[n, k // per]) >> (bits * (k % per))) & mask
            b = k // block if block else 0
            if zp is None:
                z = 1 << (bits - 1)
            elif block:
                z = (int(zp[n, b // per]) >> (bits * (b % per))) & mask
            else:
                z = (int(zp[n // per]) >> (bits * (n % per))) & mask
            sc = s[n, b] if block else s[n]
            out[n, k] = (q - z) * float(sc)
    return out


@pytest.mark.parametrize("bits,block,zp", [(4, 0, False), (4, 0, True), (4, 16, True), (4, 32, False),
                                           (8, 0, True), (8, 32, True), (8, 64, False)])
def test_dequantize_matches_explicit_loops(bits, block, zp):
    attrs, t, x, lg = make_case(seed=21, E=2, H=64, I=64, bits=bits, block_size=block,
                                zero_points=zp)
    w, s = t["fc1_experts_weights"], t["fc1_scales"]
    z = t.get("fc1_zero_points")
    got = dequantize(w, s, z, bits, block)
    assert got.shape == (2, 64, 64)
    for e in range(2):
        want = _dequant_loops(w[e], s[e], None if z is None else z[e], bits, block, 64)
        np.testing.assert_allclose(got[e], want, rtol=1e-6, atol=1e-7)


def test_pack_codes_low_nibble_is_even_k():
    assert pack_codes(np.array([[1, 2, 3, 4]]), 4).tolist() == [[0x21, 0x43]]


def test_route_explicit_sort():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((20, 7)).astype(np.float32)
    for normalize in (0, 1):
        attrs, t, x, lg = make_case(E=7, k=3, normalize=normalize)
        spec = _spec(attrs, t, x)
        ids, w = route(z, spec)
        for i in range(20):
            p = np.exp(z[i] - z[i].max())
            p /= p.sum()
            order = sorted(range(7), key=lambda e: (-z[i, e], e))[:3]
            want = p[order] / (p[order].sum() if normalize else 1.0)
            assert ids[i].tolist() == order
            np.testing.assert_allclose(w[i], want, rtol=1e-6)


def test_route_ties_pick_lower_index():
    attrs, t, x, lg = make_case(E=4, k=2)
    ids, w = route(np.array([[1.0, 3.0, 3.0, 3.0]], np.float32), _spec(attrs, t, x))
    assert ids.tolist() == [[1, 2]]


def test_route_router_weights_select_by_logits_mix_by_weights():
    attrs, t, x, lg = make_case(E=5, k=2, normalize=0)
    spec = _spec(attrs, t, x)
    z = np.array([[0.0, 5.0, 1.0, 4.0, -1.0]], np.float32)
    rw = np.array([[0.9, 0.2, 0.8, 0.3, 0.7]], np.float32)
    ids, w = route(z, spec, router_weights=rw)
    assert ids.tolist() == [[1, 3]]
    np.testing.assert_allclose(w, [[0.2, 0.3]], rtol=1e-6)


def _sparse_mixer_hf(scores, eps=0.01):
    """Independent transcription of Phi-3.5-MoE's sparsemixer (inference, top-2)."""
    out_w, out_i = [], []
    for row in scores.astype(np.float64):
        thr = row.max()
        i0 = int(np.argmax(row))
        factor = np.maximum(np.abs(row), thr)
        masked = np.where((thr - row) / factor > 2 * eps, -np.inf, row)
        g0 = np.exp(masked - masked.max())
        g0 /= g0.sum()
        row2 = row.copy()
        row2[i0] = -np.inf
        thr2 = row2.max()
        i1 = int(np.argmax(row2))
        factor2 = np.maximum(np.abs(row), thr2)
        masked2 = np.where((thr2 - row) / factor2 > 2 * eps, -np.inf, row2)
        g1 = np.exp(masked2 - masked2.max())
        g1 /= g1.sum()
        out_i.append([i0, i1])
        out_w.append([g0[i0], g1[i1]])
    return np.array(out_i), np.array(out_w)


def test_route_sparse_mixer_matches_independent_transcription():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((64, 16)).astype(np.float32) * 0.05  # close logits: the jitter mask matters
    z[:8] *= 40
    attrs, t, x, lg = make_case(E=16, k=2, sparse_mixer=True)
    spec = _spec(attrs, t, x)
    ids, w = route(z, spec)
    want_i, want_w = _sparse_mixer_hf(z)
    assert ids.tolist() == want_i.tolist()
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    assert np.any(w < 0.99)  # not trivially one-hot


def _interleave(t, I):
    """Convert a fusion-1 case (rows g0,u0,g1,u1...) into fusion 2 ([g | u]) and fusion 0 (FC1 gate, FC3 up)."""
    def rows(a, idx):
        return None if a is None else np.ascontiguousarray(a[:, idx])
    g, u = np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)
    cat = np.concatenate([g, u])
    t2 = dict(t)
    for n in ("fc1_experts_weights", "fc1_scales", "fc1_experts_bias"):
        t2[n] = rows(t.get(n), cat)
    t0 = dict(t)
    for n in ("weights", "scales", "bias"):
        src = f"fc1_experts_{n}" if n != "scales" else "fc1_scales"
        dst3 = f"fc3_experts_{n}" if n != "scales" else "fc3_scales"
        t0[src] = rows(t.get(src), g)
        t0[dst3] = rows(t.get(src), u)
    return t2, t0


@pytest.mark.parametrize("limit", [None, 0.3])
def test_swiglu_fusion_layouts_agree(limit):
    """fusion 0 (FC1 gate + FC3 up) and 2 ([g | u]) equal fusion 1 on the same rows (fusion 1 is ORT-checked)."""
    I = 48
    attrs, t, x, lg = make_case(seed=9, E=4, H=64, I=I, k=2, bits=4, block_size=16, activation="swiglu",
                                swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=limit, bias=True, T=6)
    ref1 = qmoe_reference(x, lg, _spec(attrs, t, x), t)
    t2, t0 = _interleave(t, I)
    ref2 = qmoe_reference(x, lg, _spec(dict(attrs, swiglu_fusion=2), t2, x), t2)
    ref0 = qmoe_reference(x, lg, _spec(dict(attrs, swiglu_fusion=0), t0, x), t0)
    np.testing.assert_allclose(ref2, ref1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref0, ref1, rtol=1e-6, atol=1e-6)


def test_gated_fc3_and_normalize0_by_hand():
    """silu with FC3 (act(FC1 x) * FC3 x) and normalize_routing_weights=0, computed by hand."""
    attrs, t, x, lg = make_case(seed=12, E=3, H=32, I=32, k=2, bits=8, activation="silu", fc3=True, bias=True,
                                normalize=0, T=4)
    spec = _spec(attrs, t, x)
    got = qmoe_reference(x, lg, spec, t)
    out = np.zeros((4, 32))
    for i in range(4):
        p = np.exp(lg[i] - lg[i].max())
        p /= p.sum()
        for e in np.argsort(-lg[i], kind="stable")[:2]:
            W = {f: dequantize(t[f"{f}_experts_weights"][e], t[f"{f}_scales"][e], None, 8, 0).astype(np.float64)
                 for f in ("fc1", "fc2", "fc3")}
            g = W["fc1"] @ x[i] + t["fc1_experts_bias"][e]
            u = W["fc3"] @ x[i] + t["fc3_experts_bias"][e]
            y = W["fc2"] @ (g / (1 + np.exp(-g)) * u) + t["fc2_experts_bias"][e]
            out[i] += p[e] * y
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-6)


def test_expert_ffn_shape():
    attrs, t, x, lg = make_case(seed=1, E=3, H=32, I=64, k=1)
    assert expert_ffn(x, 2, _spec(attrs, t, x), t).shape == x.shape
