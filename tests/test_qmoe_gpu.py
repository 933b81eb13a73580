"""kernels.gpu.GpuQMoE against kernels.reference.qmoe_reference (needs an NVIDIA GPU with CuPy; skipped otherwise).

Tolerances (max |got - ref| / max |ref|), fp32 activations:
* tensor-core decode (<= 8 tokens): 1e-4 (weights dequantise exactly, activations as bf16 hi + lo, fp32 accumulate);
* tensor-core prefill: 3e-3 (fp16 activations, per-block scales folded into fp16 weights, fp32 accumulate);
* fp32 FMA fallback: 1e-4.
fp16 input / output adds the final fp16 rounding: 4e-3 (decode, FMA) and 5e-3 (prefill); bf16 I/O 1.5e-2.

Layouts the kernels do not read as stored (int2 / int3, SM80 prepacked, mixed widths, nvfp4, mxfp4) are converted
exactly on upload (kernels.gpu.convert; CPU checks in tests/test_gpu_layout_conversion.py) and held to the same
tolerances against the reference on the stored layout (``test_gpu_converted_layouts`` and below).
"""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest

from engine.collection_hold import collection_held
from kernels.qmoe_spec import QMoESpec
from kernels.reference import expert_ffn, qmoe_reference, route as ref_route
from tests.qmoe_oracle import make_case, make_layout_case

pytestmark = pytest.mark.gpu

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
    "silu-fc3": dict(activation="silu", fc3=True),
}

TOL = {  # (path, phase, dtype) -> tolerance
    ("tc", "decode", np.float32): 1e-4, ("tc", "decode", np.float16): 4e-3,
    ("tc", "prefill", np.float32): 3e-3, ("tc", "prefill", np.float16): 5e-3,
    ("fma", "decode", np.float32): 1e-4, ("fma", "decode", np.float16): 4e-3,
    ("fma", "prefill", np.float32): 1e-4, ("fma", "prefill", np.float16): 4e-3,
}


@pytest.fixture(scope="module")
def gpu():
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE

    return cp, GpuQMoE


def _relerr(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _spec(attrs, t, x):
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)


def _shapes(rng, block):
    if block:
        return int(rng.choice(range(block, 3 * block + 1, block))), int(rng.choice(range(block, 3 * block + 1, block)))
    return int(rng.integers(16, 66)) * 2, int(rng.integers(16, 66)) * 2


def _ref_pairs(x, ids, w, spec, t, spans=None):
    """sum_j w[t, j] * FFN_{ids[t, j]}(x[t]) over the pairs with ids >= 0 (float64); with `spans` (int [E, 2]) each
    expert's intermediate rows [spans[e, 0], spans[e, 1]) only (expert_ffn's rows)."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        if e < 0:
            continue
        rows, cols = np.nonzero(ids == e)
        part = None if spans is None else tuple(int(v) for v in spans[e])
        np.add.at(out, rows, w[rows, cols, None].astype(np.float64) * expert_ffn(x[rows], int(e), spec, t, part))
    return out


def _grid_case(bits, block, zp, act, dtype):
    """(spec, tensors, x [100 tokens], router logits) of one GRID case: the same seeds and shapes for every test
    that runs the grid."""
    idx = GRID.index((bits, block, zp, act))
    seed = 5000 + idx * 2 + (dtype == np.float16)
    rng = np.random.default_rng(seed)
    H, I = _shapes(rng, block)
    attrs, t, x, lg = make_case(seed=seed, E=int(rng.integers(4, 10)), H=H, I=I, k=int(rng.integers(1, 4)),
                                bits=bits, block_size=block, zero_points=zp, bias=bool(idx % 2), dtype=dtype, T=100,
                                **ACTS[act])
    return _spec(attrs, t, x), t, x, lg


GRID = [(bits, block, zp, act) for bits in (4, 8) for block in (0, 32, 64) for zp in (False, True) for act in ACTS]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bits,block,zp,act", GRID, ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in GRID])
def test_gpu_matches_reference(gpu, bits, block, zp, act, dtype):
    cp, GpuQMoE = gpu
    spec, t, x, lg = _grid_case(bits, block, zp, act, dtype)
    H = spec.hidden_size
    for path in ("tc", "fma"):
        m = GpuQMoE(spec, t, path=path)
        for T, phase in ((1, "decode"), (3, "decode"), (100, "prefill")):
            ref = qmoe_reference(x[:T], lg[:T], spec, t)
            got = m.forward(x[:T], lg[:T])
            assert isinstance(got, np.ndarray) and got.dtype == x.dtype and got.shape == (T, H)
            err = _relerr(got, ref)
            assert err <= TOL[(path, phase, dtype)], f"{path} T={T}: rel err {err:.2e}"


@pytest.mark.parametrize("bits,block", [(4, 16), (4, 128), (8, 0), (8, 128)])
def test_gpu_launch_configs(gpu, bits, block):
    """Larger shapes: several k-tiles per warp, scale blocks spanning tiles, every decode / prefill variant."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=77 + bits + block, E=6, H=512, I=384, k=2, bits=bits, block_size=block,
                                zero_points=True, bias=True, T=70, activation="swiglu", swiglu_fusion=1,
                                alpha=1.702, beta=1.0, swiglu_limit=7.0)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    ref3 = qmoe_reference(x[:3], lg[:3], spec, t)
    for R in (1, 2):
        for W in (1, 2, 4, 8):
            for ks in (1, 3):
                m.dec_cfg = {"R1": R, "W1": W, "R2": R, "W2": W, "ksplit2": ks}
                err = _relerr(m.forward(x[:3], lg[:3]), ref3)
                assert err <= 1e-4, f"R={R} W={W} ksplit={ks}: {err:.2e}"
    m.dec_cfg["ksplit2"] = 0
    err = _relerr(m.forward(x[:8], lg[:8]), qmoe_reference(x[:8], lg[:8], spec, t))
    assert err <= 1e-4, f"8 tokens: {err:.2e}"
    ref = qmoe_reference(x, lg, spec, t)
    for bm in (32, 48, 64, 128):
        m.prefill_bm = bm
        err = _relerr(m.forward(x, lg), ref)
        assert err <= 3e-3, f"BM={bm}: {err:.2e}"


def test_gpu_routing_matches_reference(gpu):
    cp, GpuQMoE = gpu
    rng = np.random.default_rng(3)
    for k, normalize, E in ((1, 0, 12), (2, 1, 12), (4, 0, 40), (8, 1, 128), (3, 1, 300)):
        attrs, t, x, _ = make_case(E=E, k=k, normalize=normalize, H=32, I=32)
        spec = _spec(attrs, t, x)
        m = GpuQMoE(spec, t)
        z = rng.standard_normal((50, E)).astype(np.float32)
        z[0, :] = 1.0  # all tied
        z[1, :E // 2] = 2.0  # ties among the best
        for rw in (None, rng.uniform(0.0, 1.0, size=z.shape).astype(np.float32)):
            ids, w = m.route(z, router_weights=rw)
            ids_r, w_r = ref_route(z, spec, router_weights=rw)
            assert cp.asnumpy(ids).tolist() == ids_r.tolist()
            np.testing.assert_allclose(cp.asnumpy(w), w_r, rtol=2e-6, atol=1e-7)


def _grouped_pairs(cp, m, T):
    """The (token, expert) -> weight pairs the last forward's preparation (decode_prep or prefill_prep) left in the
    workspace (tiles, pair_tok, pair_w)."""
    ws = m._ws
    tiles = cp.asnumpy(ws.tiles).reshape(-1, 4)[:int(cp.asnumpy(ws.num_tiles)[0])]
    pair_tok, pair_w = cp.asnumpy(ws.pair_tok), cp.asnumpy(ws.pair_w)
    got = [dict() for _ in range(T)]
    for _slot, first, count, e in tiles:
        for p in range(first, first + count):
            got[pair_tok[p]][int(e)] = float(pair_w[p])
    return got


# (T, E, k): decode_prep routes by ranks where T * E <= 4096 (dec_cfg rank_route), else one warp per token
PREP_CASES = [(1, 32, 4), (1, 128, 8), (3, 60, 4), (8, 128, 8), (4, 1024, 8), (1, 1024, 16), (8, 8, 8), (2, 7, 3),
              (8, 600, 4)]


@pytest.mark.parametrize("T,E,k", PREP_CASES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in PREP_CASES])
def test_gpu_decode_prep_routing(gpu, T, E, k):
    """decode_prep's routing and grouping, read back from the tables FC1 / FC2 take, against the reference for
    random, tied and special logits (-0, -inf, NaN with router weights), both routing paths (ranks by the whole
    block, and one warp per token), normalized or not, with and without router weights."""
    cp, GpuQMoE = gpu
    rng = np.random.default_rng(T * 7919 + E * 31 + k)
    for normalize in (0, 1):
        attrs, t, x, _ = make_case(seed=E + k, E=E, k=k, normalize=normalize, H=32, I=32, T=T)
        spec = _spec(attrs, t, x)
        m = GpuQMoE(spec, t, path="tc")
        for trial in range(4):
            z = rng.standard_normal((T, E)).astype(np.float32)
            if trial == 1:
                z = np.round(z * 2.0) / 2.0  # many ties
            if trial >= 2:
                z[:, ::3] = 0.5
                z[0, :] = -0.0
                z[-1, 1::4] = 0.0
                z[-1, ::5] = -np.inf
            rw = rng.uniform(0.1, 1.0, size=z.shape).astype(np.float32) if trial % 2 else None
            if trial == 3:
                z[0, 1::7] = np.nan  # ranked after every number; weights from the router weights
                rw = rng.uniform(0.1, 1.0, size=z.shape).astype(np.float32)
            ids_r, w_r = ref_route(z, spec, router_weights=rw)
            for rank_route in ((1, 0) if trial < 3 else (1,)):  # the warp path orders NaN by its own rule
                m.dec_cfg["rank_route"] = rank_route
                m.forward(x[:T], z, router_weights=rw)
                got = _grouped_pairs(cp, m, T)
                for tok in range(T):
                    want = dict(zip(ids_r[tok].tolist(), w_r[tok].tolist()))
                    assert sorted(got[tok]) == sorted(want), f"rank_route {rank_route} trial {trial} token {tok}"
                    np.testing.assert_allclose([got[tok][e] for e in sorted(want)], [want[e] for e in sorted(want)],
                                               rtol=2e-6, atol=1e-7)


def test_gpu_prefill_prep_with_many_routing_blocks(gpu):
    """prefill_prep at 1,000 tokens (63 routing blocks of 16 tokens; 64 experts, top-8): three routings in a row
    group exactly the reference's pairs into tiles of at most BM, the output matches the reference, and the
    per-expert counts and the blocks' ticket are left zero; with the pairs given and 24 experts not in a slot, only
    the resident experts' pairs are grouped, and the output is theirs."""
    cp, GpuQMoE = gpu
    T, E, k = 1000, 64, 8
    attrs, t, x, _ = make_case(seed=77, E=E, k=k, normalize=1, H=64, I=64, bits=4, block_size=32, T=T,
                               activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, path="tc")
    tol = TOL[("tc", "prefill", np.float32)]
    rng = np.random.default_rng(78)

    def check_tables(want_pairs):
        got = _grouped_pairs(cp, m, T)
        for tok in range(T):
            assert sorted(got[tok]) == sorted(want_pairs[tok]), f"token {tok}"
            np.testing.assert_allclose([got[tok][e] for e in sorted(want_pairs[tok])],
                                       [want_pairs[tok][e] for e in sorted(want_pairs[tok])], rtol=2e-6, atol=1e-7)
        tiles = cp.asnumpy(m._ws.tiles).reshape(-1, 4)[:int(cp.asnumpy(m._ws.num_tiles)[0])]
        assert tiles[:, 2].min() >= 1 and tiles[:, 2].max() <= m.prefill_bm
        assert not cp.asnumpy(m._ws.counts).any() and int(cp.asnumpy(m._ws.ticket)[0]) == 0

    m.prefill_bm = 48
    for trial in range(3):
        z = rng.standard_normal((T, E)).astype(np.float32)
        if trial == 1:
            z = np.round(z * 2.0) / 2.0  # many ties
        out = m.forward(x, z)
        assert _relerr(out, qmoe_reference(x, z, spec, t)) <= tol, f"trial {trial}"
        ids_r, w_r = ref_route(z, spec)
        check_tables([dict(zip(ids_r[tok].tolist(), w_r[tok].tolist())) for tok in range(T)])
    resident = rng.permutation(E)[:40]
    m = GpuQMoE(spec, t, path="tc", num_slots=40, resident=resident)
    m.prefill_bm = 32
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    ids[::7, -1] = -1
    w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    kept = np.where(np.isin(ids, resident), ids, -1)
    got = m.run_experts(x, ids, w)
    assert _relerr(got, _ref_pairs(x, kept, w, spec, t)) <= tol
    check_tables([{int(e): float(wj) for e, wj in zip(kept[tok], w[tok]) if e >= 0} for tok in range(T)])


@pytest.mark.parametrize("normalize", [0, 1])
def test_gpu_router_weights(gpu, normalize):
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=7, E=8, H=64, I=96, k=3, bits=4, block_size=32, normalize=normalize, T=37,
                                activation="swiglu", swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, beta=1.0)
    rw = np.random.default_rng(8).uniform(0.0, 1.0, size=lg.shape).astype(np.float32)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    for T, tol in ((2, 1e-4), (37, 3e-3)):
        ref = qmoe_reference(x[:T], lg[:T], spec, t, router_weights=rw[:T])
        assert _relerr(m.forward(x[:T], lg[:T], router_weights=rw[:T]), ref) <= tol


@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_sparse_mixer(gpu, bits):
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=9, E=16, H=64, I=64, k=2, bits=bits, sparse_mixer=True, normalize=0, T=37,
                                activation="silu", bias=True)
    lg = (lg * 0.05).astype(np.float32)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    for T, tol in ((3, 1e-4), (37, 3e-3)):
        assert _relerr(m.forward(x[:T], lg[:T]), qmoe_reference(x[:T], lg[:T], spec, t)) <= tol


@pytest.mark.parametrize("T", [2, 40])
def test_gpu_run_experts_subsets(gpu, T):
    """Two run_experts calls over disjoint subsets of the pairs into one accumulator == the whole node."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=11, E=8, H=96, I=64, k=3, bits=4, block_size=32, zero_points=True, bias=True,
                                T=T, activation="swiglu", swiglu_fusion=2, alpha=1.0, beta=0.0)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    tol = 1e-4 if T <= 8 else 3e-3
    ids, w = ref_route(lg, spec)
    first = ids % 2 == 0
    ids_a = np.where(first, ids, -1).astype(np.int32)
    ids_b = np.where(first, -1, ids).astype(np.int32)
    acc = cp.zeros((T, spec.hidden_size), cp.float32)
    m.run_experts(cp.asarray(x), ids_a, w, out=acc)
    m.run_experts(x, cp.asarray(ids_b), cp.asarray(w), out=acc)
    ref = qmoe_reference(x, lg, spec, t)
    assert _relerr(cp.asnumpy(acc), ref) <= tol
    part = m.run_experts(x, ids_a, w)  # NumPy in, NumPy out
    assert isinstance(part, np.ndarray) and part.dtype == x.dtype
    assert _relerr(part, _ref_pairs(x, ids_a, w, spec, t)) <= tol


@pytest.mark.parametrize("T", [1, 30])
def test_gpu_slot_upload(gpu, T):
    """Experts uploaded into slots from host-converted copies on a side stream; non-resident experts skipped."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=13, E=8, H=128, I=64, k=2, bits=8, block_size=64, zero_points=True, bias=True,
                                T=T, activation="gelu")
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=3, resident=[])
    assert m.resident_experts().size == 0
    tol = 1e-4 if T <= 8 else 3e-3
    rng = np.random.default_rng(14)
    ids = rng.integers(0, 8, size=(T, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 7, size=T)) % 8
    w = rng.uniform(0.1, 1.0, size=(T, 2)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    m.upload_expert(5, 0, stream=stream)
    m.upload_expert(2, 1, stream=stream, packed=m.pack_expert(2))
    stream.synchronize()
    mask = np.isin(ids, [5, 2])
    got = m.run_experts(x, ids, w)  # experts not in a slot are skipped
    assert _relerr(got, _ref_pairs(x, np.where(mask, ids, -1), w, spec, t)) <= tol
    m.upload_expert(1, 0, stream=stream)  # evicts expert 5
    stream.synchronize()
    assert m.slot_of[5] == -1 and m.slot_of[1] == 0
    mask = np.isin(ids, [1, 2])
    got = m.run_experts(x, ids, w)
    assert _relerr(got, _ref_pairs(x, np.where(mask, ids, -1), w, spec, t)) <= tol
    full = GpuQMoE(spec, t)  # all resident, initial device-side conversion: same numbers
    assert _relerr(m.run_experts(x, np.where(mask, ids, -1), w), full.run_experts(x, np.where(mask, ids, -1), w)) \
        <= 1e-6


@pytest.mark.parametrize("path,T", [("tc", 1), ("tc", 5), ("tc", 40), ("fma", 5)])
def test_gpu_host_tier_reads_experts_in_no_slot_from_host_memory(gpu, path, T):
    """host_tier=True: every expert also in page-locked host memory (kernels/gpu/host_tier.py), read from there over
    PCIe where it is in no GPU slot, so every routed pair is computed as with every expert resident. Uploads (host
    packed, and packed on the GPU by pack_expert) and evictions point the device's map at the slot or back at the
    expert's host row."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=21, E=8, H=128, I=64, k=2, bits=4, block_size=32, bias=True, T=T,
                                **ACTS["swiglu1-limit"])
    spec = _spec(attrs, t, x)
    # every token routes to expert 6 (resident at first) and, with nearly its weight, to one of 0, 2, 3, 4, 5, 7 (not):
    # skipping the cold pairs would lose about half of every output
    lg = lg.copy()
    lg[:, 6] = lg.max(axis=1) + 10.0
    lg[np.arange(T), np.random.default_rng(22).choice([0, 2, 3, 4, 5, 7], size=T)] = lg[:, 6] - 0.5
    lg[:, 1] -= 10.0
    m = GpuQMoE(spec, t, num_slots=3, resident=[1, 6], path=path, host_tier=True)
    h = m.host0
    assert h >= 3 and list(m.resident_experts()) == [1, 6]
    assert cp.asnumpy(m._slot_dev).tolist() == [h, 0, h + 2, h + 3, h + 4, h + 5, 1, h + 7]
    tol = TOL[(path, "decode" if T <= 8 else "prefill", np.float32)]
    ref = qmoe_reference(x, lg, spec, t)
    assert _relerr(m.forward(x, lg), ref) <= tol
    ids, _ = ref_route(lg, spec)
    assert (ids == 6).sum(axis=1).tolist() == [1] * T and not (ids == 1).any()
    plain = GpuQMoE(spec, t, num_slots=3, resident=[1, 6], path=path)  # no tier: their pairs are skipped
    assert _relerr(plain.forward(x, lg), ref) > 10 * tol
    stream = cp.cuda.Stream(non_blocking=True)
    m.upload_expert(5, 0, stream=stream)  # evicts expert 1: back to its host row
    m.upload_expert_device(3, 2, stream=stream)
    m.upload_expert_device(7, 1, stream=stream)  # evicts expert 6 through pack_expert
    stream.synchronize()
    assert m.slot_of.tolist() == [-1, -1, -1, 2, -1, 0, -1, 1]
    assert cp.asnumpy(m._slot_dev).tolist() == [h, h + 1, h + 2, 2, h + 4, 0, h + 6, 1]
    assert _relerr(m.forward(x, lg), ref) <= tol
    m.evict(2)
    assert cp.asnumpy(m._slot_dev)[3] == h + 3
    assert _relerr(m.forward(x, lg), ref) <= tol


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_gpu_route_split_shares_cold_pairs_with_the_host(gpu, T, dtype):
    """run_routed_split (the "both" decode path): route_split routes on the device, leaves every routed id, the CPU's
    pairs (kernels.cold_split.split_cold_pairs: the last cpu_take[c] of a token's c cold pairs), the weights and x's
    bytes in page-locked host memory and raises the flag; the decode kernels compute the other pairs, resident or
    read from the host tier. The device's part plus the CPU's pairs is the whole layer, over graph replays with new
    routing and a table changed between launches: eager, captured, then twice straight to the graph (the same
    arrays and configuration), and once more eagerly after the decode configuration changed."""
    cp, GpuQMoE = gpu
    from kernels.cold_split import split_cold_pairs
    from kernels.gpu.published import PublishedRouting

    attrs, t, x, lg = make_case(seed=41, E=16, H=128, I=64, k=4, bits=4, block_size=32, T=T, dtype=dtype,
                                **ACTS["swiglu1-limit"])
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=5, resident=[0, 3, 6, 9], host_tier=True)
    published = PublishedRouting(cp, T, spec.k, spec.hidden_size, x.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    tables = [np.array([0, 1, 1, 2, 3]), np.array([0, 0, 0, 0, 0]), np.array([0, 1, 2, 3, 4]),
              np.array([0, 1, 1, 2, 3]), np.array([0, 1, 2, 2, 2])]
    rng = np.random.default_rng(42)
    tol = TOL[("tc", "decode", np.dtype(dtype).type)]
    shares = []
    with stream:
        x_dev = cp.asarray(x)
        lg_dev = cp.empty(lg.shape, lg.dtype)
        out32 = cp.empty((T, spec.hidden_size), cp.float32)
        for step, table in enumerate(tables):
            logits = (lg + rng.normal(0, 2.0, lg.shape)).astype(lg.dtype)
            lg_dev.set(logits, stream=stream)
            published.set_cpu_take(table, stream)
            if step == 4:
                m.dec_cfg["rank_route"] = 0  # changed in place: the graph made before must not replay
            m.run_routed_split(x_dev, lg_dev, out32, published)
            assert m.split_fast_calls == min(max(0, step - 1), 2)
            published.wait(stream)
            assert int(published.flag[0]) == step + 1
            ids, w = ref_route(logits, spec)
            assert published.ids.tolist() == ids.tolist()
            assert np.allclose(published.w, w, rtol=1e-5, atol=1e-7)
            assert published.x.tobytes() == x.tobytes()
            on_cpu = split_cold_pairs(m.slot_of[ids] < 0, table)
            assert published.on_cpu.astype(bool).tolist() == on_cpu.tolist()
            if step == 2:  # every cold pair on the CPU
                assert on_cpu.tolist() == (m.slot_of[ids] < 0).tolist()
            gpu_part = cp.asnumpy(out32)  # waits for the decode kernels
            cpu_part = _ref_pairs(x, np.where(on_cpu, ids, -1), published.w, spec, t)
            whole = _ref_pairs(x, ids, w, spec, t)
            # had the device computed the CPU's pairs too, they would count twice here
            assert _relerr(gpu_part + cpu_part, whole) <= tol
            shares.append(float(np.abs(cpu_part).max() / np.abs(whole).max()))
    assert max(shares) > 10 * tol  # the CPU's pairs weighed enough for that to show


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layout", ["int4-b32-swiglu1-bias", "int8-row-silu", "int4-b16-zp-gelu"])
def test_gpu_route_split_splits_a_pair_by_rows_with_the_host(gpu, layout, dtype):
    """run_routed_split with the tables' split_rows (kernels/cold_split.py: split_cold_rows): at one token the GPU's
    last cold pair is published coded by the CPU's first row r + 1 and moved to the decode kernels' last tile, whose
    FC1 computes its rows [0, r) and FC2 reads their k-tiles only. The device's part is the reference's for its pairs
    and those rows (FC2's bias counted there), and with the CPU's part (its pairs, the split pair's rows from r on)
    the whole layer; over graph replays with the tables changed between launches, a table with no split and one
    splitting every count, and after the decode configuration changed."""
    cp, GpuQMoE = gpu
    from kernels.cold_split import cpu_spans, device_spans, split_cold_rows
    from kernels.gpu.published import PublishedRouting

    bits, block, extra, act = {"int4-b32-swiglu1-bias": (4, 32, dict(bias=True), "swiglu1-limit"),
                               "int8-row-silu": (8, 0, {}, "silu"),
                               "int4-b16-zp-gelu": (4, 16, dict(zero_points=True), "gelu")}[layout]
    attrs, t, x, lg = make_case(seed=43, E=16, H=128, I=192, k=4, bits=bits, block_size=block, T=1, dtype=dtype,
                                **extra, **ACTS[act])
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=5, resident=[0, 3, 6, 9], host_tier=True)
    assert m.splits_rows
    published = PublishedRouting(cp, 1, spec.k, spec.hidden_size, x.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    takes = [np.array([0, 0, 1, 1, 2]), np.array([0, 0, 1, 1, 2]), np.array([0, 0, 0, 1, 1]),
             np.array([0, 0, 1, 1, 2]), np.array([0, 0, 1, 1, 2])]
    rows = [np.array([0, 64, 128, 64, 128]), np.array([0, 128, 64, 128, 64]), np.array([0, 0, 0, 0, 0]),
            np.array([0, 64, 64, 64, 64]), np.array([0, 128, 128, 128, 128])]
    rng = np.random.default_rng(44)
    tol = TOL[("tc", "decode", np.dtype(dtype).type)]
    split_steps = 0
    with stream:
        x_dev = cp.asarray(x)
        lg_dev = cp.empty(lg.shape, lg.dtype)
        out32 = cp.empty((1, spec.hidden_size), cp.float32)
        for step, (take, split_rows) in enumerate(zip(takes, rows)):
            logits = (lg + rng.normal(0, 2.0, lg.shape)).astype(lg.dtype)
            lg_dev.set(logits, stream=stream)
            published.set_cpu_take(take, stream, split_rows)
            if step == 4:
                m.dec_cfg["rank_route"] = 0  # changed in place: the graph made before must not replay
            m.run_routed_split(x_dev, lg_dev, out32, published)
            published.wait(stream)
            ids, w = ref_route(logits, spec)
            codes = split_cold_rows(m.slot_of[ids] < 0, take, split_rows)
            assert published.ids.tolist() == ids.tolist()
            assert published.on_cpu.tolist() == codes.tolist()
            split_steps += bool((codes > 1).any())
            assert int(cp.asnumpy(published.cut)[0]) == (int(codes.max()) - 1 if (codes > 1).any() else 0)
            gpu_part = cp.asnumpy(out32)
            device = _ref_pairs(x, np.where(codes == 1, -1, ids), w, spec, t,
                                device_spans(ids, codes, spec.num_experts, spec.inter_size))
            cpu_part = _ref_pairs(x, np.where(codes != 0, ids, -1), w, spec, t,
                                  cpu_spans(ids, codes, spec.num_experts, spec.inter_size))
            assert _relerr(gpu_part, device) <= tol
            assert _relerr(gpu_part + cpu_part, _ref_pairs(x, ids, w, spec, t)) <= tol
    assert split_steps >= 3  # (the routing's cold pairs: most steps have one on the GPU to split)


@pytest.fixture
def no_collection_while_gated():
    """Earlier tests' garbage collected first, and no collection during the test, as a decoder step holds it off
    (engine/collection_hold.py): a finalizer that synchronizes the device (a CUDA graph's, pinned memory's, left in a
    reference cycle by an earlier test) run by a collection between a gated merge's launch and its gate waits for the
    merge, which gives up, and the gate checks below fail on the earlier test's account."""
    gc.collect()
    with collection_held():
        yield


def _give_the_cpus_part(m, published, logits, x, spec, t, table, stream) -> np.ndarray:
    """What the engine's host does once a split launch's routing is published: the CPU's pairs (the reference's)
    written into the published part, the gate raised; waits for the stream and returns the whole layer's reference."""
    from kernels.cold_split import split_cold_pairs

    ids, w = ref_route(logits, spec)
    on_cpu = split_cold_pairs(m.slot_of[ids] < 0, table)
    published.part[:] = _ref_pairs(x, np.where(on_cpu, ids, -1), published.w, spec, t)
    published.open_gate()
    stream.synchronize()
    return _ref_pairs(x, ids, w, spec, t)


@pytest.mark.parametrize("out_dtype", [np.float16, np.float32])
@pytest.mark.usefixtures("no_collection_while_gated")
def test_gpu_merge_gated_waits_for_the_hosts_part(gpu, out_dtype):
    """merge_gated, queued behind run_routed_split before the host has the CPU's part: it waits on the device for the
    host to write that part and raise the gate, then the sum is the whole layer (over the split's graph replays: each
    merge waits for its own launch's number). A gate left down: after the timeout the GPU's part alone (the host's
    stale part left out), and the launch's number in gate_failed(). The kernels' clock readings (gpu_times) follow
    the launch's order, and the merge's wait for the gate is the host's time to give its part (milliseconds here)."""
    cp, GpuQMoE = gpu
    from kernels.gpu.published import PublishedRouting

    T = 3
    attrs, t, x, lg = make_case(seed=43, E=16, H=128, I=64, k=4, bits=4, block_size=32, T=T, dtype=np.float16,
                                **ACTS["swiglu1-limit"])
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=5, resident=[0, 3, 6, 9], host_tier=True)
    published = PublishedRouting(cp, T, spec.k, spec.hidden_size, x.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    table = np.array([0, 1, 1, 2, 3])
    rng = np.random.default_rng(44)
    tol = TOL[("tc", "decode", np.float16)]
    with stream:
        x_dev = cp.asarray(x)
        lg_dev = cp.empty(lg.shape, lg.dtype)
        out32 = cp.empty((T, spec.hidden_size), cp.float32)
        out = cp.empty((T, spec.hidden_size), out_dtype)
        published.set_cpu_take(table, stream)
        last_gate_seen = 0
        for step in range(4):
            logits = (lg + rng.normal(0, 2.0, lg.shape)).astype(lg.dtype)
            lg_dev.set(logits, stream=stream)
            m.run_routed_split(x_dev, lg_dev, out32, published)
            m.merge_gated(published, out32, out)  # queued before the CPU's part exists
            published.wait(stream)
            whole = _give_the_cpus_part(m, published, logits, x, spec, t, table, stream)
            assert _relerr(cp.asnumpy(out).astype(np.float32), whole) <= tol + (1e-3 if out_dtype == np.float16 else 0)
            route_started, routing_published, merge_waited, gate_seen = published.gpu_times()
            assert last_gate_seen < route_started <= routing_published <= merge_waited < gate_seen
            assert gate_seen - merge_waited > 100_000  # ns: the host's reference part took that long at least
            last_gate_seen = gate_seen
        assert published.gate_failed() == 0
        lg_dev.set(lg, stream=stream)
        m.run_routed_split(x_dev, lg_dev, out32, published)
        m.merge_gated(published, out32, out, timeout_s=0.001)  # the gate stays down
        stream.synchronize()
        assert published.gate_failed() == published.launched
        assert np.allclose(cp.asnumpy(out).astype(np.float32), cp.asnumpy(out32), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("fast_split", [True, False])
@pytest.mark.usefixtures("no_collection_while_gated")
def test_gpu_route_split_records_its_stop_and_queues_the_gated_merge_in_its_graph(gpu, fast_split):
    """run_routed_split with `stop` and `merged` (the engine's "both" launch): the stop event is recorded once the
    GPU's part is done, before the merge, which waits for the host's gate (a host that synchronised `stop` would
    otherwise wait for itself), and the merged sum is the whole layer: eagerly, in the captured graph (the record as
    its node, recorded at every replay) and from the third call straight through the graph; with fast_split off,
    the record and the merge after the graph, every call through the checks. The start-to-stop time is the
    launch's, not the wait for the gate."""
    cp, GpuQMoE = gpu
    from kernels.gpu.driver_calls import DriverCalls
    from kernels.gpu.published import PublishedRouting

    T = 1
    attrs, t, x, lg = make_case(seed=45, E=16, H=128, I=64, k=4, bits=4, block_size=32, T=T, dtype=np.float16,
                                **ACTS["swiglu1-limit"])
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=5, resident=[0, 3, 6, 9], host_tier=True)
    m.fast_split = fast_split
    published = PublishedRouting(cp, T, spec.k, spec.hidden_size, x.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    table = np.array([0, 1, 1, 2, 3])
    rng = np.random.default_rng(46)
    tol = TOL[("tc", "decode", np.float16)] + 1e-3
    with stream:
        x_dev = cp.asarray(x)
        lg_dev = cp.empty(lg.shape, lg.dtype)
        out32 = cp.empty((T, spec.hidden_size), cp.float32)
        merged = cp.empty((T, spec.hidden_size), cp.float16)
        published.set_cpu_take(table, stream)
        for step in range(4):
            logits = (lg + rng.normal(0, 2.0, lg.shape)).astype(lg.dtype)
            lg_dev.set(logits, stream=stream)
            start.record(stream)
            m.run_routed_split(x_dev, lg_dev, out32, published, stop=stop, merged=merged, timeout_s=5.0)
            published.wait(stream)
            waited = time.perf_counter()
            while not stop.done:  # the GPU's part ends while the merge behind it waits for the gate
                assert time.perf_counter() - waited < 2.0, f"step {step}: stop not recorded before the gated merge"
            launch_ms = cp.cuda.get_elapsed_time(start, stop)
            assert 0.0 < launch_ms < 1000.0
            whole = _give_the_cpus_part(m, published, logits, x, spec, t, table, stream)
            assert _relerr(cp.asnumpy(merged).astype(np.float32), whole) <= tol, f"step {step}"
        assert published.gate_failed() == 0
    assert m.split_fast_calls == (2 if fast_split and DriverCalls.from_driver().records_in_graphs else 0)


def test_gpu_cupy_io_and_3d(gpu):
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=4, E=6, H=64, I=64, k=2, bits=4, block_size=32, dtype=np.float16, T=12,
                                activation="swiglu", swiglu_fusion=1)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    x3, lg3 = x.reshape(2, 6, 64), lg.reshape(2, 6, 6)
    got = m.forward(cp.asarray(x3), cp.asarray(lg3))
    assert isinstance(got, cp.ndarray) and got.dtype == cp.float16 and got.shape == (2, 6, 64)
    assert _relerr(cp.asnumpy(got).reshape(12, 64), qmoe_reference(x, lg, spec, t)) <= 5e-3


def test_gpu_bf16(gpu):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=21, E=8, H=96, I=64, k=2, bits=4, block_size=32, T=40, activation="swiglu",
                                swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0, bias=True)
    bf16 = ml_dtypes.bfloat16
    t = dict(t, fc1_scales=t["fc1_scales"].astype(bf16), fc2_scales=t["fc2_scales"].astype(bf16))
    xb, lb = x.astype(bf16), lg.astype(bf16)
    spec = _spec(attrs, t, xb)
    m = GpuQMoE(spec, t)
    for T in (2, 40):
        got = m.forward(xb[:T], lb[:T])
        assert got.dtype == bf16
        assert _relerr(got.astype(np.float32), qmoe_reference(xb[:T], lb[:T], spec, t).astype(np.float32)) <= 1.5e-2


@pytest.mark.parametrize("kernel,cfg", [("v4", {}), ("v5", {}), ("v5", {"grid": 2}), ("v5", {"pdl": 1})],
                         ids=["v4", "v5", "v5-grid2", "v5-pdl"])
def test_gpu_forward_into_graph(gpu, kernel, cfg):
    """forward_into is capturable in a CUDA graph; replays with new routing give the forward() numbers (v5: its
    FC1 scratch is reused by every replay)."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=31, E=16, H=128, I=128, k=4, bits=4, block_size=32, T=8, activation="swiglu",
                                swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0, bias=True)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    m.decode_kernel = kernel
    if kernel == "v5":
        _v5(m, **cfg)
    xd = cp.asarray(x[:1])
    lgd = cp.asarray(lg[:1])
    out = cp.empty((1, spec.hidden_size), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        m.forward_into(xd, lgd, out)  # warm-up: allocates the workspaces
        stream.synchronize()
        stream.begin_capture()
        m.forward_into(xd, lgd, out)
        graph = stream.end_capture()
        for i in range(8):
            lgd[...] = cp.asarray(lg[i:i + 1])
            graph.launch(stream)
            stream.synchronize()
            assert _relerr(cp.asnumpy(out), qmoe_reference(x[:1], lg[i:i + 1], spec, t)) <= 1e-4


# ----------------------------------------------------------------------------- layouts converted on upload
CONVERTED = {  # stored layout -> make_layout_case arguments; GpuQMoE converts them (kernels.gpu.convert)
    "int2-row": dict(bits=2),
    "int2-block32-zp": dict(bits=2, block_size=32, zero_points=True),
    "int3-block32-zp": dict(bits=3, block_size=32, zero_points=True),
    "int3-row-ragged-zp": dict(bits=3, zero_points=True, H=120, I=56),
    "int3-block64": dict(bits=3, block_size=64, I=128),
    "int4-sm80-block64": dict(bits=4, block_size=64, packing="sm80"),
    "int4-sm80-row-zp": dict(bits=4, packing="sm80", zero_points=True),
    "int8-sm80-block32-zp": dict(bits=8, block_size=32, packing="sm80", zero_points=True, I=128),
    "mixed-4-8-block32-zp": dict(bits=4, fc2_bits=8, block_size=32, zero_points=True),
    "mixed-8-2-row": dict(bits=8, fc2_bits=2),
    "nvfp4-kpacked": dict(quant_type="nvfp4", packing="k_packed"),
    "nvfp4-kpacked-pow2": dict(quant_type="nvfp4", packing="k_packed", global_pow2=True),
    "nvfp4-npacked": dict(quant_type="nvfp4", packing="n_packed"),
    "mxfp4": dict(quant_type="fp4"),
}
CONV_ACTS = ("swiglu1-limit", "gelu", "swiglu2", "silu-fc3", "swiglu0", "relu")
CONV_GRID = [(lay, act) for i, lay in enumerate(CONVERTED) for act in (CONV_ACTS[i % 6], CONV_ACTS[(i + 3) % 6])]
CONV_GRID = [(lay, act) if not (CONVERTED[lay].get("quant_type") and ACTS[act].get("fc3", act == "swiglu0"))
             else (lay, "identity") for lay, act in CONV_GRID]  # nvfp4 / mxfp4 have no FC3 (no fc3 global scale)


def _layout_case(layout, act, seed, dtype=np.float32, T=100, E=None, k=None):
    rng = np.random.default_rng(seed)
    kw = {"H": 128, "I": 64, **CONVERTED[layout], **ACTS[act]}
    return make_layout_case(seed=seed, E=E or int(rng.integers(4, 10)), k=k or int(rng.integers(1, 4)),
                            bias=bool(seed % 2), dtype=dtype, T=T, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout,act", CONV_GRID, ids=[f"{a}-{b}" for a, b in CONV_GRID])
def test_gpu_converted_layouts(gpu, layout, act, dtype):
    """Every newly accepted layout, both paths, decode and prefill, against the reference on the stored layout."""
    cp, GpuQMoE = gpu
    seed = 9000 + CONV_GRID.index((layout, act)) * 2 + (dtype == np.float16)
    attrs, t, x, lg = _layout_case(layout, act, seed, dtype)
    spec = _spec(attrs, t, x)
    for path in ("tc", "fma"):
        m = GpuQMoE(spec, t, path=path)
        assert m.conversion.converted and m.source_spec is spec and m.spec.packing == "raw"
        for T, phase in ((1, "decode"), (3, "decode"), (100, "prefill")):
            ref = qmoe_reference(x[:T], lg[:T], spec, t)
            got = m.forward(x[:T], lg[:T])
            assert isinstance(got, np.ndarray) and got.dtype == x.dtype and got.shape == (T, spec.hidden_size)
            err = _relerr(got, ref)
            assert err <= TOL[(path, phase, dtype)], f"{path} T={T}: rel err {err:.2e}"


@pytest.mark.parametrize("layout", ["int2-block32-zp", "int4-sm80-block64", "mixed-4-8-block32-zp", "nvfp4-npacked",
                                    "mxfp4"])
@pytest.mark.parametrize("T", [2, 30])
def test_gpu_converted_slot_upload(gpu, layout, T):
    """The offload engine's path for converted layouts: pack_expert (host conversion) + upload_expert into slots on a
    side stream, non-resident experts skipped; expert_bytes is the converted size (gpu_expert_bytes, no CuPy)."""
    from kernels.gpu.convert import gpu_expert_bytes

    cp, GpuQMoE = gpu
    attrs, t, x, lg = _layout_case(layout, "swiglu1-limit", seed=17, T=T, E=8, k=2)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, num_slots=3, resident=[])
    assert m.expert_bytes() == gpu_expert_bytes(spec, t)
    assert m.expert_device_bytes() == gpu_expert_bytes(spec, t, resident=True)
    tol = 1e-4 if T <= 8 else 3e-3
    rng = np.random.default_rng(18)
    ids = rng.integers(0, 8, size=(T, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 7, size=T)) % 8
    w = rng.uniform(0.1, 1.0, size=(T, 2)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    m.upload_expert(5, 0, stream=stream)
    m.upload_expert(2, 1, stream=stream, packed=m.pack_expert(2))
    stream.synchronize()
    mask = np.isin(ids, [5, 2])
    got = m.run_experts(x, ids, w)
    assert _relerr(got, _ref_pairs(x, np.where(mask, ids, -1), w, spec, t)) <= tol
    full = GpuQMoE(spec, t)  # all resident: the initial upload converts in chunks, same numbers
    sub = np.where(mask, ids, -1)
    assert _relerr(m.run_experts(x, sub, w), full.run_experts(x, sub, w)) <= 1e-6


def test_gpu_converted_bf16(gpu):
    """nvfp4 with bf16 activations: the converted fp32 block scales with bf16 I/O."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    cp, GpuQMoE = gpu
    attrs, t, x, lg = _layout_case("nvfp4-kpacked", "swiglu1-limit", seed=23, dtype=bf16, T=40, E=8, k=2)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t)
    for T in (2, 40):
        got = m.forward(x[:T], lg[:T])
        assert got.dtype == x.dtype
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        assert _relerr(got.astype(np.float32), ref.astype(np.float32)) <= 1.5e-2


def test_gpu_refuses_fp8(gpu):
    from kernels.qmoe_spec import UnsupportedLayout

    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_layout_case(seed=0, quant_type="fp8", block_size=32, H=128, I=64)
    with pytest.raises(UnsupportedLayout, match="no exact conversion"):
        GpuQMoE(_spec(attrs, t, x), t)


# ----------------------------------------------------------------------------- decode v5 (dec5 kernels, decode5.cu)
# GpuQMoE.decode_kernel = "v5": stream-K over (tile, row tile, k-tile) units, FC1 split-K partials met through an
# fp32 scratch + counters that every launch leaves zeroed. Same tolerance as v4 (1e-4 fp32 I/O).
def _v5(m, **cfg):
    m.decode_kernel = "v5"
    m.dec5_cfg = {"bps": 0, "bps1": 0, "bps2": 0, "grid": 0, **cfg}
    return m


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bits,block,zp,act", GRID, ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in GRID])
def test_gpu_v5_decode_matches_reference(gpu, bits, block, zp, act, dtype):
    """The v4 grid (same seeds and shapes), decode only, v5 kernels at 1, 3 and 8 tokens; v5 == v4 closely."""
    cp, GpuQMoE = gpu
    spec, t, x, lg = _grid_case(bits, block, zp, act, dtype)
    H = spec.hidden_size
    m = GpuQMoE(spec, t, path="tc")
    for T in (1, 3, 8):
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        m.decode_kernel = "v4"
        got4 = m.forward(x[:T], lg[:T])
        _v5(m)
        got = m.forward(x[:T], lg[:T])
        assert isinstance(got, np.ndarray) and got.dtype == x.dtype and got.shape == (T, H)
        err = _relerr(got, ref)
        assert err <= TOL[("tc", "decode", dtype)], f"v5 T={T}: rel err {err:.2e}"
        assert m.last_decode_kernels[0].startswith("dec5h_" if dtype == np.float16 else "dec5_")
        if dtype == np.float32:
            assert _relerr(got, got4) <= 3e-5, f"v5 vs v4 T={T}"
    got2 = m.forward(x[:1], lg[:1])  # again: the FC1 scratch and counters were left clean
    assert _relerr(got2, qmoe_reference(x[:1], lg[:1], spec, t)) <= TOL[("tc", "decode", dtype)]


# fp16 activations through v5 take the dec5h kernels (fp16 weights and activations, one f16 MMA per k-step, FC2's
# activation rows rounded to fp16 by FC1). Against the bf16 hi / lo kernels on the same fp16 input (dec5_cfg f16 = 0,
# fp32 results through forward_into) the only difference beyond fp32 summation order is that rounding: <= 2^-11
# relative per activation, random in sign, ~3e-4 of max |out| at most over these shapes; bound 1e-3 (TOL 4e-3).
F16_CASES = [(4, 32, False, "swiglu1-limit"), (4, 0, True, "gelu"), (4, 16, True, "swiglu0"),
             (8, 64, False, "relu"), (8, 16, True, "swiglu1-limit"), (8, 0, True, "silu")]


@pytest.mark.parametrize("bits,block,zp,act", F16_CASES,
                         ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in F16_CASES])
def test_gpu_v5_fp16_path(gpu, bits, block, zp, act):
    """fp16 input takes dec5h (GpuQMoE.last_decode_kernels): within the fp16 decode tolerance of the reference
    and within 1e-3 of the bf16 hi / lo path's fp32 result; small grids (split-K epilogue writing fp16 rows)."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=200 + bits + block + zp, E=6, H=512, I=384, k=2, bits=bits, block_size=block,
                                zero_points=zp, bias=True, T=8, dtype=np.float16, **ACTS[act])
    spec = _spec(attrs, t, x)
    H = spec.hidden_size
    m = GpuQMoE(spec, t, path="tc")
    for cfg in ({}, {"grid": 3}):
        for T in (1, 3, 8):
            ref = qmoe_reference(x[:T], lg[:T], spec, t)
            _v5(m, **cfg)
            got = m.forward(x[:T], lg[:T])
            k1, k2 = m.last_decode_kernels
            assert k1.startswith("dec5h_") and k1.endswith("_0") and k2.startswith("dec5h_") and k2.endswith("_1")
            assert got.dtype == np.float16
            err = _relerr(got, ref)
            assert err <= TOL[("tc", "decode", np.float16)], f"{cfg} T={T}: rel err {err:.2e}"
            xd, lgd = cp.asarray(x[:T]), cp.asarray(lg[:T])
            new = m.forward_into(xd, lgd, cp.empty((T, H), cp.float32)).get()
            _v5(m, f16=0, **cfg)
            old = m.forward_into(xd, lgd, cp.empty((T, H), cp.float32)).get()
            assert all(k.startswith("dec5_") for k in m.last_decode_kernels), m.last_decode_kernels
            d = _relerr(new, old)
            assert d <= 1e-3, f"{cfg} T={T}: dec5h vs dec5 {d:.2e}"
            assert _relerr(old, ref) <= TOL[("tc", "decode", np.float16)]


# programmatic dependent launch of FC1 and FC2 (dec5_cfg pdl = 1, sm_90+; kernels/gpu/launch_pdl.py)
PDL_CASES = [(4, 32, False, "swiglu1-limit"), (4, 0, True, "gelu"), (8, 64, False, "relu"), (8, 16, True, "silu-fc3")]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bits,block,zp,act", PDL_CASES,
                         ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in PDL_CASES])
def test_gpu_v5_pdl_matches_plain_launches(gpu, bits, block, zp, act, dtype):
    """With pdl on, FC1 and FC2 may start during the kernel before them and wait in the kernel: 24 forwards in a
    row on one stream, each with its own routing (a FC1 that read decode_prep's tables early would use the previous
    forward's experts), against the reference and against plain launches; 1, 3 and 8 tokens; small and full grids.
    FC2 copies the weights of its first ring stages before its wait and their activations after it: the full grid
    gives its warps 1 unit each (fewer than the prologue's DEC5_STAGES - 1), grid 3 dozens, grid 29 about 5 (FC2 at
    T = 1: 576 units over 116 warps, ranges of 5 that cross row tiles of 6 k-tiles and tiles inside the prologue).
    bps1 1 / bps2 3: FC1's grid leaves room on every SM, so FC2's blocks run their pre-wait prologue while FC1 runs."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=300 + bits + block + zp, E=8, H=512, I=384, k=3, bits=bits, block_size=block,
                                zero_points=zp, bias=True, T=24, dtype=dtype, **ACTS[act])
    spec = _spec(attrs, t, x)
    H = spec.hidden_size
    m = GpuQMoE(spec, t, path="tc")
    tol = TOL[("tc", "decode", dtype)]
    for cfg in ({}, {"grid": 3}, {"grid": 29}, {"bps1": 1, "bps2": 3}):
        for T in (1, 3, 8):
            xd = cp.asarray(x[:T])
            outs = {}
            for pdl in (1, 0):
                _v5(m, pdl=pdl, **cfg)
                res = [cp.empty((T, H), cp.float32) for _ in range(24)]
                for i in range(24):
                    m.forward_into(xd, cp.asarray(np.roll(lg, -i, axis=0)[:T]), res[i])
                assert m.last_decode_pdl == bool(pdl and m.cc >= 90)
                outs[pdl] = [r.get() for r in res]
            for i in range(24):
                ref = qmoe_reference(x[:T], np.roll(lg, -i, axis=0)[:T], spec, t)
                err = _relerr(outs[1][i], ref)
                assert err <= tol, f"{cfg} T={T} forward {i}: rel err {err:.2e}"
                # only the atomics' summation order differs (fp16: and an FC2 input rounded to fp16 after it)
                same = 3e-5 if dtype == np.float32 else 1e-4
                assert _relerr(outs[1][i], outs[0][i]) <= same, f"{cfg} T={T} forward {i}: pdl vs plain"


@pytest.mark.parametrize("bits,block", [(4, 16), (4, 128), (4, 0), (4, 64), (8, 0), (8, 16), (8, 128)])
def test_gpu_v5_launch_configs(gpu, bits, block):
    """Larger shapes; grids from 1 block (4 warps walk every tile, row tile and k-tile: ranges cross row tiles
    and tiles, split-K partials from several warps) to the occupancy figure; 1..8 tokens; repeated launches."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=91 + bits + block, E=6, H=512, I=384, k=2, bits=bits, block_size=block,
                                zero_points=True, bias=True, T=70, activation="swiglu", swiglu_fusion=1,
                                alpha=1.702, beta=1.0, swiglu_limit=7.0)
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t))
    refs = {T: qmoe_reference(x[:T], lg[:T], spec, t) for T in (1, 2, 3, 5, 8)}
    for cfg in ({"grid": 1}, {"grid": 3}, {"grid": 37}, {"bps": 1}, {"bps": 2}, {"bps1": 1, "bps2": 2},
                {"l2_prefetch": 1}, {}):
        _v5(m, **cfg)
        for T, ref in refs.items():
            err = _relerr(m.forward(x[:T], lg[:T]), ref)
            assert err <= 1e-4, f"{cfg} T={T}: {err:.2e}"


def test_gpu_v5_unfused_activations(gpu):
    """Non-gated FC1 (relu, per-row scales, int8 zero points) through the split-K epilogue with small grids."""
    cp, GpuQMoE = gpu
    for bits, block, act in ((8, 0, "relu"), (4, 32, "gelu"), (4, 0, "silu-fc3")):
        attrs, t, x, lg = make_case(seed=123 + bits + block, E=5, H=320, I=192, k=2, bits=bits, block_size=block,
                                    zero_points=True, bias=True, T=8, **ACTS[act])
        spec = _spec(attrs, t, x)
        m = GpuQMoE(spec, t)
        for cfg in ({"grid": 1}, {"grid": 5}, {}):
            _v5(m, **cfg)
            for T in (1, 4, 8):
                err = _relerr(m.forward(x[:T], lg[:T]), qmoe_reference(x[:T], lg[:T], spec, t))
                assert err <= 1e-4, f"{bits} {block} {act} {cfg} T={T}: {err:.2e}"


@pytest.mark.parametrize("T", [2, 8])
def test_gpu_v5_run_experts_subsets(gpu, T):
    """Two run_experts calls over disjoint subsets of the pairs into one accumulator == the whole node (v5)."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=11, E=8, H=96, I=64, k=3, bits=4, block_size=32, zero_points=True, bias=True,
                                T=T, activation="swiglu", swiglu_fusion=2, alpha=1.0, beta=0.0)
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t))
    ids, w = ref_route(lg, spec)
    first = ids % 2 == 0
    ids_a = np.where(first, ids, -1).astype(np.int32)
    ids_b = np.where(first, -1, ids).astype(np.int32)
    acc = cp.zeros((T, spec.hidden_size), cp.float32)
    m.run_experts(cp.asarray(x), ids_a, w, out=acc)
    m.run_experts(x, cp.asarray(ids_b), cp.asarray(w), out=acc)
    assert _relerr(cp.asnumpy(acc), qmoe_reference(x, lg, spec, t)) <= 1e-4
    part = m.run_experts(x, ids_a, w)
    assert isinstance(part, np.ndarray) and part.dtype == x.dtype
    assert _relerr(part, _ref_pairs(x, ids_a, w, spec, t)) <= 1e-4


def test_gpu_v5_many_tiles_and_pairs(gpu):
    """run_experts with 8 tokens x 80 experts each of 300: > 128 tiles and > 512 pairs (past dec5's shared-memory
    caches of tiles and pair tokens), the same expert twice in a row, expert -1."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=41, E=300, H=64, I=64, k=2, bits=4, block_size=32, bias=True, T=8,
                                activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0)
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t))
    rng = np.random.default_rng(42)
    ids = np.stack([rng.permutation(300)[:80] for _ in range(8)]).astype(np.int32)
    ids[0, 1] = ids[0, 0]  # one expert twice for token 0
    ids[1, 5] = -1
    w = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    ref = _ref_pairs(x, ids, w, spec, t)
    for cfg in ({}, {"grid": 2}):
        _v5(m, **cfg)
        assert _relerr(m.run_experts(x, ids, w), ref) <= 1e-4, f"{cfg}"


def test_gpu_v5_slot_upload(gpu):
    """Experts uploaded into slots; pairs of non-resident experts skipped (v5)."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=13, E=8, H=128, I=64, k=2, bits=8, block_size=64, zero_points=True, bias=True,
                                T=5, activation="gelu")
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t, num_slots=3, resident=[]))
    rng = np.random.default_rng(14)
    ids = rng.integers(0, 8, size=(5, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 7, size=5)) % 8
    w = rng.uniform(0.1, 1.0, size=(5, 2)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    m.upload_expert(5, 0, stream=stream)
    m.upload_expert(2, 1, stream=stream, packed=m.pack_expert(2))
    stream.synchronize()
    mask = np.isin(ids, [5, 2])
    assert _relerr(m.run_experts(x, ids, w), _ref_pairs(x, np.where(mask, ids, -1), w, spec, t)) <= 1e-4


def test_gpu_v5_bf16_and_sparse_mixer(gpu):
    """bf16 activations (no lo half: split = 0) and host routing (sparse mixer) through v5."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=21, E=8, H=96, I=64, k=2, bits=4, block_size=32, T=8, activation="swiglu",
                                swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0, bias=True)
    bf16 = ml_dtypes.bfloat16
    t = dict(t, fc1_scales=t["fc1_scales"].astype(bf16), fc2_scales=t["fc2_scales"].astype(bf16))
    xb, lb = x.astype(bf16), lg.astype(bf16)
    spec = _spec(attrs, t, xb)
    m = _v5(GpuQMoE(spec, t))
    for T in (1, 8):
        got = m.forward(xb[:T], lb[:T])
        assert got.dtype == bf16
        assert _relerr(got.astype(np.float32), qmoe_reference(xb[:T], lb[:T], spec, t).astype(np.float32)) <= 1.5e-2
    attrs, t, x, lg = make_case(seed=9, E=16, H=64, I=64, k=2, bits=8, sparse_mixer=True, normalize=0, T=8,
                                activation="silu", bias=True)
    lg = (lg * 0.05).astype(np.float32)
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t))
    assert _relerr(m.forward(x, lg), qmoe_reference(x, lg, spec, t)) <= 1e-4


def test_gpu_v5_converted_nvfp4(gpu):
    """nvfp4 (converted to int8 block 16 with fp32 scales: dec5_8_4_*) through v5."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = _layout_case("nvfp4-kpacked", "swiglu1-limit", seed=23, T=8, E=8, k=2)
    spec = _spec(attrs, t, x)
    m = _v5(GpuQMoE(spec, t))
    for T in (1, 8):
        assert _relerr(m.forward(x[:T], lg[:T]), qmoe_reference(x[:T], lg[:T], spec, t)) <= 1e-4


# ----------------------------------------------------------------------------- prefill v1c (pf_gemmc, prefill.cu)
# GpuQMoE.prefill_kernel = "v1c" sends int4 / block 32 / no zero point at BM 32 / 48 / 64 through pf_gemmc, pf_gemm
# compiled for that case; "v1" keeps the general pf_gemm; "v1w" (the default) takes pf_gemmw (pf_gemmc on wgmma)
# where v1c takes pf_gemmc and the module has wgmma (m.has_wgmma: an sm_90a cubin), else pf_gemmc. Same
# dequantisation, scale folding and k order as pf_gemm: the same tolerances, and v1c == v1 up to FC2's atomicAdd order.
def _pf_names(kernel, bits, block, zp, BM, wgmma=False):
    if kernel in ("v1c", "v1w") and bits == 4 and block == 32 and not zp and BM in (32, 48, 64):
        c = "w" if kernel == "v1w" and wgmma else "c"
        return (f"pf_gemm{c}_4_{BM}_0", f"pf_gemm{c}_4_{BM}_1")
    return (f"pf_gemm_{bits}_{BM}_0", f"pf_gemm_{bits}_{BM}_1")


def test_gpu_wgmma_in_the_prebuilt_cubin(gpu):
    """On a 9.0 GPU with the prebuilt cubin (built for sm_90a) the module has the wgmma kernels, so the v1w tests
    below run pf_gemmw there and not pf_gemmc under its name."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=5, E=4, H=128, I=64, k=2, bits=4, block_size=32, T=4)
    m = GpuQMoE(_spec(attrs, t, x), t, path="tc")
    if m.cc != 90 or m.compiled_from != "cubin":
        pytest.skip(f"sm_{m.cc}, module from {m.compiled_from}: wgmma needs the sm_90a cubin")
    assert m.has_wgmma


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bits,block,zp,act", GRID, ids=[f"int{b}-blk{k}-zp{int(z)}-{a}" for b, k, z, a in GRID])
def test_gpu_v1c_matches_reference(gpu, bits, block, zp, act, dtype):
    """The v4 grid (same seeds and shapes), prefill at 100 tokens and 9 (one partial m16 tile), BM 32 and 64: v1c
    takes pf_gemmc exactly where the layout is int4 / block 32 / no zero point, and matches the reference and v1."""
    cp, GpuQMoE = gpu
    spec, t, x, lg = _grid_case(bits, block, zp, act, dtype)
    H = spec.hidden_size
    m = GpuQMoE(spec, t, path="tc")
    for T in (100, 9):
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        for BM in (32, 48, 64):
            m.prefill_bm = BM
            got = {}
            for kernel in ("v1", "v1c", "v1w"):
                m.prefill_kernel = kernel
                got[kernel] = m.forward(x[:T], lg[:T])
                assert m.last_prefill_kernels == _pf_names(kernel, bits, block, zp, BM, m.has_wgmma)
                assert isinstance(got[kernel], np.ndarray) and got[kernel].dtype == x.dtype
                assert got[kernel].shape == (T, H)
                err = _relerr(got[kernel], ref)
                assert err <= TOL[("tc", "prefill", dtype)], f"{kernel} BM={BM} T={T}: rel err {err:.2e}"
            if dtype == np.float32:
                assert _relerr(got["v1c"], got["v1"]) <= 1e-4, f"v1c vs v1 BM={BM} T={T}"
                assert _relerr(got["v1w"], got["v1c"]) <= 1e-4, f"v1w vs v1c BM={BM} T={T}"


V1C_RAGGED = [  # (bits, block, zp, act, dtype): the common case, then two that keep pf_gemm
    (4, 32, False, "swiglu1-limit", np.float32), (4, 32, False, "swiglu0", np.float16), (4, 32, False, "gelu", "bf16"),
    (4, 32, True, "swiglu2", np.float32), (4, 64, False, "silu", np.float16)]


@pytest.mark.parametrize("bits,block,zp,act,dtype", V1C_RAGGED,
                         ids=[f"int{b}-blk{k}-zp{int(z)}-{a}-{getattr(d, '__name__', d)}"
                              for b, k, z, a, d in V1C_RAGGED])
def test_gpu_v1c_ragged(gpu, bits, block, zp, act, dtype):
    """run_experts with 0, 1, 15, 17, 33, 64, 100 and 129 tokens per expert (partial m16 tiles and several tiles per
    expert), each token at most once per expert; several k-tiles and a partial last block of row tiles; BM 32, 64 and
    128 through v1c and v1; one accumulator shared by two calls."""
    cp, GpuQMoE = gpu
    bf16 = None
    if dtype == "bf16":
        bf16 = pytest.importorskip("ml_dtypes").bfloat16
        dtype = np.float32
    counts = [0, 1, 15, 17, 33, 64, 100, 129]
    E = len(counts)
    T = max(counts)
    H = 320  # FC1 5 k-tiles
    # FC1 row tiles 28 (gated, I 224), 14 or 12 (plain, I 224 / 192): partial last blocks of 8; FC2 20 row tiles
    I = {32: 224, 64: 192}[block]
    attrs, t, x, lg = make_case(seed=4321 + bits + block + zp, E=E, H=H, I=I, k=2, bits=bits, block_size=block,
                                zero_points=zp, bias=True, dtype=dtype, T=T, **ACTS[act])
    if bf16 is not None:
        t = {k_: (v.astype(bf16) if k_.endswith("_scales") else v) for k_, v in t.items()}
        x = x.astype(bf16)
    spec = _spec(attrs, t, x)
    kk = sum(c > 0 for c in counts)
    ids = np.full((T, kk), -1, np.int32)
    for tok in range(T):
        es = [e for e, c in enumerate(counts) if c > tok]
        ids[tok, :len(es)] = es
    w = np.random.default_rng(7).uniform(0.1, 1.0, size=(T, kk)).astype(np.float32)
    ref = _ref_pairs(x.astype(np.float32) if bf16 is not None else x, ids, w, spec, t)
    tol = 1.5e-2 if bf16 is not None else TOL[("tc", "prefill", dtype)]
    m = GpuQMoE(spec, t, path="tc")
    for BM in (32, 48, 64, 128):
        m.prefill_bm = BM
        for kernel in ("v1c", "v1", "v1w"):
            m.prefill_kernel = kernel
            got = m.run_experts(x, ids, w)
            assert m.last_prefill_kernels == _pf_names(kernel, bits, block, zp, BM, m.has_wgmma)
            got = np.asarray(got.astype(np.float32) if bf16 is not None else got)
            err = _relerr(got, ref)
            assert err <= tol, f"{kernel} BM={BM}: rel err {err:.2e}"
    m.prefill_kernel, m.prefill_bm = "v1c", 0
    acc = cp.zeros((T, H), cp.float32)
    m.run_experts(x, np.where(ids % 2 == 0, ids, -1), w, out=acc)
    m.run_experts(x, np.where(ids % 2 == 1, ids, -1), w, out=acc)
    assert _relerr(cp.asnumpy(acc), ref) <= max(tol, 3e-3)


@pytest.mark.parametrize("zp", [False, True], ids=["zp0", "zp1"])
def test_gpu_v1c_launch_configs(gpu, zp):
    """test_gpu_launch_configs' larger case at int4 block 32 (70 and 100 tokens, 6 experts) and 600 tokens (several
    tiles per expert, > 512 pairs), every BM through v1c: pf_gemmc without zero points at BM 32 / 48 / 64, pf_gemm
    otherwise."""
    cp, GpuQMoE = gpu
    attrs, t, x, lg = make_case(seed=113, E=6, H=512, I=384, k=2, bits=4, block_size=32, zero_points=zp, bias=True,
                                T=600, activation="swiglu", swiglu_fusion=1, alpha=1.702, beta=1.0, swiglu_limit=7.0)
    spec = _spec(attrs, t, x)
    m = GpuQMoE(spec, t, path="tc")
    # prefill_bm 0 (default_prefill_bm): pairs per resident expert 23 -> 32, 33 -> 48, 200 -> 64
    auto_bm = {70: 32, 100: 48, 600: 64}
    assert m.prefill_kernel == "v1w"  # the default
    for T in (70, 100, 600):
        ref = qmoe_reference(x[:T], lg[:T], spec, t)
        for kernel in ("v1c", "v1w"):
            m.prefill_kernel = kernel
            for bm in (0, 32, 48, 64, 128):
                m.prefill_bm = bm
                err = _relerr(m.forward(x[:T], lg[:T]), ref)
                assert err <= 3e-3, f"{kernel} T={T} BM={bm}: {err:.2e}"
                assert m.last_prefill_kernels == _pf_names(kernel, 4, 32, zp, bm or auto_bm[T], m.has_wgmma)
