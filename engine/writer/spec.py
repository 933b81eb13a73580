"""WriterSpec: the shape of a random-weight MoE model the writer produces, and its checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ACTIVATIONS = ("swiglu", "relu", "gelu", "silu", "identity")
DTYPES = ("float32", "float16")
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
    bits: int = 4
    block_size: int = 32                # 0 = one scale per output row
    zero_points: bool = False
    activation: str = "swiglu"
    swiglu_fusion: int = 1              # 0: FC1 gate + FC3 up, 1: interleaved [g0,u0,...], 2: [g | u]
    alpha: float = 1.702
    beta: float = 1.0
    swiglu_limit: float | None = 7.0
    expert_bias: bool = True
    dtype: str = "float32"              # activations, graph I/O, scales and biases
    quant_type: str = "int"
    seed: int = 0
    description: str = ""
    attention_sinks: bool = True        # gpt-oss's per-head attention sinks (GroupQueryAttention input 11)
    dense_accuracy_level: int = 4       # MatMulNBits accuracy_level: 4 (the builder's) quantises activations to int8

    # ---- derived -------------------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

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
        return dataclasses.asdict(self)

    # ---- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"WriterSpec: {msg}")

        need(self.dense_accuracy_level in (0, 1, 2, 3, 4), f"dense_accuracy_level must be 0..4, got {self.dense_accuracy_level}")
        if self.quant_type != "int" or self.bits not in (4, 8):
            raise ValueError(
                f"WriterSpec: only integer 4- or 8-bit experts can be written for now "
                f"(got quant_type={self.quant_type!r}, bits={self.bits})")
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
        if self.block_size:
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
