"""What "active" means for an FFN neuron, in one place (docs/architecture.md).

A neuron's activation is a = act(gate . x) * (up . x) (gated kinds) or relu(up . x)
(OPT). It is active on a token when its *score* exceeds the layer's threshold:

- ``"product"`` (default): score = |a|. For ReLU kinds with threshold 0 this is exactly
  "non-zero", so one rule covers every kind; SwiGLU and GeGLU models get calibrated thresholds.
- ``"gate"``: score = |act(gate . x)|, the gate alone (CATS). Kept to reproduce the
  comparison in bench/results/sparsity_ppl.md, where it measured far worse than the product.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jpinfer.activations import activate, gate_activation
from jpinfer.config import ModelConfig
from jpinfer.models.params import Layer
from jpinfer.models.transformer import expert_routing, gate_and_up

Score = Literal["product", "gate"]
SCORES: tuple[str, ...] = ("product", "gate")


def check_score(score: str, cfg: ModelConfig) -> None:
    """Reject an unknown score, or the gate score for a model without a gate."""
    if score not in SCORES:
        raise ValueError(f"unknown activity score {score!r}; choose one of {', '.join(SCORES)}")
    if score == "gate" and not cfg.has_gate:
        raise ValueError(f"score='gate' needs a gated FFN; this model's FFN kind is {cfg.ffn_kind!r}")


def activation_and_score(layer: Layer, x: jax.Array, cfg: ModelConfig, score: Score, *,
                         routed_by: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-neuron activation a (..., d_ff) and the non-negative score compared with the threshold. With experts
    both carry the routing weight: the neurons of experts the router does not pick score 0. The router reads
    ``routed_by`` (default x: the threshold mode routes on the whole input when gate and up skip some of it)."""
    gate, up = gate_and_up(layer, x, cfg)
    routing = expert_routing(layer, x if routed_by is None else routed_by, cfg)
    route = (lambda v: v) if routing is None else (lambda v: v * routing)
    a = route(activate(cfg.ffn_kind, gate, up))
    if score == "product":
        return a, jnp.abs(a)
    return a, jnp.abs(route(gate_activation(cfg.ffn_kind, gate)))


