"""Static description of one com.microsoft QMoE / MoE node, as our kernels understand it.

``QMoESpec.from_node`` reads the ONNX attributes and input shapes, derives the expert count,
hidden and intermediate sizes and validates the layout of every projection:

- quant_type 'int': 2, 3, 4 or 8 bits per projection (fc1_/fc2_/fc3_expert_weight_bits may differ),
  raw LSB-first rows [E, N, ceil(K*bits/8)] or (int4 / int8) CUTLASS SM80 prepacked [E, K, N*bits/8]
  (weights_prepacked=1, or -1 when only the prepacked shapes fit); scales per row or per block, zero points;
- 'nvfp4': E2M1 codes, float8e4m3fn block-16 scales, per-expert global scales; N-packed [E, K, N/2]
  (weights_prepacked -1 / 0) or K-packed [E, N, K/2] bytes (weights_prepacked=1);
- 'fp4' (MXFP4): E2M1 codes [E, N, K/2], float8e8m0 block-32 scales, per-expert global scales;
- 'fp8': float8e4m3fn [E, N, K] with square block scales [E, ceil(N/bs), ceil(K/bs)] or a per-expert
  global scale;
- the float MoE op; activations relu, gelu, silu, identity, relu2, swiglu (fusion 0/1/2, limit before or
  after the activation), geglu (fusion 1/2, or FC1 gate + FC3 up).

What cannot be computed raises ``UnsupportedLayout`` with a one-line message naming the node and the
feature: FP8 activation quantisation (quant_type 'wfp4afp8', fc*_act_scale / fc*_act_block_scale: the
contract does not pin the runtime activation rounding, and the block scales depend on the token count),
and global-scaled layouts with a separate FC3 (the 1.32 contract has no fc3_global_scale input).

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

_SUPPORTED_ACTIVATIONS = ("relu", "gelu", "silu", "identity", "relu2", "swiglu", "geglu")
_GATED = ("swiglu", "geglu")
_QUANT_TYPES = ("int", "fp4", "nvfp4", "fp8")
_QUANT_NAMES = {"int": "int", "fp4": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8", "float": "float"}
_INT_BITS = (2, 3, 4, 8)
_FP4_BLOCK = {"fp4": 32, "nvfp4": 16}
_SCALE_FORMAT = {"int": "float", "fp4": "e8m0", "nvfp4": "e4m3", "float": "none"}
_PACKING_NAMES = {"raw": "", "sm80": "SM80 prepacked", "n_packed": "N-packed", "k_packed": "K-packed"}


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


def _row_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QMoESpec:
    node_name: str
    op_type: str  # "QMoE" or "MoE"
    num_experts: int
    hidden_size: int
    inter_size: int
    k: int
    activation: str  # relu, gelu, silu, identity, relu2, swiglu, geglu
    swiglu_fusion: int  # gate/up layout of swiglu / geglu: 0 FC1 + FC3, 1 interleaved, 2 [g | u]
    alpha: float
    beta: float
    swiglu_limit: float | None
    normalize_routing_weights: bool
    use_sparse_mixer: bool
    quant_type: str  # "int", "fp4" (MXFP4), "nvfp4", "fp8"; "float" for the float MoE op
    fc1_bits: int  # int: 2, 3, 4, 8; fp4 / nvfp4: 4; fp8: 8; float MoE: 0
    fc2_bits: int
    fc3_bits: int | None
    block_size: int  # int: K block (0 = one scale per row); fp4 32, nvfp4 16; fp8: square block (0 = global)
    has_fc3: bool
    has_zero_points: bool
    has_bias: bool
    weights_prepacked: int
    # layout details (defaults describe the int raw layout)
    packing: str = "raw"  # int: 'raw' | 'sm80'; nvfp4: 'n_packed' | 'k_packed'; fp4 / fp8: 'raw'; float MoE: 'raw'
    scale_format: str = "float"  # 'float' (the activation type T), 'e4m3', 'e8m0', 'none' (fp8 global / float MoE)
    has_global_scale: bool = False  # per-expert fc1/fc2 global scales multiply the weights
    swiglu_limit_after_activation: bool = False

    # ------------------------------------------------------------------ derived helpers
    @property
    def gated(self) -> bool:
        return self.activation in _GATED

    @property
    def fusion(self) -> int:
        """Row multiplier of FC1: 2 when gate and up are fused into FC1."""
        return 2 if (self.gated and self.swiglu_fusion in (1, 2)) else 1

    @property
    def fc1_rows(self) -> int:
        return self.fusion * self.inter_size

    @property
    def is_quantized(self) -> bool:
        return self.op_type == "QMoE"

    @property
    def projections(self) -> list[tuple[str, int, int, int]]:
        """(name, N, K, bits) of FC1, FC2 and (when present) FC3."""
        H, I = self.hidden_size, self.inter_size
        out = [("fc1", self.fc1_rows, H, self.fc1_bits), ("fc2", H, I, self.fc2_bits)]
        if self.has_fc3:
            out.append(("fc3", I, H, self.fc3_bits or self.fc1_bits))
        return out

    def proj_bits(self, proj: str) -> int:
        return {"fc1": self.fc1_bits, "fc2": self.fc2_bits, "fc3": self.fc3_bits or self.fc1_bits}[proj]

    @property
    def is_fast_int_layout(self) -> bool:
        """int4 / int8 raw rows (any mix of the two): the layout kernels/cpu/kernels.py reads directly."""
        return (self.quant_type == "int" and self.packing == "raw"
                and all(b in (4, 8) for _, _, _, b in self.projections))

    def expert_bytes(self, scale_bytes: int = 4, bias_bytes: int = 4, float_weight_bytes: int = 4) -> int:
        """Bytes of one expert's weights + scales + zero points + global scales + biases as stored.

        The spec knows shapes, not dtypes: float scales (int, fp8 blocks), biases and the float MoE op's weights
        are counted with the given element sizes (default 4, fp32; pass 2 for fp16 / bf16 models). float8 block
        scales are 1 byte, global scales 4 (float32).
        """
        total = 0
        for proj, n, kk, bits in self.projections:
            if not self.is_quantized:
                total += n * kk * float_weight_bytes
            elif self.quant_type == "fp8":
                total += n * kk
                if self.block_size:
                    total += _cdiv(n, self.block_size) * _cdiv(kk, self.block_size) * scale_bytes
            elif self.quant_type in _FP4_BLOCK:
                total += n * kk // 2 + n * (kk // self.block_size)
            else:
                total += n * _row_bytes(kk, bits)
                nb = kk // self.block_size if self.block_size else 1
                total += n * nb * scale_bytes
                if self.has_zero_points:
                    total += n * _row_bytes(nb, bits) if self.block_size else _row_bytes(n, bits)
            if self.has_global_scale and proj != "fc3":
                total += 4
            if self.has_bias:
                total += n * bias_bytes
        return total

    def layout_summary(self) -> str:
        """The weight layout in words, e.g. 'int4 block 32', 'nvfp4 K-packed (e4m3 block 16 x global)'."""
        if not self.is_quantized:
            return "float weights"
        if self.quant_type == "fp8":
            return ("fp8 e4m3 " + (f"square block {self.block_size}x{self.block_size} scales" if self.block_size
                                   else "per-expert global scale"))
        if self.quant_type in _FP4_BLOCK:
            name = _QUANT_NAMES[self.quant_type]
            pk = _PACKING_NAMES[self.packing]
            return f"{name}{' ' + pk if pk else ''} ({self.scale_format} block {self.block_size} x global scale)"
        bits = [b for _, _, _, b in self.projections]
        if len(set(bits)) == 1:
            q = f"int{bits[0]}"
        else:
            q = " / ".join(f"{p} int{b}" for p, _, _, b in self.projections)
        q += f" block {self.block_size}" if self.block_size else " per row"
        if self.packing == "sm80":
            q += " (SM80 prepacked)"
        return q

    def supported_summary(self) -> str:
        if self.gated:
            fus = {0: "separate FC3", 1: "interleaved", 2: "concatenated"}[self.swiglu_fusion]
            act = f"{self.activation} ({fus})"
            if self.activation == "swiglu" and self.swiglu_limit is not None:
                act += f" limit {self.swiglu_limit:g}"
                if self.swiglu_limit_after_activation:
                    act += " after activation"
        else:
            act = self.activation + (" x FC3" if self.has_fc3 else "")
        route = "sparse mixer" if self.use_sparse_mixer else f"top-{self.k}"
        zp = "yes" if self.has_zero_points else "no"
        return f"{self.layout_summary()}, {act}, {route}, zero points: {zp}"

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
        limit_after = bool(int(attrs.get("swiglu_limit_after_activation", 0))) and activation == "swiglu"

        # --- activation
        if activation not in _SUPPORTED_ACTIVATIONS:
            fail(f"activation '{activation}' is unknown (supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
        gated = activation in _GATED
        if gated and fusion_attr not in (0, 1, 2):
            fail(f"swiglu_fusion {fusion_attr} is unknown (supported: 0, 1, 2)")
        swiglu_fusion = fusion_attr if gated else 0
        fusion = 2 if (gated and swiglu_fusion in (1, 2)) else 1
        has_fc3 = present("fc3_experts_weights")
        if gated and swiglu_fusion == 0 and not has_fc3:
            fail(f"{activation} with swiglu_fusion=0 needs fc3_experts_weights (the 'up' projection), which is absent")
        if gated and swiglu_fusion in (1, 2) and has_fc3:
            fail(f"swiglu_fusion={swiglu_fusion} (gate/up fused in FC1) with a separate FC3 is not supported")

        # --- routing
        if k < 1:
            fail(f"k={k} is invalid")
        if sparse and k != 2:
            fail(f"use_sparse_mixer with k={k} is not supported (sparse mixer is top-2 only)")

        # --- quantisation type and the inputs it uses
        quant_type = _s(attrs.get("quant_type", "int")).lower() if quantized else "float"
        if quantized:
            if quant_type == "wfp4afp8":
                fail("quant_type 'wfp4afp8' (MXFP4 weights with FP8 activations) is not supported: it quantises "
                     "activations to FP8 at run time with rounding the contract does not pin down, and its "
                     "activation block scales depend on the token count")
            if quant_type not in _QUANT_TYPES:
                fail(f"quant_type '{quant_type}' is unknown (supported: int, fp4 (mxfp4), nvfp4, fp8)")
        qname = _QUANT_NAMES.get(quant_type, quant_type)
        for name in ("fc1_act_scale", "fc2_act_scale", "fc1_act_block_scale", "fc2_act_block_scale"):
            if present(name):
                what = "fp8 activation block scales" if "block" in name else "fp8 activation scales"
                fail(f"input '{name}' ({what}) is not supported: FP8 activation quantisation is CUDA-only and its "
                     f"run-time rounding is not defined by the contract")
        global_scaled = quant_type in _FP4_BLOCK or (quant_type == "fp8" and int(attrs.get("block_size", 0) or 0) <= 0)
        for name in ("fc1_global_scale", "fc2_global_scale"):
            if present(name) and quant_type in ("int", "float"):
                fail(f"input '{name}' (global weight scale) is only defined for fp4/nvfp4/fp8 weights, "
                     f"not {'int' if quantized else 'float'} weights")
            if global_scaled and not present(name):
                fail(f"{qname} weights need input '{name}' (per-expert global scale), which is absent")
        if global_scaled and has_fc3:
            fail(f"{qname} weights with a separate FC3 are not supported: the 1.32 contract has no "
                 f"fc3_global_scale input, so FC3's scale is undefined")
        if quant_type in ("fp4", "nvfp4", "fp8") and any(present(f"fc{i}_zero_points") for i in (1, 2, 3)):
            fail(f"zero points are not defined for {qname} weights")

        weights_prepacked = int(attrs.get("weights_prepacked", -1)) if quantized else 0
        if quantized and weights_prepacked not in (-1, 0, 1):
            fail(f"weights_prepacked={weights_prepacked} is invalid (supported: -1, 0, 1)")
        block_size = 0
        fc1_bits = fc2_bits = 0
        fc3_bits = None
        if quant_type == "int":
            bits = int(attrs.get("expert_weight_bits", 4))

            def eff(name):
                v = attrs.get(name)
                return bits if v is None else int(v)

            b1, b2, b3 = eff("fc1_expert_weight_bits"), eff("fc2_expert_weight_bits"), eff("fc3_expert_weight_bits")
            for b in [b1, b2] + ([b3] if has_fc3 else []):
                if b not in _INT_BITS:
                    fail(f"expert weight bits {b} is invalid (supported: int2, int3, int4, int8)")
            fc1_bits, fc2_bits = b1, b2
            fc3_bits = b3 if has_fc3 else None
            bs = attrs.get("block_size", None)
            block_size = max(0, 0 if bs is None else int(bs))
            if block_size and (block_size < 16 or block_size & (block_size - 1)):
                fail(f"block_size {block_size} is invalid (must be a power of two >= 16)")
        elif quant_type in _FP4_BLOCK:
            fc1_bits = fc2_bits = 4
            fc3_bits = 4 if has_fc3 else None
            block_size = _FP4_BLOCK[quant_type]  # normalised, whatever block_size says
        elif quant_type == "fp8":
            fc1_bits = fc2_bits = 8
            fc3_bits = 8 if has_fc3 else None
            block_size = max(0, int(attrs.get("block_size", 0) or 0))
        else:
            for name in ("fc1_scales", "fc2_scales", "fc3_scales", "fc1_zero_points", "fc2_zero_points",
                         "fc3_zero_points"):
                if present(name):
                    fail(f"float MoE node has quantisation input '{name}'")
            if present("router_weights"):
                fail("float MoE node with router_weights is not supported")

        # --- packing candidates (int -1: raw when its shapes fit, else SM80 prepacked)
        if quant_type == "int":
            candidates = {0: ["raw"], 1: ["sm80"], -1: ["raw", "sm80"]}[weights_prepacked]
        elif quant_type == "nvfp4":
            candidates = ["k_packed"] if weights_prepacked == 1 else ["n_packed"]
        else:
            candidates = ["raw"]

        w1, w2, w3 = shapes.get("fc1_experts_weights"), shapes.get("fc2_experts_weights"), shapes.get("fc3_experts_weights")
        if w1 is None or w2 is None:
            fail("fc1_experts_weights and fc2_experts_weights are required")
        if len(w1) != 3 or len(w2) != 3 or (w3 is not None and len(w3) != 3):
            fail(f"expert weights must be 3-D (fc1 {tuple(w1)}, fc2 {tuple(w2)})")
        E = _dim(w1, 0) or _dim(w2, 0) or _dim(shapes.get("router_probs"), 1)
        if E is None:
            fail("cannot determine the number of experts from the shapes")
        H_in = _dim(shapes.get("input"), len(shapes["input"]) - 1) if shapes.get("input") is not None else None

        errors = []
        for packing in candidates:
            try:
                H, I = _sizes(fail, quant_type, packing, fusion, fc1_bits, fc2_bits, w1, w2, shapes, H_in)
                _validate(fail, quant_type, packing, E, H, I, fusion, fc1_bits, fc2_bits, fc3_bits, block_size,
                          has_fc3, shapes, qname)
                break
            except UnsupportedLayout as exc:
                errors.append((packing, exc))
        else:
            packing, exc = errors[0]
            msg = str(exc)
            if quant_type == "int" and weights_prepacked == -1:
                msg += (" (weights_prepacked=-1: neither the raw layout nor the SM80 prepacked layout "
                        "[E, K, N*bits/8] fits these shapes)")
            raise UnsupportedLayout(msg) from None

        rp = shapes.get("router_probs")
        if rp is not None and _dim(rp, len(rp) - 1) is not None and _dim(rp, len(rp) - 1) != E:
            fail(f"router_probs has {rp[-1]} experts, weights have {E}")
        if k > E:
            fail(f"k={k} exceeds the number of experts {E}")

        has_zp = any(present(f"fc{i}_zero_points") for i in (1, 2, 3)) if quant_type == "int" else False
        has_bias = any(present(f"fc{i}_experts_bias") for i in (1, 2, 3))
        return QMoESpec(
            node_name=node_name, op_type=op_type, num_experts=E, hidden_size=H, inter_size=I, k=k,
            activation=activation, swiglu_fusion=swiglu_fusion, alpha=alpha, beta=beta, swiglu_limit=limit,
            normalize_routing_weights=normalize, use_sparse_mixer=sparse, quant_type=quant_type,
            fc1_bits=fc1_bits, fc2_bits=fc2_bits, fc3_bits=fc3_bits, block_size=block_size, has_fc3=has_fc3,
            has_zero_points=has_zp, has_bias=has_bias, weights_prepacked=weights_prepacked,
            packing=packing,
            scale_format=("float" if block_size else "none") if quant_type == "fp8" else _SCALE_FORMAT[quant_type],
            has_global_scale=global_scaled, swiglu_limit_after_activation=limit_after,
        )

    @staticmethod
    def from_tensors(node_name: str, op_type: str, attrs: dict, tensors: dict, x_shape=None) -> "QMoESpec":
        """Convenience: ``from_node`` with shapes taken from a dict of arrays (None = absent)."""
        shapes = {n: (None if tensors.get(n) is None else tuple(tensors[n].shape)) for n in QMOE_INPUT_NAMES}
        if x_shape is not None:
            shapes["input"] = tuple(x_shape)
        return QMoESpec.from_node(node_name, op_type, attrs, shapes)


# ---------------------------------------------------------------------- sizes and shape validation
def _sizes(fail, quant_type, packing, fusion, b1, b2, w1, w2, shapes, H):
    """(hidden, inter) read from the weight (and, for nvfp4 K-packed, scale) shapes of this layout."""
    if H is None:
        if packing == "sm80":
            H = _dim(w2, 2) and _dim(w2, 2) * 8 // b2
        elif packing == "n_packed":
            H = _dim(w2, 2) and _dim(w2, 2) * 2
        elif packing == "k_packed":
            H = _dim(shapes.get("fc2_scales"), 1)
        else:
            H = _dim(w2, 1)
        H = H or _dim(shapes.get("fc2_experts_bias"), 1)
    if H is None:
        fail("cannot determine hidden_size from the shapes")
    I = None
    if packing in ("sm80", "n_packed"):
        I = _dim(w2, 1)
    elif packing == "k_packed":
        s1 = _dim(shapes.get("fc1_scales"), 1)
        if s1 is not None and s1 % fusion == 0:
            I = s1 // fusion
        elif _dim(w2, 1) is not None and _dim(w2, 2) is not None:
            I = _dim(w2, 1) * _dim(w2, 2) * 2 // H
    elif quant_type in ("int",) and b2 in (2, 4, 8) and _dim(w2, 2) is not None:
        I = _dim(w2, 2) * 8 // b2
    elif quant_type in ("fp8", "float") and _dim(w2, 2) is not None:
        I = _dim(w2, 2)
    elif quant_type in _FP4_BLOCK and _dim(w2, 2) is not None:
        I = _dim(w2, 2) * 2
    if I is None and _dim(w1, 1) is not None and _dim(w1, 1) % fusion == 0:
        I = _dim(w1, 1) // fusion
    if I is None:
        fail("cannot determine inter_size from the shapes")
    return H, I


def _validate(fail, quant_type, packing, E, H, I, fusion, b1, b2, b3, block_size, has_fc3, shapes, qname):
    if quant_type == "int":
        widths = sorted({b1, b2} | ({b3} if has_fc3 else set()))
        qname = "/".join(f"int{b}" for b in widths)
    layout = qname + (f" {_PACKING_NAMES[packing]}" if _PACKING_NAMES.get(packing) else "")

    def expect(name, *wants):
        got = shapes.get(name)
        if got is None:
            return
        got_t = tuple(got)
        for want in wants:
            if len(got_t) == len(want) and all(_dim(got_t, i) is None or _dim(got_t, i) == w
                                               for i, w in enumerate(want)):
                return
        exp = " or ".join(str(tuple(w)) for w in wants)
        fail(f"input '{name}' has shape {got_t}, expected {exp} for {layout} weights with "
             f"E={E}, hidden={H}, inter={I}")

    N1 = fusion * I
    projs = [("fc1", N1, H, b1), ("fc2", H, I, b2)]
    if has_fc3:
        projs.append(("fc3", I, H, b3))
    quantized = quant_type != "float"
    for p, n, kk, b in projs:
        w = f"{p}_experts_weights"
        if not quantized or quant_type == "fp8":
            expect(w, (E, n, kk))
        elif quant_type == "int":
            if packing == "sm80":
                if b not in (4, 8):
                    fail(f"SM80 prepacked weights are int4 or int8, {p} is int{b}")
                if kk % 64 or n % 4:
                    fail(f"SM80 prepacked {p} needs K % 64 == 0 and N % 4 == 0 (N={n}, K={kk})")
                expect(w, (E, kk, n * b // 8))
            else:
                expect(w, (E, n, _row_bytes(kk, b)))
        else:
            blk = _FP4_BLOCK[quant_type]
            if kk % blk or n % 2:
                fail(f"{qname} {p} needs K % {blk} == 0 and an even N (N={n}, K={kk})")
            if packing == "n_packed":
                expect(w, (E, kk, n // 2))
            elif packing == "k_packed":  # K-packed bytes; the tensor may keep the logical [E, K, N/2] dims
                expect(w, (E, n, kk // 2), (E, kk, n // 2))
            else:
                expect(w, (E, n, kk // 2))
        if quantized:
            s = f"{p}_scales"
            if quant_type == "int":
                if shapes.get(s) is None:
                    fail(f"input '{s}' is required for int{b} weights")
                if block_size:
                    if H % block_size or I % block_size:
                        fail(f"hidden_size {H} and inter_size {I} must be divisible by block_size {block_size}")
                    expect(s, (E, n, kk // block_size))
                    expect(f"{p}_zero_points", (E, n, _row_bytes(kk // block_size, b)))
                else:
                    expect(s, (E, n))
                    expect(f"{p}_zero_points", (E, _row_bytes(n, b)))
            elif quant_type in _FP4_BLOCK:
                if shapes.get(s) is None:
                    fail(f"input '{s}' ({'e8m0' if quant_type == 'fp4' else 'e4m3'} block scales) is required "
                         f"for {qname} weights")
                expect(s, (E, n, kk // _FP4_BLOCK[quant_type]))
            elif block_size:
                if shapes.get(s) is None:
                    fail(f"input '{s}' is required for block-scaled fp8 weights (block_size {block_size})")
                expect(s, (E, _cdiv(n, block_size), _cdiv(kk, block_size)))
        expect(f"{p}_experts_bias", (E, n))
    for name in ("fc1_global_scale", "fc2_global_scale"):
        expect(name, (E,))
