"""WriterSpec: the shape of a random-weight MoE model the writer produces, and its checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ACTIVATIONS = ("swiglu", "relu", "gelu", "silu", "identity", "geglu", "relu2")
# bfloat16 is not offered: onnxruntime's CPU MatMulNBits (the dense layers) has no bfloat16 kernel, so a
# bfloat16 model could not run; single-node QMoE tests cover bfloat16 activations (tests/qmoe_oracle.py).
DTYPES = ("float32", "float16")
QUANT_TYPES = ("int", "fp4", "nvfp4", "fp8")   # fp4 = MXFP4 (e8m0 block-32 scales)
NVFP4_PACKINGS = ("k_packed", "n_packed")
# Expert-layout fields added after the first release: left out of to_dict() (README, model metadata) while
# they hold their defaults, so models of the original layouts stay byte-identical.
_LAYOUT_DEFAULTS = {"fc1_bits": None, "fc2_bits": None, "fc3_bits": None, "prepacked": False,
                    "nvfp4_packing": "k_packed", "swiglu_limit_after_activation": False}
MIN_VOCAB = 256 + 3  # the 256 byte symbols plus <|endoftext|>, <|start|>, <|end|>


@dataclass(frozen=True)
class WriterSpec:
    layers: int = 2
    hidden_size: int = 128
    num_experts: int = 8
    top_k: int = 2
    inter_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    vocab_size: int = 512               # >= the tokenizer's size; extra ids are valid but never produced by it
    context_length: int = 2048
    sliding_window: int | None = None   # window of the even layers (like gpt-oss); None = all layers full
    bits: int = 4                       # int experts: 2, 3, 4 or 8 (dense MatMulNBits layers: 4 unless 8)
    block_size: int = 32                # int: K block, 0 = one scale per output row; fp8: square block, 0 = global
                                        # scale per expert; fp4 / nvfp4: fixed 32 / 16, this field is ignored
    zero_points: bool = False
    activation: str = "swiglu"
    swiglu_fusion: int = 1              # 0: FC1 gate + FC3 up, 1: interleaved [g0,u0,...], 2: [g | u]
    alpha: float = 1.702
    beta: float = 1.0
    swiglu_limit: float | None = 7.0
    expert_bias: bool = True
    dtype: str = "float32"              # activations, graph I/O, scales and biases
    quant_type: str = "int"             # int, fp4 (MXFP4), nvfp4, fp8 (e4m3)
    seed: int = 0
    description: str = ""
    attention_sinks: bool = True        # gpt-oss's per-head attention sinks (GroupQueryAttention input 11)
    dense_accuracy_level: int = 4       # MatMulNBits accuracy_level: 4 (the builder's) quantises activations to int8
    fc1_bits: int | None = None         # int: per-projection widths (fc*_expert_weight_bits); None = bits
    fc2_bits: int | None = None
    fc3_bits: int | None = None
    prepacked: bool = False             # int4 / int8: CUTLASS SM80 prepacked [E, K, N*bits/8], weights_prepacked=1
    nvfp4_packing: str = "k_packed"     # nvfp4: K-packed [E, N, K/2] (weights_prepacked=1) or legacy N-packed [E, K, N/2]
    swiglu_limit_after_activation: bool = False  # swiglu: clamp the activated gate instead of the gate input

    # ---- derived -------------------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        """Gate and up projections (swiglu, geglu)."""
        return self.activation in ("swiglu", "geglu")

    def projection_bits(self, proj: str) -> int:
        """Effective width of 'fc1' / 'fc2' / 'fc3' (fp4 / nvfp4: 4, fp8: 8)."""
        if self.quant_type in ("fp4", "nvfp4"):
            return 4
        if self.quant_type == "fp8":
            return 8
        return {"fc1": self.fc1_bits, "fc2": self.fc2_bits, "fc3": self.fc3_bits}[proj] or self.bits

    @property
    def dense_bits(self) -> int:
        """Width of the dense MatMulNBits layers: the expert width when it is 4 or 8, else 4."""
        return self.bits if self.quant_type == "int" and self.bits in (4, 8) else 4

    @property
    def fc1_rows(self) -> int:
        """Rows (N) of the FC1 tensor: 2*I when gate and up are fused, else I."""
        return 2 * self.inter_size if self.gated and self.swiglu_fusion in (1, 2) else self.inter_size

    @property
    def has_fc3(self) -> bool:
        return self.gated and self.swiglu_fusion == 0

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and layer % 2 == 0

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_sliding(i)]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name, default in _LAYOUT_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    # ---- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"WriterSpec: {msg}")

        need(self.dense_accuracy_level in (0, 1, 2, 3, 4), f"dense_accuracy_level must be 0..4, got {self.dense_accuracy_level}")
        need(self.quant_type in QUANT_TYPES, f"quant_type must be one of {QUANT_TYPES} (got {self.quant_type!r})")
        if self.quant_type == "int":
            for name in ("bits", "fc1_bits", "fc2_bits", "fc3_bits"):
                b = getattr(self, name)
                need(b is None and name != "bits" or b in (2, 3, 4, 8),
                     f"{name} must be 2, 3, 4 or 8 for integer experts (got {b!r})")
        else:
            need(self.fc1_bits is None and self.fc2_bits is None and self.fc3_bits is None,
                 f"per-projection bits are for integer experts, not quant_type {self.quant_type!r}")
        if self.prepacked:
            need(self.quant_type == "int" and all(self.projection_bits(p) in (4, 8) for p in ("fc1", "fc2", "fc3")),
                 "prepacked (SM80) weights must be int4 or int8")
            need(self.hidden_size % 64 == 0 and self.inter_size % 64 == 0,
                 "prepacked (SM80) weights need hidden_size and inter_size divisible by 64")
        need(self.nvfp4_packing in NVFP4_PACKINGS, f"nvfp4_packing must be one of {NVFP4_PACKINGS}")
        if self.quant_type in ("fp4", "nvfp4"):
            blk = 32 if self.quant_type == "fp4" else 16
            need(self.hidden_size % blk == 0 and self.inter_size % blk == 0,
                 f"{self.quant_type} needs hidden_size and inter_size divisible by {blk}")
        if self.quant_type in ("fp4", "nvfp4") or self.quant_type == "fp8" and not self.block_size:
            need(not self.has_fc3, f"{self.quant_type} with global scales cannot have a separate FC3 "
                                   "(the QMoE contract has no fc3_global_scale); use swiglu_fusion 1 or 2")
        need(not (self.zero_points and self.quant_type != "int"), "zero points are for integer experts only")
        need(not (self.activation == "geglu" and self.swiglu_fusion == 0),
             "geglu needs fused gate/up weights (swiglu_fusion 1 or 2)")
        for name in ("layers", "hidden_size", "num_experts", "top_k", "inter_size", "num_heads",
                     "num_kv_heads", "head_size", "vocab_size", "context_length"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive integer (got {getattr(self, name)!r})")
        need(self.top_k <= self.num_experts, f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        need(self.head_size % 2 == 0, f"head_size ({self.head_size}) must be even (rotary embedding)")
        need(self.vocab_size >= MIN_VOCAB, f"vocab_size must be >= {MIN_VOCAB} (256 bytes + 3 special tokens)")
        need(self.hidden_size % 2 == 0 and self.inter_size % 2 == 0,
             "hidden_size and inter_size must be even (two int4 codes per byte)")
        if self.block_size and self.quant_type == "fp8":
            need(self.block_size > 0, f"block_size must be >= 0 (got {self.block_size})")
        elif self.block_size and self.quant_type == "int":
            bs = self.block_size
            need(bs >= 16 and bs & (bs - 1) == 0, f"block_size must be 0 or a power of two >= 16 (got {bs})")
            need(self.hidden_size % bs == 0 and self.inter_size % bs == 0,
                 f"hidden_size ({self.hidden_size}) and inter_size ({self.inter_size}) must be divisible "
                 f"by block_size ({bs})")
        need(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS} (got {self.activation!r})")
        need(self.swiglu_fusion in (0, 1, 2), f"swiglu_fusion must be 0, 1 or 2 (got {self.swiglu_fusion})")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES} (got {self.dtype!r})")
        if self.sliding_window is not None:
            need(0 < self.sliding_window <= self.context_length,
                 f"sliding_window must be in 1..context_length (got {self.sliding_window})")
