"""Vectorised (NumPy) QMoE routing for the CPU path; same semantics as kernels.reference.route."""
from __future__ import annotations

import numpy as np

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


def route(router_logits, spec: QMoESpec, router_weights=None):
    """(expert_ids int32 [T, k], weights float32 [T, k]); see kernels.reference.route."""
    E = spec.num_experts
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
