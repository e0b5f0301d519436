"""Perplexity of a model with any FFN strategy, and the oracle-sparse perplexity.

``evaluate`` measures a model whose FFN is an ``ffn_impl`` (dense when None) over token windows.
``perplexity`` with thresholds is the dense model with each layer's inactive neurons zeroed
(``masked.ScoreMaskFFN``): the accuracy a perfect predictor would keep at those thresholds, which
separates the cost of the sparsity level from the cost of predicting it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer.ffn.masked import ScoreMaskFFN
from jpinfer.models import transformer
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.profiler import passes
from jpinfer.profiler.activity import Score, check_score
from jpinfer.profiler.calibration import Calibration


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl"))
def _nll_sum(weights, tokens, valid, ffn_state, cfg, ffn_impl):
    """Summed next-token NLL over the valid windows (B,) of a batch, and per-layer aux
    sums over the valid windows' tokens (every aux leaf is (B, T))."""
    cache = transformer.KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, _, aux = transformer.forward(weights, tokens, cache, cfg, ffn_impl, ffn_state)
    lg = transformer.logits(weights, h[:, :-1], cfg)
    nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]
    aux_sums = jax.tree_util.tree_map(lambda a: jnp.sum(a * valid[:, None], dtype=jnp.float32), aux)
    return jnp.sum(nll.sum(-1) * valid), aux_sums


def evaluate(
    model: ModelArg,
    windows: Any,
    ffn_impl: transformer.FfnImpl | None = None,
    ffn_state: Any = None,
    *,
    batch_size: int = 4,
    progress: bool = False,
) -> tuple[float, Any]:
    """(perplexity, aux sums) of the model with ``ffn_impl`` as its FFN (None: dense).

    Perplexity is exp(mean next-token NLL) over the windows, predicting every token after
    the first of each. ``ffn_impl``'s per-layer aux must be a pytree of (B, T) arrays (e.g.
    per-token neuron counts); each is summed over all real tokens (float32, exact to 2^24).
    """
    loaded = resolve_model(model)
    tokens = passes.as_tokens(windows, loaded.cfg.vocab_size)
    total, sums = 0.0, None
    with tqdm(total=int(tokens.size), unit="tok", desc="perplexity", disable=not progress) as bar:
        for _, chunk, valid in passes.batches(tokens, batch_size):
            nll, aux = _nll_sum(loaded.weights, jnp.asarray(chunk), jnp.asarray(valid[:, 0]), ffn_state, loaded.cfg,
                                ffn_impl)
            total += float(nll)
            aux = jax.tree_util.tree_map(float, aux)
            sums = aux if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, aux)
            bar.update(int(valid.sum()))
    return math.exp(total / (tokens.shape[0] * (tokens.shape[1] - 1))), sums


def perplexity(
    model: ModelArg,
    windows: Any,
    thresholds: Calibration | np.ndarray | None = None,
    *,
    score: Score = "product",
    batch_size: int = 4,
    progress: bool = False,
) -> float:
    """Perplexity (see ``evaluate``) of the dense model, or with ``thresholds`` of the model
    whose neurons with score at most the layer's threshold are zeroed (a Calibration brings
    its own score)."""
    loaded = resolve_model(model)
    cfg = loaded.cfg
    impl, thr = None, None
    if thresholds is not None:
        if isinstance(thresholds, Calibration):
            score, thresholds = thresholds.score, thresholds.thresholds
        check_score(score, cfg)
        thr = np.asarray(thresholds, np.float32)
        if thr.shape != (cfg.n_layers,):
            raise ValueError(f"thresholds must have one value per layer ({cfg.n_layers}), got shape {thr.shape}")
        impl, thr = ScoreMaskFFN(cfg, score), jnp.asarray(thr)
    return evaluate(loaded, windows, impl, thr, batch_size=batch_size, progress=progress)[0]
