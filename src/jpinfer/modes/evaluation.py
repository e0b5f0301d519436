"""An engine's decode step as an FFN strategy over many tokens at once: its accuracy on a text.

The predictor modes prefill densely (a prompt needs nearly every neuron), so a perplexity
measured through the engine itself would measure dense prefill, not what it computes per
decoded token. ``decode_equivalent`` returns the (model, strategy) whose forward pass over token
windows computes, for each token, the FFN the engine's decode step would compute for it:

- sparse: the dense FFN keeping only the neurons the predictor selects within the engine's
  capacities (``ffn.PredictorMaskFFN``, exactly the sparse op's sum over that list), which
  also counts the neurons the capacities clipped;
- hybrid with predictors: the same, each part (accelerator, CPU) selecting within its own capacity;
- threshold (one device or split): the threshold FFN, whose several-token path zeroes the same
  entries one token's decode skips;
- dense and the rest: the engine's own strategy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.ffn import PredictorListFFN, PredictorMaskFFN, ThresholdLayer, ThresholdRowsFFN, mask_states
from jpinfer.models.loading import LoadedModel
from jpinfer.modes.hybrid import HybridFFN, HybridLayer
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.sparse import threshold_layout


def decode_equivalent(engine: Engine, dense: LoadedModel, activity_thresholds: np.ndarray | None = None
                      ) -> tuple[LoadedModel, FfnStrategy]:
    """(model, FFN strategy) computing ``engine``'s decode-step FFN for every token of a batch.

    ``dense`` is the same model with its dense FFN (the predictor modes keep their FFN neuron-major
    and drop the decoder's matrices); ``activity_thresholds`` (per layer, on |a|; default 0) only
    decide which selected or clipped neurons count as truly active in the masked FFN's aux.
    """
    cfg = dense.cfg
    activity = np.zeros(cfg.n_layers) if activity_thresholds is None else np.asarray(activity_thresholds)
    if isinstance(engine.ffn.impl, HybridFFN):
        parts = engine.ffn.state
        if parts[0].predictor is None:  # threshold sparsity split by the placement
            states = [_threshold_state(layer, part, cfg) for layer, part in zip(dense.weights.layers, parts)]
            impl = ThresholdRowsFFN(head_threshold=engine.ffn.impl.head_threshold)
            return dense, FfnStrategy(impl, states, "threshold (hybrid)")
        hot = [np.isin(np.arange(cfg.d_ff), np.asarray(part.hot_ids)) for part in parts]
        states = mask_states([part.predictor for part in parts], activity, hot)
        # a part's K of its whole size clips nothing: None skips the selection (exact, and fast)
        capacity = tuple(tuple(None if k >= n else k for k, n in zip(ks, (part.hot_ids.size, part.cold_ids.size)))
                         for ks, part in zip(engine.ffn.impl.capacity, parts))
        return dense, FfnStrategy(PredictorMaskFFN(cfg, capacity), states, "hybrid (masked)")
    if isinstance(engine.ffn.impl, PredictorListFFN):
        states = mask_states([state.predictor for state in engine.ffn.state], activity)
        return dense, FfnStrategy(PredictorMaskFFN(cfg, engine.ffn.impl.capacity), states, "sparse (masked)")
    return engine.model, engine.ffn


def _threshold_state(layer, part: HybridLayer, cfg: ModelConfig) -> ThresholdLayer:
    """The whole layer's threshold FFN with the thresholds the hybrid's parts apply, and its attention's."""
    hot = part.hot
    pick = lambda on, value: float(jnp.asarray(value)) if on else None
    return ThresholdLayer(threshold_layout.from_layer(
        layer, cfg.ffn_kind, input_threshold=pick(hot.input_sparse, hot.input_threshold),
        activation_threshold=pick(hot.activation_sparse, hot.activation_threshold), experts=cfg.experts), part.qkv,
        part.o)
