"""Model architecture description shared by every stage.

One frozen, hashable dataclass, so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FfnKind = Literal["swiglu", "geglu", "reglu", "drelu", "relu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned"]

FFN_KINDS: tuple[str, ...] = ("swiglu", "geglu", "reglu", "drelu", "relu", "gelu")
UNGATED_KINDS: tuple[str, ...] = ("relu", "gelu")  # an up projection only (OPT, Falcon): bundles of 2 rows
ROPE_SCALINGS: tuple[str, ...] = ("linear", "llama3", "yarn", "factors", "dynamic", "longrope")
WEIGHT_FORMATS: tuple[str, ...] = ("float", "int8", "int4")  # jpinfer.load(weights=...); see jpinfer.models.quantized


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches its rotary embedding past the context it was trained on; the inverse
    frequencies it gives are ``models.rope.inverse_frequencies``.

    kind: ``linear`` (every frequency divided by ``factor``), ``llama3`` (Llama 3.1's: long wavelengths
    divided by ``factor``, short ones kept, a smooth ramp between, set by ``low_freq_factor`` and
    ``high_freq_factor`` against ``original_max_position``), ``yarn`` (YaRN, Peng et al., 2023: a ramp between
    divided and kept frequencies over the dimensions set by ``beta_fast`` / ``beta_slow`` rotations in
    ``original_max_position``, and cos/sin scaled by ``attention_factor``, 0.1 ln(factor) + 1 when None) or
    ``factors`` (each frequency divided by its own entry of ``frequency_factors``: llama.cpp's
    ``rope_freqs`` tensor, how GGUF files carry Llama 3.1's scaling) or ``dynamic`` (dynamic NTK: past
    ``original_max_position`` the base grows with the length L a step reaches, theta * (factor L / original -
    factor + 1) ^ (head_dim / (head_dim - 2)), applied to that step's new positions) or ``longrope`` (Phi-3's
    LongRoPE: each frequency divided by its entry of ``frequency_factors`` while a step reaches at most
    ``original_max_position`` positions, of ``long_factors`` past it; cos/sin times ``attention_factor``)."""

    kind: str
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    frequency_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()  # longrope's, past the original context

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"unsupported RoPE scaling {self.kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.kind in ("llama3", "yarn", "dynamic", "longrope") and not (self.original_max_position or 0) > 0:
            raise ValueError(f"RoPE scaling {self.kind!r} needs the original context length")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.kind in ("factors", "longrope") and not (self.frequency_factors and min(self.frequency_factors) > 0):
            raise ValueError("RoPE frequency factors must be given and positive")
        if self.kind == "longrope" and not (len(self.long_factors) == len(self.frequency_factors)
                                            and min(self.long_factors) > 0 and self.attention_factor):
            raise ValueError("LongRoPE needs as many positive long factors as short ones, and its attention factor")
        object.__setattr__(self, "frequency_factors", tuple(float(f) for f in self.frequency_factors))
        object.__setattr__(self, "long_factors", tuple(float(f) for f in self.long_factors))


@dataclasses.dataclass(frozen=True)
class ExpertRouting:
    """How a router's scores weigh the experts (``transformer.expert_weights``): a softmax over the routed experts,
    the top ``top_k`` kept (renormalized to sum 1 when ``renormalize``: Mixtral, Qwen-MoE with norm_topk_prob), the
    others zero; the last ``shared`` experts are a shared expert's neurons split into expert-sized pieces, always on,
    each weighed by the sigmoid of its own router row's score (Qwen2-MoE's shared_expert_gate, one row per piece).
    Static: the layouts that carry a router carry it (hashable)."""

    top_k: int
    renormalize: bool = True
    shared: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (the Llama family, the MoE families, Gemma 2 and 3, Falcon or OPT).

    Weight conventions (see models/params.py): every projection is stored as
    (out_features, in_features) and applied as W @ x; q|k|v and gate|up are fused.
    A mixture of experts (``n_experts`` > 0, Mixtral's form) is one FFN of ``d_ff`` neurons: every expert's
    ``expert_size`` neurons stacked in expert order, each neuron's activation times its expert's routing weight
    (zero for the experts the router does not pick), so every neuron-level tool sees the experts' neurons; a
    shared expert (Qwen2-MoE) is the last ``shared_experts`` of them, weighed by its gate (``ExpertRouting``).
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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    local_rope_theta: float | None = None  # Gemma 3: the RoPE base of the layers that slide (never scaled)
    max_position: int = 2048
    sliding_window: int | None = None  # Mistral: attend to the last N positions only
    window_layers: tuple[int, ...] | None = None  # the layers that slide (Gemma 2, Qwen2); None: all of them
    # OPT's learned position table is indexed with position + offset (2 in OPT).
    position_offset: int = 0
    qkv_bias: bool = False  # Qwen2, OPT
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key (head_dim weights) before RoPE
    qk_norm_whole: bool = False  # OLMoE: with qk_norm, one RMSNorm over the whole query (q_dim) and key (kv_dim)
    attn_out_bias: bool = False  # OPT
    attn_scale: float | None = None  # the scores' factor; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap) before the softmax
    logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    sandwich_norms: bool = False  # Gemma 2/3: an RMSNorm on the attention's and the FFN's outputs too
    parallel_block: bool = False  # Falcon: attention and FFN both read the layer's input; their sum is added
    embed_scale: float = 1.0  # input embeddings times it (not the tied head): Gemma's sqrt(d_model), GraniteMoE's
    residual_scale: float = 1.0  # GraniteMoE: the attention's and the FFN's outputs times it where added to the stream
    logit_divisor: float = 1.0  # GraniteMoE: the logits divided by it (logits_scaling)
    ffn_bias: bool = False  # OPT
    n_experts: int = 0  # Mixtral: experts per layer (0: one dense FFN); d_ff counts every expert's neurons
    experts_per_token: int = 0  # the router's top-k (``renormalize_experts``: its softmax over those k)
    renormalize_experts: bool = True  # False (Qwen-MoE, OLMoE: norm_topk_prob false): the top-k keep their softmax
    shared_experts: int = 0  # Qwen2-MoE: the last experts are its shared expert's pieces, always on (``ExpertRouting``)
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # llama | mistral | qwen2 | qwen3 | phi3 | gemma2 | gemma3 | falcon | opt | mixtral | qwen3_moe | qwen2_moe | olmoe
    # | granitemoe: informative for the decoder; the HF loader reads it to find the checkpoint's tensors
    architecture: str = "llama"
    name: str = "model"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from JSON (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.window_layers is not None:  # a list when read back from JSON
            object.__setattr__(self, "window_layers", tuple(int(i) for i in self.window_layers))
            if self.sliding_window is None or not all(0 <= i < self.n_layers for i in self.window_layers):
                raise ValueError(f"window_layers {self.window_layers} need a sliding_window and layers in "
                                 f"0..{self.n_layers - 1}")
        if self.local_rope_theta is not None and self.sliding_window is None:
            raise ValueError("local_rope_theta is the base of the layers that slide: it needs a sliding_window")
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
        routed = self.n_experts - self.shared_experts
        if self.n_experts and not (self.d_ff % self.n_experts == 0 and 1 <= self.experts_per_token <= routed):
            raise ValueError(f"{self.n_experts} experts need d_ff ({self.d_ff}, every expert's neurons) divisible by "
                             f"them and 1 <= experts_per_token <= the {routed} routed ones, got "
                             f"{self.experts_per_token}")
        if not 0 <= self.shared_experts < max(self.n_experts, 1):
            raise ValueError(f"shared_experts ({self.shared_experts}) must leave routed experts among {self.n_experts}")
        if self.experts_per_token and not self.n_experts:
            raise ValueError("experts_per_token needs n_experts")
        factors = self.rope_scaling.frequency_factors if self.rope_scaling else ()
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(f"{len(factors)} RoPE frequency factors for head_dim {self.head_dim} "
                             f"({self.head_dim // 2} frequencies)")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier position)."""
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def expert_size(self) -> int:
        """Neurons of one expert (the whole FFN's d_ff without experts)."""
        return self.d_ff // max(self.n_experts, 1)

    @property
    def routing_rule(self) -> ExpertRouting | None:
        """How the router weighs the experts (``transformer.expert_weights``), None without experts."""
        if not self.n_experts:
            return None
        return ExpertRouting(self.experts_per_token, self.renormalize_experts, self.shared_experts)

    @property
    def experts(self) -> tuple[int, ExpertRouting] | None:
        """(neurons per expert, routing rule), None without experts (``threshold_layout.from_layer``'s)."""
        return (self.expert_size, self.routing_rule) if self.n_experts else None

    @property
    def has_gate(self) -> bool:
        """Whether the FFN has a gate projection (all kinds but OPT's and Falcon's ungated ones)."""
        return self.ffn_kind not in UNGATED_KINDS

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
