"""Perplexity of a model with any FFN strategy, and the oracle-sparse perplexity.

``evaluate`` (``profiler.passes``) measures a model whose FFN is an ``ffn_impl`` (dense when None) over
token windows.
``perplexity`` with thresholds is the dense model with each layer's inactive neurons zeroed
(``masked.ScoreMaskFFN``): the accuracy a perfect predictor would keep at those thresholds, which
separates the cost of the sparsity level from the cost of predicting it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jpinfer.ffn.masked import ScoreMaskFFN
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.profiler.activity import Score, check_score
from jpinfer.profiler.calibration import Calibration
from jpinfer.profiler.passes import evaluate


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
