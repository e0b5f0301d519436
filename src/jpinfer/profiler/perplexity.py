"""Oracle-sparse perplexity: the dense model with each layer's inactive neurons zeroed.

This is the accuracy a perfect predictor would keep at given thresholds, so it separates
the cost of the sparsity level from the cost of predicting it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.models.params import Layer
from jpinfer.profiler import passes
from jpinfer.profiler.activity import Score, activation_and_score, check_score
from jpinfer.profiler.calibration import Calibration


@dataclasses.dataclass(frozen=True)
class OracleSparseFFN:
    """``ffn_impl`` keeping only neurons whose score exceeds the layer threshold (``ffn_state[l]``)."""

    cfg: ModelConfig
    score: str = "product"

    def __call__(self, i: int, layer: Layer, x: jax.Array, threshold: jax.Array) -> tuple[jax.Array, None]:
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        return transformer.ffn_down(layer, jnp.where(s > threshold, a, 0)), None


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl"))
def _nll_sum(weights, tokens, valid, thresholds, cfg, ffn_impl):
    """Summed next-token negative log-likelihood over the valid windows (B,) of a batch."""
    cache = transformer.KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, _, _ = transformer.forward(weights, tokens, cache, cfg, ffn_impl, thresholds)
    lg = transformer.logits(weights, h[:, :-1])
    nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll.sum(-1) * valid)


def perplexity(
    model: ModelArg,
    windows: Any,
    thresholds: Calibration | np.ndarray | None = None,
    *,
    score: Score = "product",
    batch_size: int = 4,
    progress: bool = False,
) -> float:
    """exp(mean next-token NLL) over windows, predicting every token after the first of each.

    ``thresholds`` None runs the dense model; otherwise neurons whose score is at most the
    layer's threshold are zeroed (a Calibration brings its own score).
    """
    loaded = resolve_model(model)
    cfg = loaded.cfg
    tokens = passes.as_tokens(windows, cfg.vocab_size)
    impl, thr = None, None
    if thresholds is not None:
        if isinstance(thresholds, Calibration):
            score, thresholds = thresholds.score, thresholds.thresholds
        check_score(score, cfg)
        thr = np.asarray(thresholds, np.float32)
        if thr.shape != (cfg.n_layers,):
            raise ValueError(f"thresholds must have one value per layer ({cfg.n_layers}), got shape {thr.shape}")
        impl, thr = OracleSparseFFN(cfg, score), jnp.asarray(thr)
    total = 0.0
    with tqdm(total=int(tokens.size), unit="tok", desc="perplexity", disable=not progress) as bar:
        for _, chunk, valid in passes.batches(tokens, batch_size):
            total += float(_nll_sum(loaded.weights, jnp.asarray(chunk), jnp.asarray(valid[:, 0]), thr, cfg, impl))
            bar.update(int(valid.sum()))
    return math.exp(total / (tokens.shape[0] * (tokens.shape[1] - 1)))
