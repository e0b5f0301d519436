"""Per-layer activation frequencies: checking them, synthesising them, reading them from .npy.

A frequency is the fraction of profiled tokens for which a neuron was active (count /
tokens, in [0, 1]). Until the profiler's measurements exist, benches use a Zipf-like
synthetic law whose skew is a parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def check_frequencies(freqs: Sequence[np.ndarray] | np.ndarray, n_neurons: int | None = None) -> list[np.ndarray]:
    """Float64 copies, one 1-D array per layer; a ValueError says what is wrong."""
    layers = [np.asarray(f, np.float64) for f in freqs]
    if not layers:
        raise ValueError("frequencies: need one array per layer, got none")
    for index, f in enumerate(layers):
        if f.ndim != 1 or f.size == 0:
            raise ValueError(f"frequencies[{index}] must be a non-empty 1-D array, got shape {f.shape}")
        if n_neurons is not None and f.size != n_neurons:
            raise ValueError(f"frequencies[{index}] has {f.size} neurons, but the model has {n_neurons} per layer")
        if not np.all(np.isfinite(f)) or f.min() < 0 or f.max() > 1:
            raise ValueError(
                f"frequencies[{index}] must lie in [0, 1] (activation count / tokens); "
                f"got range [{np.nanmin(f)}, {np.nanmax(f)}]"
            )
    if sum(f.sum() for f in layers) == 0:
        raise ValueError("frequencies are all zero: profile more tokens before placing neurons")
    return layers


def synthetic_frequencies(
    n_layers: int,
    n_neurons: int,
    *,
    skew: float = 1.2,
    mean_active: float = 0.1,
    layer_spread: float = 0.15,
    seed: int = 0,
) -> list[np.ndarray]:
    """Zipf-like frequencies: the neuron of rank r is active with probability min(1, c r^-s).

    Per layer the exponent s and the mean activation rate vary by +-``layer_spread``
    around ``skew`` and ``mean_active`` (c is solved for the mean), and the ranks are
    shuffled over neuron ids. The defaults put 80% of the mass in the hottest ~28% of
    neurons, near the PowerInfer paper's 26% for OPT-30B.
    """
    if n_layers < 1 or n_neurons < 1:
        raise ValueError(f"n_layers and n_neurons must be >= 1, got {n_layers}, {n_neurons}")
    if skew <= 0 or not 0 < mean_active < 1 or not 0 <= layer_spread < 1:
        raise ValueError("need skew > 0, 0 < mean_active < 1 and 0 <= layer_spread < 1")
    rng = np.random.default_rng(seed)
    rank = np.arange(1, n_neurons + 1, dtype=np.float64)
    out = []
    for _ in range(n_layers):
        s = skew * rng.uniform(1 - layer_spread, 1 + layer_spread)
        mean = min(0.99, mean_active * rng.uniform(1 - layer_spread, 1 + layer_spread))
        decay = rank**-s
        lo, hi = np.log(mean), np.log(mean) + s * np.log(n_neurons) + 1  # mean(f) below / above target
        for _ in range(60):  # bisection on log c
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.minimum(1.0, np.exp(mid) * decay).mean() < mean else (lo, mid)
        out.append(rng.permutation(np.minimum(1.0, np.exp(hi) * decay)))
    return out


def hottest_first(frequencies: np.ndarray) -> np.ndarray:
    """A layer's neuron ids by descending frequency, ties by id (int32): the order placement groups follow, and
    a layout stored hottest first."""
    return np.argsort(-np.asarray(frequencies), kind="stable").astype(np.int32)


def load_frequencies(path: str | Path) -> list[np.ndarray]:
    """A (n_layers, n_neurons) .npy array of frequencies, as one array per layer."""
    array = np.load(path, allow_pickle=False)
    if array.ndim != 2:
        raise ValueError(f"{path}: expected a (n_layers, n_neurons) array, got shape {array.shape}")
    return check_frequencies(list(array))
