"""Masked strategies: the dense FFN with some neurons' activations zeroed.

Every activation is computed densely, so these run at dense speed; what they output is exactly
what a sparse kernel computing only the kept neurons outputs (the down projection is a sum over
neurons). They measure a sparsity's accuracy apart from its speed.

- ``ScoreMaskFFN``: keeps the neurons whose activity score exceeds the layer's threshold: the
  accuracy a perfect predictor would keep at those thresholds (the profiler's oracle perplexity).
- ``PredictorMaskFFN``: keeps the neurons the predictor picks (false positives contribute their
  true activation), within the engine's capacities when given: the ``sparse`` and ``hybrid``
  modes' decode-step FFN over whole windows. Per token it counts how many neurons were
  predicted, truly active (score over the profile's threshold), both, and clipped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.params import Layer
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, routed_logits, select_neurons, selection_mask
from jpinfer.profiler.activity import Score, activation_and_score


@dataclasses.dataclass(frozen=True)
class ScoreMaskFFN:
    """Static ``ffn_impl`` keeping only the neurons whose ``score`` exceeds the layer's threshold
    (``ffn_state[layer]``, a float32 scalar)."""

    cfg: ModelConfig
    score: Score = "product"

    def __call__(self, i: int, layer: Layer, x: jax.Array, threshold: jax.Array) -> tuple[jax.Array, None]:
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        return transformer.ffn_down(layer, jnp.where(s > threshold, a, 0)), None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MaskState:
    """One layer's traced state: its predictor, the activity threshold on |a| (for counting) and,
    for the hybrid's selection, the accelerator part (boolean (d_ff,); None: one part)."""

    predictor: PredictorWeights
    threshold: jax.Array
    hot: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PredictorMaskFFN:
    """Static ``ffn_impl``; aux per token: ``predicted``, ``active`` and ``hits`` neuron counts.

    With ``capacity`` (one K per layer) at most K neurons are kept per token, the largest
    logits over the cut-off, as the sparse engine does (``select_neurons``); the aux then
    also counts ``clipped`` (predicted but over the capacity) and ``clipped_active`` (of
    those, the truly active ones: what the capacity cost in recall). With one (hot K, cold K)
    pair per layer and the states' ``hot`` parts, each part keeps at most its K, as the hybrid
    engine selects. A K of None (or of d_ff or more) clips nothing: every neuron over the cut-off
    is kept without a selection (a top-k per token is most of this FFN's time otherwise).
    """

    cfg: ModelConfig
    capacity: tuple[int | None, ...] | tuple[tuple[int | None, int | None], ...] | None = None

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: MaskState) -> tuple[jax.Array, dict[str, jax.Array]]:
        a, s = activation_and_score(layer, x, self.cfg, "product")
        logits = routed_logits(predict_logits(state.predictor, x), layer.router, x, self.cfg.routing_rule)
        wanted = logits > state.predictor.cutoff
        active = s > state.threshold
        if self.capacity is None:
            predicted = wanted
        elif state.hot is None:
            predicted = self._keep(logits, wanted, state.predictor.cutoff, self.capacity[i])
        else:  # each part selects among its own neurons (the other part's logits out of reach)
            predicted = jnp.zeros_like(wanted)
            for part, k in zip((state.hot, ~state.hot), self.capacity[i]):
                if k != 0:
                    predicted = predicted | self._keep(jnp.where(part, logits, -jnp.inf), wanted & part,
                                                       state.predictor.cutoff, k)
        counts = {"predicted": predicted.sum(-1), "active": active.sum(-1), "hits": (predicted & active).sum(-1)}
        if self.capacity is not None:
            dropped = wanted & ~predicted
            counts |= {"clipped": dropped.sum(-1), "clipped_active": (dropped & active).sum(-1)}
        return transformer.ffn_down(layer, jnp.where(predicted, a, 0)), counts

    def _keep(self, logits: jax.Array, wanted: jax.Array, cutoff: jax.Array, k: int | None) -> jax.Array:
        """At most ``k`` of the ``wanted`` neurons, the largest logits (all of them when k is None or >= d_ff)."""
        if k is None or k >= self.cfg.d_ff:
            return wanted
        return selection_mask(select_neurons(logits, cutoff, k), self.cfg.d_ff)


def mask_states(predictors: list[PredictorWeights], thresholds, hot_masks=None) -> list[MaskState]:
    """The ``ffn_state`` list for ``PredictorMaskFFN``: per layer, predictor and threshold (and the
    hybrid's accelerator mask, boolean (d_ff,), when ``hot_masks`` are given)."""
    if len(predictors) != len(thresholds):
        raise ValueError(f"{len(predictors)} predictors for {len(thresholds)} layer thresholds")
    hot_masks = [None] * len(predictors) if hot_masks is None else [jnp.asarray(m, bool) for m in hot_masks]
    return [MaskState(p, jnp.float32(t), hot) for p, t, hot in zip(predictors, thresholds, hot_masks)]
