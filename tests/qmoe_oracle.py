"""Build a one-node onnxruntime QMoE (or MoE) model in memory and run it on the CPU.

Used by the tests (and the benchmark) as an independent oracle for kernels/reference.py.
See /work/shared/reference/qmoe.md for where onnxruntime's CPU QMoE is an exact oracle.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

QMOE_INPUT_NAMES = (
    "input", "router_probs", "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
    "fc2_experts_weights", "fc2_scales", "fc2_experts_bias", "fc3_experts_weights",
    "fc3_scales", "fc3_experts_bias", "fc1_zero_points", "fc2_zero_points", "fc3_zero_points",
    "router_weights", "fc1_global_scale", "fc2_global_scale", "fc1_act_scale", "fc2_act_scale",
    "fc1_act_block_scale", "fc2_act_block_scale",
)
MOE_INPUT_NAMES = (
    "input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
    "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias",
)
# Inputs fed at run time (everything else becomes an initializer).
_RUNTIME_INPUTS = ("input", "router_probs", "router_weights")


def _elem_type(arr: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(arr.dtype)


def build_model(op_type: str, attrs: dict, tensors: dict, x_shape, dtype) -> onnx.ModelProto:
    """One-node model. ``tensors``: QMoE input name -> array or None (absent)."""
    names = QMOE_INPUT_NAMES if op_type == "QMoE" else MOE_INPUT_NAMES
    last = max(i for i, n in enumerate(names) if n in ("input", "router_probs") or tensors.get(n) is not None)
    node_inputs, graph_inputs, inits = [], [], []
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for i, name in enumerate(names[: last + 1]):
        if name == "input":
            node_inputs.append(name)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, list(x_shape)))
            continue
        arr = tensors.get(name)
        if arr is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        if name in _RUNTIME_INPUTS:
            graph_inputs.append(helper.make_tensor_value_info(name, _elem_type(arr), list(arr.shape)))
        else:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
    node = helper.make_node(op_type, node_inputs, ["output"], domain="com.microsoft", name="moe_node",
                            **{k: v for k, v in attrs.items() if v is not None})
    out = helper.make_tensor_value_info("output", elem, list(x_shape))
    graph = helper.make_graph([node], "qmoe_oracle", graph_inputs, [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def run_ort(op_type: str, attrs: dict, tensors: dict, x: np.ndarray, router_logits: np.ndarray,
            router_weights: np.ndarray | None = None) -> np.ndarray:
    """Run the single node in onnxruntime (CPU) and return its output."""
    sess, feeds = make_session(op_type, attrs, tensors, x, router_logits, router_weights)
    return sess.run(None, feeds)[0]


def make_session(op_type, attrs, tensors, x, router_logits, router_weights=None):
    import onnxruntime as ort

    from engine.ort_env import session_options

    t = dict(tensors)
    t["router_probs"] = router_logits
    t["router_weights"] = router_weights
    model = build_model(op_type, attrs, t, x.shape, x.dtype)
    # The engine's options: one process-wide thread pool (onnxruntime refuses per-session pools once
    # it exists); its size is set by engine.ort_env.configure_global_threads before the first session.
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    feeds = {"input": x, "router_probs": router_logits}
    if router_weights is not None:
        feeds["router_weights"] = router_weights
    return sess, feeds


# ----------------------------------------------------------------------------- random test cases
def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., K] (0 <= c < 2^bits) -> uint8 [..., K*bits/8], LSB-first (int4: low nibble = even k)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes.copy()
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), np.uint8)], axis=-1)
    c = codes.reshape(*codes.shape[:-1], -1, per)
    out = np.zeros(c.shape[:-1], np.uint8)
    for i in range(per):
        out |= (c[..., i] << (bits * i)).astype(np.uint8)
    return out


def make_case(seed=0, E=8, H=64, I=96, k=2, bits=4, block_size=0, zero_points=False, activation="relu",
              swiglu_fusion=0, swiglu_limit=None, alpha=1.0, beta=0.0, bias=False, dtype=np.float32,
              normalize=1, sparse_mixer=False, op_type="QMoE", T=5, fc3=None):
    """Random QMoE node: returns (attrs, tensors, x, router_logits).

    Weights uniform random codes, random-sign scales sized so that outputs stay O(1).
    """
    rng = np.random.default_rng(seed)
    fused = activation == "swiglu" and swiglu_fusion in (1, 2)
    if fc3 is None:
        fc3 = activation == "swiglu" and swiglu_fusion == 0
    N1 = (2 if fused else 1) * I
    projs = {"fc1": (N1, H), "fc2": (H, I)}
    if fc3:
        projs["fc3"] = (I, H)
    t = {}
    for p, (n, kk) in projs.items():
        if op_type == "MoE":
            t[f"{p}_experts_weights"] = (rng.standard_normal((E, n, kk)) / np.sqrt(kk)).astype(dtype)
            continue
        codes = rng.integers(0, 1 << bits, size=(E, n, kk))
        t[f"{p}_experts_weights"] = pack_codes(codes, bits)
        nb = kk // block_size if block_size else 1
        mag = rng.uniform(0.5, 1.5, size=(E, n, nb)) / ((1 << (bits - 1)) * np.sqrt(kk)) * 2.0
        sgn = rng.choice([-1.0, 1.0], size=(E, n, nb))
        s = (mag * sgn).astype(dtype)
        t[f"{p}_scales"] = s if block_size else s[..., 0]
        if zero_points:
            if block_size:
                zc = rng.integers(0, 1 << bits, size=(E, n, nb))
                t[f"{p}_zero_points"] = pack_codes(zc, bits)
            else:
                zc = rng.integers(0, 1 << bits, size=(E, n))
                t[f"{p}_zero_points"] = pack_codes(zc, bits)
    if bias:
        for p, (n, kk) in projs.items():
            t[f"{p}_experts_bias"] = (rng.standard_normal((E, n)) * 0.1).astype(dtype)
    attrs = {"k": k, "activation_type": activation, "normalize_routing_weights": normalize}
    if op_type == "QMoE":
        attrs["expert_weight_bits"] = bits
        if block_size:
            attrs["block_size"] = block_size
        attrs["weights_prepacked"] = 0
    if activation == "swiglu":
        attrs["swiglu_fusion"] = swiglu_fusion
        attrs["activation_alpha"] = alpha
        attrs["activation_beta"] = beta
        if swiglu_limit is not None:
            attrs["swiglu_limit"] = swiglu_limit
    if sparse_mixer:
        attrs["use_sparse_mixer"] = 1
    x = rng.standard_normal((T, H)).astype(dtype)
    logits = (rng.standard_normal((T, E)) * 2.0).astype(dtype)
    return attrs, t, x, logits
