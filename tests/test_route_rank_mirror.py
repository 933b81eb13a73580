"""CPU mirror of decode_prep's routing by ranks (kernels/gpu/source/route.cu, route_key / route_rank_block).

route_rank_block gives every expert of a token its rank (larger logit first, ties: lower index first) by counting,
with q lanes per expert, the experts that beat it; the ranks below k are the top k. Here the same steps run in
NumPy, thread by thread and line by line (the keys, the lanes' split of the T * E experts, the uniform trip count,
the count with its tie rule, the weights), against kernels.reference.route on random, tied and special logits.
The CUDA code itself is checked on a GPU by tests/test_qmoe_gpu.py (test_gpu_decode_prep_routing)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernels.reference import route as ref_route


def route_key(z: np.ndarray) -> np.ndarray:
    """route_key: float32 -> uint32, order-preserving; -0 -> +0; NaN -> 0."""
    z = np.where(z == 0.0, np.float32(0.0), z).astype(np.float32)
    b = z.view(np.uint32)
    key = np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)
    return np.where(np.isnan(z), np.uint32(0), key)


def route_key_value(key: np.ndarray) -> np.ndarray:
    key = np.asarray(key, np.uint32)
    return np.where(key & 0x80000000, key & 0x7fffffff, ~key).astype(np.uint32).view(np.float32)


def route_rank_block(z: np.ndarray, k: int, normalize: bool, rw: np.ndarray | None, nth: int = 256):
    """route_rank_block for T tokens of E logits, a block of nth threads: (ids [T, k], weights [T, k])."""
    T, E = z.shape
    TE = T * E
    skey = route_key(z.astype(np.float32).ravel())
    lq = 0
    while lq < 5 and (TE << (lq + 1)) <= nth:
        lq += 1
    q = 1 << lq
    sids = np.full(T * k, -1, np.int64)
    ssel = np.zeros(T * k, np.uint32)
    covered = np.zeros(TE, np.int64)
    for g0 in range(0, TE << lq, nth):
        counts = {}  # (warp, lane group) -> [c per lane], summed as the xor shuffles do within a group of q lanes
        for tid in range(nth):
            g = g0 + tid
            el, sub = g >> lq, g & (q - 1)
            valid = el < TE
            tok = el // E if valid else 0
            e = el - tok * E if valid else 0
            row = skey[tok * E:(tok + 1) * E].astype(np.int64)
            mine = int(row[e])
            if E % (4 * q) == 0:  # a contiguous run of E / q keys a lane, read 16 bytes at a time
                n = E // q
                j = np.arange(sub * n, sub * n + n)
            else:
                j = np.arange(sub, E, q)
            c = int(np.count_nonzero(row[j] >= mine + (j >= e)))
            counts.setdefault(tid >> lq, []).append((c, valid, sub, tok, e, mine))
        for group in counts.values():
            total = sum(c for c, *_ in group)  # the xor butterfly over the q lanes of a group
            for c, valid, sub, tok, e, mine in group:
                if valid and sub == 0:
                    covered[tok * E + e] += 1
                    if total < k:
                        assert sids[tok * k + total] == -1, "two experts took the same rank"
                        sids[tok * k + total] = e
                        ssel[tok * k + total] = mine
    assert (covered == 1).all(), "every expert is ranked by exactly one lane group"
    ids = sids.reshape(T, k)
    w = np.zeros((T, k), np.float32)
    for tok in range(T):
        m = route_key_value(ssel[tok * k])
        s = np.float32(1.0)
        if rw is None and not normalize:
            s = np.exp(route_key_value(skey[tok * E:(tok + 1) * E]) - m, dtype=np.float32).sum(dtype=np.float32)
        for j in range(k):
            w[tok, j] = rw[tok, ids[tok, j]] if rw is not None else np.exp(route_key_value(ssel[tok * k + j]) - m) / s
        wsum = w[tok].sum(dtype=np.float32)
        if normalize and wsum != 0.0:
            w[tok] = w[tok] / wsum
    return ids, w


def _spec(E: int, k: int, normalize: bool) -> SimpleNamespace:
    """What kernels.reference.route reads of a QMoESpec."""
    return SimpleNamespace(num_experts=E, k=k, normalize_routing_weights=normalize, use_sparse_mixer=False)


def test_route_key_orders_like_floats():
    rng = np.random.default_rng(1)
    z = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 2000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                                  np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny, 1e-45, -1e-45],
                                 np.float32)]).astype(np.float32)
    keys = route_key(z)
    order = np.argsort(z, kind="stable")
    assert (np.diff(keys[order].astype(np.int64)) >= 0).all()
    assert route_key(np.float32([0.0]))[0] == route_key(np.float32([-0.0]))[0]
    assert route_key(np.float32([np.nan]))[0] == 0 < route_key(np.float32([-np.inf]))[0]
    assert int(keys.max()) <= 0xff800000  # + (j >= e) never wraps
    np.testing.assert_array_equal(route_key_value(keys).view(np.uint32),
                                  np.where(z == 0.0, np.float32(0.0), z).view(np.uint32))


CASES = [(1, 32, 4), (1, 128, 8), (1, 60, 4), (2, 128, 8), (8, 8, 2), (8, 128, 8), (4, 1024, 8), (3, 7, 7),
         (1, 1024, 32), (5, 300, 4), (1, 2, 1), (16, 256, 4)]  # the kernel takes T * E <= 4096, T * k <= 64


@pytest.mark.parametrize("T,E,k", CASES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in CASES])
def test_route_rank_block_matches_reference(T, E, k):
    rng = np.random.default_rng(T * 1000 + E + k)
    for trial in range(3):
        z = rng.standard_normal((T, E)).astype(np.float32)
        if trial == 1:
            z = np.round(z * 2.0) / 2.0  # many ties
        if trial == 2:
            z[:, ::3] = 0.5
            z[0, :] = -0.0
            z[-1, 1::4] = 0.0
            z[-1, ::5] = -np.inf
        rw = rng.uniform(0.0, 1.0, size=z.shape).astype(np.float32)
        for normalize in (False, True):
            for weights in (None, rw):
                ids, w = route_rank_block(z, k, normalize, weights)
                ids_r, w_r = ref_route(z, _spec(E, k, normalize), router_weights=weights)
                np.testing.assert_array_equal(ids, ids_r)
                np.testing.assert_allclose(w, w_r, rtol=2e-6, atol=1e-7)


def test_route_rank_block_nan_ranked_last():
    """NaN logits rank after every number, lower index first among them, as numpy's argsort of -z."""
    z = np.array([[np.nan, 1.0, np.nan, -np.inf, 2.0, np.nan]], np.float32)
    rw = np.ones_like(z)
    ids, _ = route_rank_block(z, 6, True, rw)
    ids_r, _ = ref_route(z, _spec(6, 6, True), router_weights=rw)
    np.testing.assert_array_equal(ids, ids_r)
    assert ids.tolist() == [[4, 1, 3, 0, 2, 5]]
