"""Memory accounting: what must sit on the accelerator before any FFN neuron, and what a neuron costs.

A neuron is one gate row (when the FFN has a gate), one up row and one down column,
plus its up bias when the FFN has biases. Everything else a decoding step reads is the
"dense part": attention projections and biases, norms, the FFN output bias, the
embedding table, the lm_head (unless tied), predictors and the KV cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

from jpinfer.config import ModelConfig
from jpinfer.errors import JpinferError

DensePolicy = Literal["offload", "strict"]
DENSE_POLICIES = ("offload", "strict")


class InfeasibleBudgetError(JpinferError):
    """The accelerator budget cannot hold even the part that must live there."""

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Byte sizes the placement needs, however they were obtained.

    neuron_bytes: one FFN neuron (gate row + up row + down column [+ up bias]).
    layer_dense_bytes: per layer, attention projections and biases, norms, FFN output bias.
    lm_head_bytes: 0 when the lm_head is tied to the embedding table (``tied``).
    other_bytes: final norm and learned position table.
    act_bytes: one element of a hidden state moved between the devices.
    """

    n_layers: int
    n_neurons: int
    d_model: int
    neuron_bytes: int
    layer_dense_bytes: int
    embed_bytes: int
    lm_head_bytes: int
    other_bytes: int
    kv_cache_bytes: int
    predictor_bytes: tuple[int, ...]
    tied: bool = False
    act_bytes: int = 2

    def __post_init__(self) -> None:
        for field in ("n_layers", "n_neurons", "d_model", "neuron_bytes", "act_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSizes.{field} must be >= 1, got {getattr(self, field)}")
        for field in ("layer_dense_bytes", "embed_bytes", "lm_head_bytes", "other_bytes", "kv_cache_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"ModelSizes.{field} must be >= 0, got {getattr(self, field)}")
        if len(self.predictor_bytes) != self.n_layers or min(self.predictor_bytes) < 0:
            raise ValueError(
                f"ModelSizes.predictor_bytes needs one size >= 0 per layer ({self.n_layers}), "
                f"got {self.predictor_bytes}"
            )
        if self.tied and self.lm_head_bytes:
            raise ValueError("a tied lm_head has no bytes of its own: set lm_head_bytes=0 when tied=True")

    @property
    def ffn_bytes(self) -> int:
        """All FFN neurons of the model."""
        return self.n_layers * self.n_neurons * self.neuron_bytes

    @property
    def required_bytes(self) -> int:
        """Dense bytes that always live on the accelerator (everything but embedding and lm_head)."""
        return (
            self.n_layers * self.layer_dense_bytes + self.other_bytes + sum(self.predictor_bytes) + self.kv_cache_bytes
        )


def model_sizes(
    cfg: ModelConfig,
    *,
    weight_bytes: float = 2.0,
    context: int = 2048,
    batch: int = 1,
    kv_bytes: float = 2.0,
    predictor_bytes: int | Sequence[int] = 0,
    vector_bytes: float = 4.0,
    act_bytes: int = 2,
) -> ModelSizes:
    """Sizes of ``cfg`` with matrices stored at ``weight_bytes`` per element.

    weight_bytes may be fractional for quantised weights (4.5 bits with scales = 0.5625).
    Norm scales and biases are kept at ``vector_bytes``; the KV cache holds ``context``
    positions for ``batch`` sequences at ``kv_bytes`` per element.
    """
    if weight_bytes <= 0 or kv_bytes <= 0 or vector_bytes <= 0:
        raise ValueError("weight_bytes, kv_bytes and vector_bytes must be > 0")
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be >= 1, got context={context}, batch={batch}")
    if isinstance(predictor_bytes, int):
        predictor_bytes = (predictor_bytes,) * cfg.n_layers
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim

    def mat(n: int) -> int:
        return math.ceil(n * weight_bytes)

    def vec(n: int) -> int:
        return math.ceil(n * vector_bytes)

    norm = 2 if cfg.norm_kind == "layernorm" else 1  # scale (+ bias)
    layer_vectors = (4 if cfg.sandwich_norms else 2) * norm * d  # attention and FFN norms (and their outputs')
    layer_vectors += ((q + kv) if cfg.qk_norm_whole else 2 * cfg.head_dim) if cfg.qk_norm else 0
    layer_vectors += (q + 2 * kv) if cfg.qkv_bias else 0
    layer_vectors += d if cfg.attn_out_bias else 0
    layer_vectors += d if cfg.ffn_bias else 0  # b_down
    neuron = mat((3 if cfg.has_gate else 2) * d) + (vec(1) if cfg.ffn_bias else 0)
    positions = (cfg.max_position + cfg.position_offset) * d if cfg.positions == "learned" else 0
    return ModelSizes(
        n_layers=cfg.n_layers,
        n_neurons=cfg.d_ff,
        d_model=d,
        neuron_bytes=neuron,
        layer_dense_bytes=mat(2 * d * q + 2 * d * kv) + vec(layer_vectors),
        embed_bytes=mat(cfg.vocab_size * d),
        lm_head_bytes=0 if cfg.tie_embeddings else mat(d * cfg.vocab_size),
        other_bytes=vec(norm * d) + mat(positions),
        kv_cache_bytes=math.ceil(2 * cfg.n_layers * kv * context * batch * kv_bytes),
        predictor_bytes=tuple(int(p) for p in predictor_bytes),
        tied=cfg.tie_embeddings,
        act_bytes=act_bytes,
    )


@dataclasses.dataclass(frozen=True)
class DenseSplit:
    """Where the dense part lives: bytes on the accelerator and the tables moved to the CPU."""

    accel_bytes: int
    cpu_parts: tuple[str, ...]
    budget: int

    @property
    def ffn_budget(self) -> int:
        """Accelerator bytes left for FFN neurons."""
        return self.budget - self.accel_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def split_dense(sizes: ModelSizes, budget: int, policy: DensePolicy = "offload") -> DenseSplit:
    """Place the dense part under ``budget`` bytes.

    Policy ``offload``: if everything does not fit, move the embedding table to the CPU
    (a row lookup per token), then the lm_head (logits on the CPU); attention, norms,
    predictors and the KV cache always stay. Policy ``strict``: no moves. When the
    remaining part still does not fit, raise ``InfeasibleBudgetError`` with the minimum.
    """
    if policy not in DENSE_POLICIES:
        raise ValueError(f"unknown dense policy {policy!r}; choose from {', '.join(DENSE_POLICIES)}")
    movable = [("embed", sizes.embed_bytes)]
    if not sizes.tied:
        movable.append(("lm_head", sizes.lm_head_bytes))
    accel = sizes.required_bytes + sum(b for _, b in movable)
    cpu_parts: list[str] = []
    if policy == "offload":
        for name, nbytes in movable:
            if accel <= budget:
                break
            accel -= nbytes
            cpu_parts.append(name)
    if accel > budget:
        what = "attention weights, norms, predictors and the KV cache"
        if policy == "offload":
            what += " (embedding table and lm_head already moved to the CPU)"
        else:
            what += ", the embedding table and the lm_head"
        raise InfeasibleBudgetError(
            f"accelerator budget {budget} B ({_gib(budget)}) is below the minimum {accel} B "
            f"({_gib(accel)}) needed for {what}; raise the budget to at least {_gib(accel)} "
            f"or shorten the context / batch of the KV cache ({_gib(sizes.kv_cache_bytes)})",
            minimum_bytes=accel,
        )
    return DenseSplit(accel_bytes=accel, cpu_parts=tuple(cpu_parts), budget=budget)
