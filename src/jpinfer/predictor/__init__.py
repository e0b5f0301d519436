"""Activation predictors: per layer, a small MLP guessing which FFN neurons fire.

``train_predictors(model, profile) -> Predictors`` is the entry point (jpinfer.train_predictors).
Modules: mlp (the predictor as run-time arrays), train (one layer: the Flax nnx model, optax
training, cut-off for a target recall), sizing (adaptive width per layer under a parameter budget),
fit (all layers), store (versioned, verified orbax checkpoints tied to model and profile). The
strategies that run predictors in the decoder live in ``jpinfer.ffn``.
"""

from jpinfer.predictor.fit import SearchConfig, retune, train_predictors
from jpinfer.predictor.mlp import (
    PredictorWeights,
    Selection,
    predict_logits,
    routed_logits,
    select_neurons,
    selection_mask,
)
from jpinfer.predictor.store import PredictorError, PredictorMismatchError, Predictors, profile_fingerprint
from jpinfer.predictor.train import LayerData, LayerPredictor, Scores, TrainConfig, cutoff_for_recall, train_layer

__all__ = [
    "train_predictors", "retune", "SearchConfig", "TrainConfig", "Predictors", "PredictorError",
    "PredictorMismatchError", "PredictorWeights", "LayerPredictor", "predict_logits", "routed_logits", "select_neurons",
    "selection_mask", "Selection", "train_layer", "LayerData", "Scores", "cutoff_for_recall", "profile_fingerprint",
]
