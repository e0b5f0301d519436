"""Model architecture description shared by every stage.

One frozen, hashable dataclass, so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FfnKind = Literal["swiglu", "reglu", "drelu", "relu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned"]

FFN_KINDS: tuple[str, ...] = ("swiglu", "reglu", "drelu", "relu")
WEIGHT_FORMATS: tuple[str, ...] = ("float", "int8", "int4")  # jpinfer.load(weights=...); see jpinfer.models.quantized


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama family or OPT).

    Weight conventions (see models/params.py): every projection is stored as
    (out_features, in_features) and applied as W @ x; q|k|v and gate|up are fused.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    ffn_kind: FfnKind = "swiglu"
    norm_kind: NormKind = "rmsnorm"
    norm_eps: float = 1e-5
    positions: PositionKind = "rope"
    rope_theta: float = 10000.0
    max_position: int = 2048
    sliding_window: int | None = None  # Mistral: attend to the last N positions only
    # OPT's learned position table is indexed with position + offset (2 in OPT).
    position_offset: int = 0
    qkv_bias: bool = False  # Qwen2, OPT
    attn_out_bias: bool = False  # OPT
    ffn_bias: bool = False  # OPT
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"  # informative: llama | mistral | qwen2 | opt
    name: str = "model"

    def __post_init__(self) -> None:
        if self.ffn_kind not in FFN_KINDS:
            raise ValueError(
                f"unsupported FFN activation kind {self.ffn_kind!r}; supported: {', '.join(FFN_KINDS)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")

    @property
    def has_gate(self) -> bool:
        """Whether the FFN has a gate projection (all kinds but OPT's plain ReLU)."""
        return self.ffn_kind != "relu"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
