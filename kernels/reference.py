"""Plain NumPy reference implementation of com.microsoft QMoE / MoE (the oracle for our kernels).

Written for clarity, not speed: float64 internally, one expert at a time. Every weight layout of the
contract is dequantised by kernels/layouts.py; activations may be float32, float16 or bfloat16
(ml_dtypes arrays). Semantics: /work/shared/reference/qmoe.md (CUDA routing semantics).
"""
from __future__ import annotations

import numpy as np

from . import layouts as L
from .qmoe_spec import QMoESpec

__all__ = ["route", "dequantize", "expert_ffn", "qmoe_reference", "activation", "SPARSE_MIXER_JITTER_EPS"]

SPARSE_MIXER_JITTER_EPS = 0.01


# ----------------------------------------------------------------------------- routing
def _topk_desc(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row, largest first, ties -> lower index first."""
    order = np.argsort(-v, axis=-1, kind="stable")
    return order[:, :k]


def _sparse_mixer(z: np.ndarray, eps: float = SPARSE_MIXER_JITTER_EPS):
    """Phi-3.5-MoE sparse mixer (top-2), as onnxruntime's CUDA ``sparse_mixer_top2`` computes it."""
    T, E = z.shape
    ids = np.zeros((T, 2), np.int64)
    w = np.zeros((T, 2), np.float64)
    for t in range(T):
        row = z[t]
        chosen = []
        for kk in range(2):
            cand = row.copy()
            for c in chosen:
                cand[c] = -np.inf
            i = int(np.argmax(cand))  # first maximum -> lowest index on ties
            m = row[i]
            factor = np.maximum(np.abs(row), m)
            mask = (m - row) > (2.0 * eps * factor)
            if kk == 1:
                mask[chosen[0]] = True
            e = np.where(mask, 0.0, np.exp(row - m))
            w[t, kk] = e[i] / e.sum()
            ids[t, kk] = i
            chosen.append(i)
    return ids, w


def route(router_logits: np.ndarray, spec: QMoESpec, router_weights: np.ndarray | None = None):
    """Top-k routing. Returns (expert_ids int32 [T, k], weights float32 [T, k]).

    CUDA semantics: p = softmax(z) over all experts, w = p[top-k], divided by its sum when
    normalize_routing_weights. With router_weights: select by router_logits, w = router_weights[top-k]
    (divided by its sum when normalize_routing_weights, as onnxruntime does).
    Sparse mixer (k = 2): see ``_sparse_mixer``.
    """
    z = np.asarray(router_logits, dtype=np.float64).reshape(-1, spec.num_experts)
    k = spec.k
    if spec.use_sparse_mixer:
        ids, w = _sparse_mixer(z)
    else:
        ids = _topk_desc(z, k)
        if router_weights is not None:
            rw = np.asarray(router_weights, dtype=np.float64).reshape(-1, spec.num_experts)
            w = np.take_along_axis(rw, ids, axis=1)
        else:
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            w = np.take_along_axis(p, ids, axis=1)
        if spec.normalize_routing_weights:
            s = w.sum(axis=1, keepdims=True)
            w = np.where(s != 0, w / np.where(s != 0, s, 1.0), w)
    return ids.astype(np.int32), w.astype(np.float32)


# ----------------------------------------------------------------------------- dequantisation
def dequantize(weights, scales, zero_points, bits: int, block_size: int, k: int | None = None) -> np.ndarray:
    """Dequantise raw integer expert weights (int2 / int3 / int4 / int8 LSB-first rows).

    weights uint8 [E?, N, ceil(K*bits/8)]; scales [E?, N] (block_size 0) or [E?, N, K/block_size];
    zero_points uint8 packed as described in qmoe.md or None. K defaults to the whole bytes of a row
    (give it for int3, whose rows may end in padding bits). Returns float32 [E?, N, K].
    """
    w = np.asarray(weights, dtype=np.uint8)
    if k is None:
        s = np.asarray(scales)
        k = s.shape[-1] * block_size if block_size and bits == 3 else w.shape[-1] * 8 // bits
    n = w.shape[-2]
    return L.dequantize_int(w, scales, zero_points, bits, block_size, n, k).astype(np.float32)


def _proj_weight(spec: QMoESpec, tensors: dict, proj: str, e: int) -> np.ndarray:
    """Dequantised [N, K] float64 matrix of projection 'fc1'/'fc2'/'fc3' of expert e, in every layout."""
    w = tensors[f"{proj}_experts_weights"][e]
    if not spec.is_quantized:
        return np.asarray(w, dtype=np.float64)
    n, k = {p: (nn, kk) for p, nn, kk, _ in spec.projections}[proj]
    bits = spec.proj_bits(proj)
    scales = tensors.get(f"{proj}_scales")
    s_e = None if scales is None else scales[e]
    g = tensors.get(f"{proj}_global_scale") if spec.has_global_scale else None
    g_e = None if g is None else g[e]
    if spec.quant_type == "int":
        zp = tensors.get(f"{proj}_zero_points")
        return L.dequantize_int(w, s_e, None if zp is None else zp[e], bits, spec.block_size, n, k, spec.packing)
    if spec.quant_type in ("fp4", "nvfp4"):
        return L.dequantize_fp4(w, s_e, g_e, spec.scale_format, spec.block_size, n, k, spec.packing)
    if spec.quant_type == "fp8":
        return L.dequantize_fp8(w, s_e, g_e, spec.block_size, n, k)
    raise ValueError(f"unknown quant_type {spec.quant_type!r}")


def _bias(tensors, name, e):
    b = tensors.get(name)
    return None if b is None else np.asarray(b[e], dtype=np.float64)


# ----------------------------------------------------------------------------- activations
def activation(kind: str, g: np.ndarray) -> np.ndarray:
    if kind == "relu":
        return np.maximum(g, 0.0)
    if kind == "gelu":  # tanh approximation
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    if kind == "silu":
        return g / (1.0 + np.exp(-g))
    if kind == "identity":
        return g
    if kind == "relu2":  # squared ReLU
        return np.maximum(g, 0.0) ** 2
    raise ValueError(kind)


def _swiglu(g, l, spec: QMoESpec):
    lim = spec.swiglu_limit
    if lim is not None and spec.swiglu_limit_after_activation:
        a = np.minimum(g / (1.0 + np.exp(-spec.alpha * g)), lim)
        return a * (np.clip(l, -lim, lim) + spec.beta)
    if lim is not None:
        g = np.minimum(g, lim)
        l = np.clip(l, -lim, lim)
    return g / (1.0 + np.exp(-spec.alpha * g)) * (l + spec.beta)


def _geglu(g, l):
    """GELU-tanh(gate) * up; alpha, beta and swiglu_limit do not apply."""
    return activation("gelu", g) * l


def _up(x, spec, tensors, e):
    l = x @ _proj_weight(spec, tensors, "fc3", e).T
    b3 = _bias(tensors, "fc3_experts_bias", e)
    return l if b3 is None else l + b3


def expert_ffn(x, e: int, spec: QMoESpec, tensors: dict, rows: tuple[int, int] | None = None) -> np.ndarray:
    """FFN of expert e over tokens x [T, H] -> [T, H] (float64, FC2 bias included). `rows` (r0, r1): the part of
    the expert over its intermediate rows [r0, r1) only (the others' activations 0; FC2's bias only where r0 = 0), as
    a pair split between the CPU and the GPU computes it (kernels/cold_split.py)."""
    x = np.asarray(x, dtype=np.float64)
    w1 = _proj_weight(spec, tensors, "fc1", e)
    h = x @ w1.T
    b1 = _bias(tensors, "fc1_experts_bias", e)
    if b1 is not None:
        h = h + b1
    I = spec.inter_size
    if spec.gated:
        if spec.swiglu_fusion == 1:
            g, l = h[:, 0::2], h[:, 1::2]
        elif spec.swiglu_fusion == 2:
            g, l = h[:, :I], h[:, I:]
        else:
            g, l = h, _up(x, spec, tensors, e)
        a = _swiglu(g, l, spec) if spec.activation == "swiglu" else _geglu(g, l)
    else:
        a = activation(spec.activation, h)
        if spec.has_fc3:  # gated: act(FC1 x) * FC3 x
            a = a * _up(x, spec, tensors, e)
    if rows is not None:
        a = a.copy()
        a[:, :rows[0]] = 0.0
        a[:, rows[1]:] = 0.0
    y = a @ _proj_weight(spec, tensors, "fc2", e).T
    b2 = _bias(tensors, "fc2_experts_bias", e)
    if b2 is not None and (rows is None or rows[0] == 0):
        y = y + b2
    return y


def qmoe_reference(x, router_logits, spec: QMoESpec, tensors: dict, router_weights=None) -> np.ndarray:
    """Full QMoE node: x [T, H] or [B, S, H] -> same shape and dtype (computed in float64)."""
    x = np.asarray(x)
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, spec.hidden_size).astype(np.float64)
    ids, w = route(router_logits, spec, router_weights)
    out = np.zeros_like(x2)
    for e in np.unique(ids):
        if e < 0:
            continue
        rows, cols = np.nonzero(ids == e)
        y = expert_ffn(x2[rows], int(e), spec, tensors)
        np.add.at(out, rows, w[rows, cols, None].astype(np.float64) * y)
    return out.astype(dtype).reshape(shape)
