"""Build a one-node onnxruntime QMoE (or MoE) model in memory and run it on the CPU.

Used by the tests (and the benchmark) as an independent oracle for kernels/reference.py.
See /work/shared/reference/qmoe.md for where onnxruntime's CPU QMoE is an exact oracle.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kernels.qmoe_spec import MOE_INPUT_NAMES, QMOE_INPUT_NAMES  # noqa: E402  (the contract's input order)

# Inputs fed at run time (everything else becomes an initializer).
_RUNTIME_INPUTS = ("input", "router_probs", "router_weights")
# The contract the oracle stands for is onnxruntime 1.32's CPU QMoE. The GPU builds are older (onnxruntime-gpu 1.31
# for CUDA 13, 1.23 for CUDA 12): they refuse some layouts (int3, NVFP4) and compute others differently (SM80 int4).
ORACLE_VERSION = (1, 32)


def require_oracle() -> None:
    """Skip the calling test where the installed onnxruntime predates the contract (make installed a GPU build)."""
    import onnxruntime as ort
    import pytest

    if tuple(int(part) for part in ort.__version__.split(".")[:2]) < ORACLE_VERSION:
        pytest.skip(f"onnxruntime {ort.__version__} predates the 1.32 QMoE contract the oracle stands for")


def _elem_type(arr: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(arr.dtype)


def _is_bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def build_model(op_type: str, attrs: dict, tensors: dict, x_shape, dtype) -> onnx.ModelProto:
    """One-node model. ``tensors``: QMoE input name -> array or None (absent).

    bfloat16 activations: onnxruntime's Python feeds cannot carry bfloat16 arrays, so the graph's inputs and
    output are float32 with Cast nodes to / from bfloat16 around the node (initializers stay bfloat16).
    """
    names = QMOE_INPUT_NAMES if op_type == "QMoE" else MOE_INPUT_NAMES
    last = max(i for i, n in enumerate(names) if n in ("input", "router_probs") or tensors.get(n) is not None)
    node_inputs, graph_inputs, inits, casts = [], [], [], []
    bf16 = _is_bf16(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32 if bf16 else dtype))

    def runtime_input(name, elem_type, shape):
        graph_inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        if bf16:
            casts.append(helper.make_node("Cast", [name], [name + "_bf16"], to=onnx.TensorProto.BFLOAT16))
            return name + "_bf16"
        return name

    for i, name in enumerate(names[: last + 1]):
        if name == "input":
            node_inputs.append(runtime_input(name, elem, x_shape))
            continue
        arr = tensors.get(name)
        if arr is None:
            node_inputs.append("")
            continue
        if name in _RUNTIME_INPUTS:
            node_inputs.append(runtime_input(name, elem if bf16 else _elem_type(arr), arr.shape))
        else:
            node_inputs.append(name)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
    node_out = "output_bf16" if bf16 else "output"
    node = helper.make_node(op_type, node_inputs, [node_out], domain="com.microsoft", name="moe_node",
                            **{k: v for k, v in attrs.items() if v is not None})
    nodes = casts + [node]
    if bf16:
        nodes.append(helper.make_node("Cast", [node_out], ["output"], to=onnx.TensorProto.FLOAT))
    out = helper.make_tensor_value_info("output", elem, list(x_shape))
    graph = helper.make_graph(nodes, "qmoe_oracle", graph_inputs, [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def run_ort(op_type: str, attrs: dict, tensors: dict, x: np.ndarray, router_logits: np.ndarray,
            router_weights: np.ndarray | None = None) -> np.ndarray:
    """Run the single node in onnxruntime (CPU) and return its output."""
    sess, feeds = make_session(op_type, attrs, tensors, x, router_logits, router_weights)
    out = sess.run(None, feeds)[0]
    return out.astype(x.dtype) if _is_bf16(x.dtype) else out


def make_session(op_type, attrs, tensors, x, router_logits, router_weights=None, threads=None, spinning=False):
    import onnxruntime as ort

    from engine.ort_env import session_options

    require_oracle()
    t = dict(tensors)
    t["router_probs"] = router_logits
    t["router_weights"] = router_weights
    model = build_model(op_type, attrs, t, x.shape, x.dtype)
    # The engine's options; a benchmark's reference session, timed alone, asks for a spinning pool.
    sess = ort.InferenceSession(model.SerializeToString(), session_options(threads=threads, spinning=spinning),
                                providers=["CPUExecutionProvider"])
    feeds = {"input": x, "router_probs": router_logits}
    if router_weights is not None:
        feeds["router_weights"] = router_weights
    if _is_bf16(x.dtype):
        feeds = {k: np.asarray(v, np.float32) for k, v in feeds.items()}
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


# ----------------------------------------------------------------------------- random cases in every layout
def make_layout_case(seed=0, E=6, H=128, I=64, k=2, quant_type="int", bits=4, fc1_bits=None, fc2_bits=None,
                     fc3_bits=None, block_size=0, packing="raw", zero_points=False, activation="relu",
                     swiglu_fusion=0, swiglu_limit=None, limit_after=False, alpha=1.0, beta=0.0, bias=False,
                     dtype=np.float32, normalize=1, T=5, fc3=None, nonneg_scales=False, kpacked_dims="nk",
                     global_pow2=False):
    """Random QMoE node in any layout: returns (attrs, tensors, x, router_logits).

    quant_type 'int' (bits 2/3/4/8, per-projection fc*_bits, packing 'raw' or 'sm80'), 'fp4' (MXFP4),
    'nvfp4' (packing 'n_packed' or 'k_packed'; kpacked_dims 'kn' keeps the logical [E, K, N/2] dims) or 'fp8'
    (block_size 0 = global scales). Codes are uniform, scales of random sign (where the format has one) and
    sized so that outputs stay O(1). dtype: float32, float16 or ml_dtypes.bfloat16. global_pow2: global scales
    that are powers of two (onnxruntime 1.32's CPU nvfp4 path is exact only for those).
    """
    import ml_dtypes

    from kernels import layouts as L

    rng = np.random.default_rng(seed)
    gated = activation in ("swiglu", "geglu")
    fused = gated and swiglu_fusion in (1, 2)
    if fc3 is None:
        fc3 = gated and swiglu_fusion == 0
    pbits = {"fc1": fc1_bits or bits, "fc2": fc2_bits or bits, "fc3": fc3_bits or bits}
    projs = {"fc1": ((2 if fused else 1) * I, H), "fc2": (H, I)}
    if fc3:
        projs["fc3"] = (I, H)

    def signs(shape):
        return np.ones(shape) if nonneg_scales else rng.choice([-1.0, 1.0], size=shape)

    t = {}
    for p, (n, kk) in projs.items():
        if quant_type == "int":
            b = pbits[p]
            codes = rng.integers(0, 1 << b, size=(E, n, kk))
            t[f"{p}_experts_weights"] = L.sm80_pack(codes, b) if packing == "sm80" else L.pack_bits(codes, b)
            nb = kk // block_size if block_size else 1
            mag = rng.uniform(0.5, 1.5, size=(E, n, nb)) / ((1 << (b - 1)) * np.sqrt(kk)) * 2.0
            s = (mag * signs((E, n, nb))).astype(dtype)
            t[f"{p}_scales"] = s if block_size else s[..., 0]
            if zero_points:
                zc = rng.integers(0, 1 << b, size=(E, n, nb) if block_size else (E, n))
                t[f"{p}_zero_points"] = L.pack_bits(zc, b)
        elif quant_type in ("fp4", "nvfp4"):
            blk = 32 if quant_type == "fp4" else 16
            codes = rng.integers(0, 16, size=(E, n, kk))
            if packing == "n_packed":
                w = L.pack_bits(codes.transpose(0, 2, 1), 4)
            else:
                w = L.pack_bits(codes, 4)
                if kpacked_dims == "kn":
                    w = w.reshape(E, kk, n // 2)
            t[f"{p}_experts_weights"] = w
            g = rng.uniform(0.5, 2.0, size=E) / 64
            g = (2.0 ** np.round(np.log2(g)) if global_pow2 else g).astype(np.float32)
            target = rng.uniform(0.5, 1.5, size=(E, n, kk // blk)) / (2.93 * np.sqrt(kk)) / g[:, None, None]
            if quant_type == "fp4":
                sc = np.clip(np.round(np.log2(target)) + 127, 1, 254).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
            else:
                sc = L.float_to_e4m3(target * signs(target.shape)).view(ml_dtypes.float8_e4m3fn)
            t[f"{p}_scales"] = sc
            if p != "fc3":
                t[f"{p}_global_scale"] = g
        elif quant_type == "fp8":
            t[f"{p}_experts_weights"] = L.float_to_e4m3(rng.standard_normal((E, n, kk)) * 8).view(ml_dtypes.float8_e4m3fn)
            base = 1.0 / (8 * np.sqrt(kk))
            if block_size:
                shape = (E, -(-n // block_size), -(-kk // block_size))
                t[f"{p}_scales"] = (rng.uniform(0.5, 1.5, size=shape) * base * signs(shape)).astype(dtype)
            elif p != "fc3":
                t[f"{p}_global_scale"] = (rng.uniform(0.5, 1.5, size=E) * base).astype(np.float32)
        else:
            raise ValueError(quant_type)
    if bias:
        for p, (n, kk) in projs.items():
            t[f"{p}_experts_bias"] = (rng.standard_normal((E, n)) * 0.1).astype(dtype)
    attrs = {"k": k, "activation_type": activation, "normalize_routing_weights": normalize}
    if quant_type == "int":
        attrs["expert_weight_bits"] = bits
        for p in ("fc1", "fc2", "fc3"):
            if {"fc1": fc1_bits, "fc2": fc2_bits, "fc3": fc3_bits}[p] is not None:
                attrs[f"{p}_expert_weight_bits"] = pbits[p]
        if block_size:
            attrs["block_size"] = block_size
        attrs["weights_prepacked"] = 1 if packing == "sm80" else 0
    else:
        attrs["quant_type"] = quant_type
        attrs["expert_weight_bits"] = 8 if quant_type == "fp8" else 4
        if quant_type == "fp8" and block_size:
            attrs["block_size"] = block_size
        if quant_type == "nvfp4":
            attrs["weights_prepacked"] = 1 if packing == "k_packed" else 0
    if gated:
        attrs["swiglu_fusion"] = swiglu_fusion
        attrs["activation_alpha"] = alpha
        attrs["activation_beta"] = beta
        if swiglu_limit is not None:
            attrs["swiglu_limit"] = swiglu_limit
        if limit_after:
            attrs["swiglu_limit_after_activation"] = 1
    x = rng.standard_normal((T, H)).astype(dtype)
    logits = (rng.standard_normal((T, E)) * 2.0).astype(dtype)
    return attrs, t, x, logits
