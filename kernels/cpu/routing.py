"""Vectorised (NumPy) QMoE routing for the CPU path; same semantics as kernels.reference.route."""
from __future__ import annotations

import numpy as np
from numba import njit

from ..qmoe_spec import QMoESpec

__all__ = ["route", "SPARSE_MIXER_JITTER_EPS"]

SPARSE_MIXER_JITTER_EPS = 0.01


def _sparse_mixer(z: np.ndarray, eps: float = SPARSE_MIXER_JITTER_EPS):
    T = z.shape[0]
    rows = np.arange(T)
    i0 = np.argmax(z, axis=1)
    m0 = z[rows, i0][:, None]
    mask0 = (m0 - z) > (2.0 * eps * np.maximum(np.abs(z), m0))
    w0 = 1.0 / np.where(mask0, 0.0, np.exp(z - m0)).sum(axis=1)
    z1 = z.copy()
    z1[rows, i0] = -np.inf
    i1 = np.argmax(z1, axis=1)
    m1 = z[rows, i1][:, None]
    mask1 = (m1 - z) > (2.0 * eps * np.maximum(np.abs(z), m1))
    mask1[rows, i0] = True
    w1 = 1.0 / np.where(mask1, 0.0, np.exp(z - m1)).sum(axis=1)
    return np.stack([i0, i1], axis=1), np.stack([w0, w1], axis=1)


@njit(cache=True, nogil=True, error_model="numpy")
def _topk_softmax(z, k, normalize):
    """The common case of route() in one compiled pass (decode calls it per token and layer): top-k by
    value with ties to the lower index (= stable argsort of -z), softmax over all experts in float64,
    optional renormalisation. ok = False (nothing else meaningful) when a logit is not finite."""
    T, E = z.shape
    ids = np.empty((T, k), np.int32)
    w = np.empty((T, k), np.float32)
    taken = np.zeros(E, np.bool_)
    wk = np.empty(k, np.float64)
    for t in range(T):
        m = -np.inf
        for e in range(E):
            v = np.float64(z[t, e])
            if not np.isfinite(v):
                return ids, w, False
            if v > m:
                m = v
        denom = 0.0
        for e in range(E):
            denom += np.exp(np.float64(z[t, e]) - m)
            taken[e] = False
        s = 0.0
        for j in range(k):
            best = -1
            bv = -np.inf
            for e in range(E):
                if not taken[e] and (best < 0 or np.float64(z[t, e]) > bv):
                    best = e
                    bv = np.float64(z[t, e])
            taken[best] = True
            ids[t, j] = best
            wk[j] = np.exp(bv - m) / denom
            s += wk[j]
        for j in range(k):
            w[t, j] = wk[j] / s if (normalize and s != 0.0) else wk[j]
    return ids, w, True


def route(router_logits, spec: QMoESpec, router_weights=None):
    """(expert_ids int32 [T, k], weights float32 [T, k]); see kernels.reference.route."""
    E = spec.num_experts
    if router_weights is None and not spec.use_sparse_mixer and 0 < spec.k <= E:
        z = np.asarray(router_logits)
        if z.dtype not in (np.float32, np.float64):
            z = z.astype(np.float32)
        ids, w, ok = _topk_softmax(z.reshape(-1, E), spec.k, bool(spec.normalize_routing_weights))
        if ok:
            return ids, w
    z = np.asarray(router_logits).reshape(-1, E).astype(np.float64)
    if spec.use_sparse_mixer:
        ids, w = _sparse_mixer(z)
    else:
        k = spec.k
        if k == 1:
            ids = np.argmax(z, axis=1)[:, None]
        else:
            ids = np.argsort(-z, axis=1, kind="stable")[:, :k]
        if router_weights is not None:
            rw = np.asarray(router_weights).reshape(-1, E).astype(np.float64)
            w = np.take_along_axis(rw, ids, axis=1)
        else:
            m = z.max(axis=1, keepdims=True)
            denom = np.exp(z - m).sum(axis=1, keepdims=True)
            w = np.exp(np.take_along_axis(z, ids, axis=1) - m) / denom
        if spec.normalize_routing_weights:
            s = w.sum(axis=1, keepdims=True)
            w = np.where(s != 0, w / np.where(s != 0, s, 1.0), w)
    return ids.astype(np.int32), w.astype(np.float32)
