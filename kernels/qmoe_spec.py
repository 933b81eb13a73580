"""Static description of one com.microsoft QMoE / MoE node, as our kernels understand it.

``QMoESpec.from_node`` reads the ONNX attributes and input shapes, derives the expert count,
hidden and intermediate sizes and validates the layout. Anything outside what the kernels
implement (int4 / int8 raw layout, or the float MoE op) raises ``UnsupportedLayout`` with a
one-line message naming the node and the unsupported feature.

The operator contract is described in /work/shared/reference/qmoe.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UnsupportedLayout", "QMoESpec", "QMOE_INPUT_NAMES", "MOE_INPUT_NAMES"]


class UnsupportedLayout(ValueError):
    """A QMoE node uses a layout / feature that our kernels do not implement."""


# index = ONNX input position of the QMoE op
QMOE_INPUT_NAMES = (
    "input", "router_probs", "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
    "fc2_experts_weights", "fc2_scales", "fc2_experts_bias", "fc3_experts_weights",
    "fc3_scales", "fc3_experts_bias", "fc1_zero_points", "fc2_zero_points", "fc3_zero_points",
    "router_weights", "fc1_global_scale", "fc2_global_scale", "fc1_act_scale", "fc2_act_scale",
    "fc1_act_block_scale", "fc2_act_block_scale",
)
# index = ONNX input position of the float MoE op (same names as QMoE's)
MOE_INPUT_NAMES = (
    "input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
    "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias",
)

_SUPPORTED_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")
_QUANT_TYPE_NAMES = {"fp4": "fp4 (mxfp4)", "nvfp4": "nvfp4", "fp8": "fp8", "wfp4afp8": "wfp4afp8"}


def _s(v) -> str:
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace")
    return str(v)


def _dim(shape, i):
    """Dimension i of a shape if it is a known positive int, else None."""
    if shape is None or len(shape) <= i:
        return None
    d = shape[i]
    if isinstance(d, bool):
        return None
    try:
        d = int(d)
    except (TypeError, ValueError):
        return None
    return d if d > 0 else None


@dataclass(frozen=True)
class QMoESpec:
    node_name: str
    op_type: str  # "QMoE" or "MoE"
    num_experts: int
    hidden_size: int
    inter_size: int
    k: int
    activation: str  # relu, gelu, silu, identity, swiglu
    swiglu_fusion: int
    alpha: float
    beta: float
    swiglu_limit: float | None
    normalize_routing_weights: bool
    use_sparse_mixer: bool
    quant_type: str  # "int" for QMoE, "float" for the float MoE op
    fc1_bits: int  # 4 or 8 (0 for float MoE)
    fc2_bits: int
    fc3_bits: int | None
    block_size: int  # 0 = one scale per output row
    has_fc3: bool
    has_zero_points: bool
    has_bias: bool
    weights_prepacked: int

    # ------------------------------------------------------------------ derived helpers
    @property
    def fusion(self) -> int:
        """Row multiplier of FC1: 2 when gate and up are fused into FC1."""
        return 2 if (self.activation == "swiglu" and self.swiglu_fusion in (1, 2)) else 1

    @property
    def fc1_rows(self) -> int:
        return self.fusion * self.inter_size

    @property
    def is_quantized(self) -> bool:
        return self.op_type == "QMoE"

    def expert_bytes(self, scale_bytes: int = 4, bias_bytes: int = 4, float_weight_bytes: int = 4) -> int:
        """Bytes of one expert's weights + scales + zero points + biases as stored.

        The spec knows shapes, not dtypes: scales, biases and the float MoE op's weights are counted with
        the given element sizes (default 4, fp32; pass 2 for fp16 / bf16 models).
        """
        H, I, N1 = self.hidden_size, self.inter_size, self.fc1_rows
        projs = [(N1, H, self.fc1_bits), (H, I, self.fc2_bits)]
        if self.has_fc3:
            projs.append((I, H, self.fc3_bits or self.fc1_bits))
        total = 0
        for n, kk, bits in projs:
            if not self.is_quantized:
                total += n * kk * float_weight_bytes
            else:
                total += n * (kk * bits // 8)
                nb = kk // self.block_size if self.block_size else 1
                total += n * nb * scale_bytes
                if self.has_zero_points:
                    if self.block_size:
                        total += n * ((nb * bits + 7) // 8)
                    else:
                        total += (n * bits + 7) // 8
            if self.has_bias:
                total += n * bias_bytes
        return total

    def supported_summary(self) -> str:
        if self.activation == "swiglu":
            fus = {0: "separate FC3", 1: "interleaved", 2: "concatenated"}[self.swiglu_fusion]
            act = f"swiglu ({fus})"
            if self.swiglu_limit is not None:
                act += f" limit {self.swiglu_limit:g}"
        else:
            act = self.activation + (" x FC3" if self.has_fc3 else "")
        if self.is_quantized:
            q = f"int{self.fc1_bits} " + (f"block {self.block_size}" if self.block_size else "per row")
        else:
            q = "float weights"
        route = "sparse mixer" if self.use_sparse_mixer else f"top-{self.k}"
        zp = "yes" if self.has_zero_points else "no"
        return f"{q}, {act}, {route}, zero points: {zp}"

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_node(node_name: str, op_type: str, attrs: dict, shapes: dict) -> "QMoESpec":
        attrs = dict(attrs or {})
        shapes = dict(shapes or {})
        op_type = _s(op_type)

        def fail(what: str):
            raise UnsupportedLayout(f"node '{node_name}': {what}")

        def present(name):
            return shapes.get(name) is not None

        if op_type not in ("QMoE", "MoE"):
            fail(f"op type '{op_type}' is not a QMoE/MoE node")
        quantized = op_type == "QMoE"

        activation = _s(attrs.get("activation_type", "relu")).lower()
        k = int(attrs.get("k", 1))
        normalize = bool(int(attrs.get("normalize_routing_weights", 0)))
        sparse = bool(int(attrs.get("use_sparse_mixer", 0)))
        fusion_attr = int(attrs.get("swiglu_fusion", 0))
        alpha = float(attrs.get("activation_alpha", 1.0))
        beta = float(attrs.get("activation_beta", 0.0))
        limit = attrs.get("swiglu_limit", None)
        limit = None if limit is None else float(limit)
        if limit is not None and not math.isfinite(limit):
            limit = None
        limit_after = int(attrs.get("swiglu_limit_after_activation", 0))

        # --- activation
        if activation in ("geglu", "relu2"):
            fail(f"activation '{activation}' is not supported yet (supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
        if activation not in _SUPPORTED_ACTIVATIONS:
            fail(f"activation '{activation}' is unknown (supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
        if limit_after:
            fail("swiglu_limit_after_activation=1 is not supported yet")
        if activation == "swiglu" and fusion_attr not in (0, 1, 2):
            fail(f"swiglu_fusion {fusion_attr} is unknown (supported: 0, 1, 2)")
        swiglu_fusion = fusion_attr if activation == "swiglu" else 0
        fusion = 2 if (activation == "swiglu" and swiglu_fusion in (1, 2)) else 1
        has_fc3 = present("fc3_experts_weights")
        if activation == "swiglu" and swiglu_fusion == 0 and not has_fc3:
            fail("swiglu with swiglu_fusion=0 needs fc3_experts_weights (the 'up' projection), which is absent")
        if activation == "swiglu" and swiglu_fusion in (1, 2) and has_fc3:
            fail(f"swiglu_fusion={swiglu_fusion} (gate/up fused in FC1) with a separate FC3 is not supported")

        # --- routing
        if k < 1:
            fail(f"k={k} is invalid")
        if sparse and k != 2:
            fail(f"use_sparse_mixer with k={k} is not supported (sparse mixer is top-2 only)")

        # --- quantisation
        quant_type = _s(attrs.get("quant_type", "int")).lower() if quantized else "float"
        if quantized and quant_type != "int":
            name = _QUANT_TYPE_NAMES.get(quant_type, quant_type)
            fail(f"quant_type '{name}' is not supported yet (supported: int4, int8)")
        for name, what in (("fc1_act_scale", "fp8 activation scales"), ("fc2_act_scale", "fp8 activation scales"),
                           ("fc1_act_block_scale", "fp8 activation block scales"),
                           ("fc2_act_block_scale", "fp8 activation block scales"),
                           ("fc1_global_scale", "global weight scales (fp4/fp8 layouts)"),
                           ("fc2_global_scale", "global weight scales (fp4/fp8 layouts)")):
            if present(name):
                fail(f"input '{name}' ({what}) is not supported yet")

        weights_prepacked = int(attrs.get("weights_prepacked", -1)) if quantized else 0
        block_size = 0
        fc1_bits = fc2_bits = 0
        fc3_bits = None
        if quantized:
            bits = int(attrs.get("expert_weight_bits", 4))
            b1 = int(attrs.get("fc1_expert_weight_bits", bits) if attrs.get("fc1_expert_weight_bits") is not None else bits)
            b2 = int(attrs.get("fc2_expert_weight_bits", bits) if attrs.get("fc2_expert_weight_bits") is not None else bits)
            b3 = int(attrs.get("fc3_expert_weight_bits", bits) if attrs.get("fc3_expert_weight_bits") is not None else bits)
            used = [b1, b2] + ([b3] if has_fc3 else [])
            for b in used:
                if b in (2, 3):
                    fail(f"int{b} weights are not supported yet (supported: int4, int8)")
                if b not in (4, 8):
                    fail(f"expert weight bits {b} is invalid (supported: int4, int8)")
            if len(set(used)) > 1:
                fail("mixed per-projection bit widths (" + ", ".join(
                    f"fc{i + 1} int{b}" for i, b in enumerate(used)) + ") are not supported yet")
            fc1_bits, fc2_bits = b1, b2
            fc3_bits = b3 if has_fc3 else None
            bs = attrs.get("block_size", None)
            block_size = 0 if bs is None else int(bs)
            if block_size < 0:
                block_size = 0
            if block_size and (block_size < 16 or block_size & (block_size - 1)):
                fail(f"block_size {block_size} is invalid (must be a power of two >= 16)")
            if weights_prepacked == 1:
                fail("prepacked weights (weights_prepacked=1, execution-provider layout) are not supported; "
                     "export with raw weights (weights_prepacked=0)")
            if weights_prepacked not in (-1, 0):
                fail(f"weights_prepacked={weights_prepacked} is invalid")
        else:
            for name in ("fc1_scales", "fc2_scales", "fc3_scales", "fc1_zero_points", "fc2_zero_points",
                         "fc3_zero_points"):
                if present(name):
                    fail(f"float MoE node has quantisation input '{name}'")
            if present("router_weights"):
                fail("float MoE node with router_weights is not supported")

        # --- sizes
        w1, w2, w3 = shapes.get("fc1_experts_weights"), shapes.get("fc2_experts_weights"), shapes.get("fc3_experts_weights")
        if w1 is None or w2 is None:
            fail("fc1_experts_weights and fc2_experts_weights are required")
        if len(w1) != 3 or len(w2) != 3 or (w3 is not None and len(w3) != 3):
            fail(f"expert weights must be 3-D (fc1 {tuple(w1)}, fc2 {tuple(w2)})")
        E = _dim(w1, 0) or _dim(w2, 0) or _dim(shapes.get("router_probs"), 1)
        if E is None:
            fail("cannot determine the number of experts from the shapes")
        H = _dim(shapes.get("input"), len(shapes["input"]) - 1) if shapes.get("input") is not None else None
        per1 = 8 // fc1_bits if quantized else 1
        per2 = 8 // fc2_bits if quantized else 1
        if H is None:
            H = _dim(w2, 1)
        if H is None:
            fail("cannot determine hidden_size from the shapes")
        I = None
        if _dim(w2, 2) is not None:
            I = _dim(w2, 2) * per2
        elif _dim(w1, 1) is not None:
            I = _dim(w1, 1) // fusion
        if I is None:
            fail("cannot determine inter_size from the shapes")

        def expect(name, want):
            got = shapes.get(name)
            if got is None:
                return
            got_t = tuple(got)
            if len(got_t) != len(want) or any(_dim(got_t, i) is not None and _dim(got_t, i) != w
                                              for i, w in enumerate(want)):
                hint = ""
                if quantized and name.endswith("experts_weights") and weights_prepacked == -1:
                    hint = " (weights_prepacked=-1: the weights may be in an execution-provider prepacked layout, " \
                           "which is not supported)"
                fail(f"input '{name}' has shape {got_t}, expected {tuple(want)} for "
                     f"E={E}, hidden={H}, inter={I}{hint}")

        N1 = fusion * I
        if quantized:
            expect("fc1_experts_weights", (E, N1, H // per1))
            expect("fc2_experts_weights", (E, H, I // per2))
            if has_fc3:
                expect("fc3_experts_weights", (E, I, H // (8 // fc3_bits)))
            if (H * fc1_bits) % 8 or (I * fc2_bits) % 8:
                fail(f"weight rows are not byte-aligned (hidden={H}, inter={I})")
            if block_size and (H % block_size or I % block_size):
                fail(f"hidden_size {H} and inter_size {I} must be divisible by block_size {block_size}")
            projs = [("fc1", N1, H, fc1_bits), ("fc2", H, I, fc2_bits)]
            if has_fc3:
                projs.append(("fc3", I, H, fc3_bits))
            for p, n, kk, b in projs:
                if shapes.get(f"{p}_scales") is None:
                    fail(f"input '{p}_scales' is required for int{b} weights")
                if block_size:
                    expect(f"{p}_scales", (E, n, kk // block_size))
                    expect(f"{p}_zero_points", (E, n, ((kk // block_size) * b + 7) // 8))
                else:
                    expect(f"{p}_scales", (E, n))
                    expect(f"{p}_zero_points", (E, (n * b + 7) // 8))
        else:
            expect("fc1_experts_weights", (E, N1, H))
            expect("fc2_experts_weights", (E, H, I))
            if has_fc3:
                expect("fc3_experts_weights", (E, I, H))
        expect("fc1_experts_bias", (E, N1))
        expect("fc2_experts_bias", (E, H))
        if has_fc3:
            expect("fc3_experts_bias", (E, I))
        rp = shapes.get("router_probs")
        if rp is not None and _dim(rp, len(rp) - 1) is not None and _dim(rp, len(rp) - 1) != E:
            fail(f"router_probs has {rp[-1]} experts, weights have {E}")
        if k > E:
            fail(f"k={k} exceeds the number of experts {E}")

        has_zp = any(present(f"fc{i}_zero_points") for i in (1, 2, 3)) if quantized else False
        has_bias = any(present(f"fc{i}_experts_bias") for i in (1, 2, 3))
        return QMoESpec(
            node_name=node_name, op_type=op_type, num_experts=E, hidden_size=H, inter_size=I, k=k,
            activation=activation, swiglu_fusion=swiglu_fusion, alpha=alpha, beta=beta, swiglu_limit=limit,
            normalize_routing_weights=normalize, use_sparse_mixer=sparse, quant_type=quant_type,
            fc1_bits=fc1_bits, fc2_bits=fc2_bits, fc3_bits=fc3_bits, block_size=block_size, has_fc3=has_fc3,
            has_zero_points=has_zp, has_bias=has_bias, weights_prepacked=weights_prepacked,
        )

    @staticmethod
    def from_tensors(node_name: str, op_type: str, attrs: dict, tensors: dict, x_shape=None) -> "QMoESpec":
        """Convenience: ``from_node`` with shapes taken from a dict of arrays (None = absent)."""
        shapes = {n: (None if tensors.get(n) is None else tuple(tensors[n].shape)) for n in QMOE_INPUT_NAMES}
        if x_shape is not None:
            shapes["input"] = tuple(x_shape)
        return QMoESpec.from_node(node_name, op_type, attrs, shapes)
