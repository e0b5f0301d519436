"""Predictor quality end to end: the dense FFN with only the predicted neurons kept.

``PredictedMaskFFN`` is an ``ffn_impl`` for ``transformer.forward`` (and the engine's
``FfnStrategy``): every activation is computed densely, neurons the predictor did not pick
are zeroed. That is exactly what a sparse kernel computing only the predicted neurons
outputs (false positives contribute their true activation), so perplexity and greedy
tokens measured here are the sparse engine's, at dense speed. Per token it reports how
many neurons were predicted, truly active (score over the profile's threshold), and both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.params import Layer
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, select_neurons, selection_mask
from jpinfer.profiler.activity import activation_and_score


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MaskState:
    """One layer's traced state: its predictor and the activity threshold on |a| (for counting)."""

    predictor: PredictorWeights
    threshold: jax.Array


@dataclasses.dataclass(frozen=True)
class PredictedMaskFFN:
    """Static ``ffn_impl``; aux per token: ``predicted``, ``active`` and ``hits`` neuron counts.

    With ``capacity`` (one K per layer) at most K neurons are kept per token, the largest
    logits over the cut-off, as the sparse engine does (``select_neurons``); the aux then
    also counts ``clipped`` (predicted but over the capacity) and ``clipped_active`` (of
    those, the truly active ones: what the capacity cost in recall).
    """

    cfg: ModelConfig
    capacity: tuple[int, ...] | None = None

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: MaskState) -> tuple[jax.Array, dict[str, jax.Array]]:
        a, s = activation_and_score(layer, x, self.cfg, "product")
        logits = predict_logits(state.predictor, x)
        wanted = logits > state.predictor.cutoff
        active = s > state.threshold
        if self.capacity is None:
            predicted = wanted
        else:
            predicted = selection_mask(select_neurons(logits, state.predictor.cutoff, self.capacity[i]), self.cfg.d_ff)
        counts = {"predicted": predicted.sum(-1), "active": active.sum(-1), "hits": (predicted & active).sum(-1)}
        if self.capacity is not None:
            dropped = wanted & ~predicted
            counts |= {"clipped": dropped.sum(-1), "clipped_active": (dropped & active).sum(-1)}
        return transformer.ffn_down(layer, jnp.where(predicted, a, 0)), counts


def mask_states(predictors: list[PredictorWeights], thresholds) -> list[MaskState]:
    """The ``ffn_state`` list for ``PredictedMaskFFN``: per layer, predictor and threshold."""
    if len(predictors) != len(thresholds):
        raise ValueError(f"{len(predictors)} predictors for {len(thresholds)} layer thresholds")
    return [MaskState(p, jnp.float32(t)) for p, t in zip(predictors, thresholds)]
