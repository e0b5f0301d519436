"""Capacities: the static number K of neurons a token may compute per layer, validated in one place.

A jitted step needs static shapes, so each listed strategy computes at most K neurons per token and
layer (the list's length; its valid count is traced). K comes from data (``layer_capacities``: the
predictors' held-out selections, or a quantile of the profile's active counts) rounded up to whole
``BLOCK``s, or is given; in the hybrid each part gets K times its share of the layer's activations
(``part_capacities``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.errors import JpinferError

BLOCK = 32  # capacities are rounded up to whole blocks of the sparse kernels (Pallas blocks, CPU loop chunks)
Capacity = str | float | int | Sequence[int]  # what ``jpinfer.load(capacity=...)`` accepts


def whole_blocks(k: float) -> int:
    """k rounded up to whole blocks of ``BLOCK`` neurons."""
    return int(math.ceil(k / BLOCK) * BLOCK)


def per_layer(capacity: int | Sequence[int], cfg: ModelConfig) -> tuple[int, ...]:
    """One K per layer (an int: the same K for every layer), each in [1, d_ff]; a ``JpinferError``
    (a ``ValueError``) otherwise. Every listed strategy's capacities pass through here."""
    if isinstance(capacity, (int, np.integer)):
        ks = (int(capacity),) * cfg.n_layers
    else:
        ks = tuple(int(k) for k in capacity)
    if len(ks) != cfg.n_layers:
        raise JpinferError(f"got {len(ks)} capacities for a model with {cfg.n_layers} layers")
    if any(not 1 <= k <= cfg.d_ff for k in ks):
        raise JpinferError(f"capacities must lie in [1, d_ff={cfg.d_ff}], got {list(ks)}")
    return ks


def layer_capacities(cfg: ModelConfig, capacity: Capacity, profile: Any = None, predictors: Any = None
                     ) -> tuple[int, ...]:
    """Per-layer K, rounded up to ``BLOCK`` and at most d_ff when derived from data.

    ``capacity``: "predicted" the 0.99 quantile of the neurons the ``predictors`` pick per token on
    their held-out samples (they rarely clip); a float in (0, 1] that quantile of the ``profile``'s
    active counts (tighter: a predictor picks more neurons than are active, so this clips);
    an int one K for every layer; a sequence one K per layer.
    """
    if isinstance(capacity, str):
        if capacity != "predicted":
            raise JpinferError(f"capacity must be 'predicted', a quantile, an int or one int per layer, "
                               f"got {capacity!r}")
        scores = (predictors.meta.get("held_out_scores") if predictors is not None else None) or []
        if len(scores) != cfg.n_layers or any(s.get("predicted_q99") is None for s in scores):
            raise JpinferError("capacity='predicted' needs predictors scored on held-out samples with per-token "
                               "counts (train them, or jpinfer.predictor.retune them, with this jpinfer version), "
                               "or give the capacity as a profile quantile or an integer")
        return per_layer([min(whole_blocks(max(s["predicted_q99"], 1)), cfg.d_ff) for s in scores], cfg)
    if isinstance(capacity, float):
        if profile is None:
            raise JpinferError("capacity as a quantile needs the profile (profile=...); or give K as an integer")
        if not 0 < capacity <= 1:
            raise JpinferError(f"capacity quantile must lie in (0, 1], got {capacity}")
        return per_layer([int(k) for k in profile.capacity(capacity, multiple=BLOCK)], cfg)
    return per_layer(capacity, cfg)


def part_capacities(ks: Sequence[int], hot_masks: Sequence[np.ndarray], frequency: np.ndarray | None
                    ) -> tuple[tuple[int, int], ...]:
    """(hot K, cold K) per layer: K split by each part's share of the layer's activations (profile
    frequencies; uniform without them), each rounded up to ``BLOCK`` and at most its part's size."""
    out = []
    for layer, (k, hot) in enumerate(zip(ks, hot_masks)):
        n_hot, n_cold = int(hot.sum()), int((~hot).sum())
        if k >= hot.size:
            out.append((n_hot, n_cold))
            continue
        f = np.ones(hot.size) if frequency is None else np.asarray(frequency[layer], np.float64)
        share = float(f[hot].sum() / max(f.sum(), 1e-30))
        out.append((min(n_hot, whole_blocks(k * share)), min(n_cold, whole_blocks(k * (1 - share)))))
    return tuple(out)
