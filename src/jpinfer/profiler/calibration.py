"""Per-layer activity thresholds for a target FFN sparsity s (fraction of neurons skipped).

1. ``score_histogram``: one pass over calibration windows collects, per layer, a fixed-size
   histogram of the neuron scores (|silu(g)*u| by default). Bins are read off the float32
   bit pattern: 64 per octave (at most 1.6% wide), from 2^-32 to 2^16, so quantiles need no stored
   values and memory does not grow with the corpus.
2. ``uniform``: every layer skips the fraction s (its s-quantile is the threshold).
3. ``greedy``: layers skip different fractions averaging s. ``sensitivity`` estimates, on
   held-out windows, the loss increase of skipping each layer's sub-threshold neurons at a
   grid of levels: with lambda scaling the removed part of layer l's FFN output, the
   per-window derivative d = dL_w/dlambda = -sum_t sum_i a_ti * dL_w/da_ti [score_ti <= tau]
   (one backward pass gives all layers and levels), and the Fisher estimate of the loss
   increase is 1/2 sum_w d_w^2 (Kwon et al. 2022, "A Fast Post-Training Pruning Framework
   for Transformers"). ``greedy`` then raises, one level at a time, the layer whose next
   level costs least, until the mean sparsity reaches s.

The same histograms and estimates serve input sparsity (``INPUT``: the magnitudes |x_j| of the
FFN input, the derivative taken with respect to x): ``jpinfer.profiler.sparsity``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer.config import ModelConfig
from jpinfer.models import quantized, transformer
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.models.params import Layer
from jpinfer.profiler import passes
from jpinfer.profiler.activity import Score, activation_and_score, check_score

MANTISSA_BITS = 6
MIN_EXPONENT, MAX_EXPONENT = -32, 16
N_BINS = (MAX_EXPONENT - MIN_EXPONENT) << MANTISSA_BITS
_SHIFT = 23 - MANTISSA_BITS
_FIRST = (127 + MIN_EXPONENT) << MANTISSA_BITS
DEFAULT_LEVELS = tuple(round(0.025 * k, 3) for k in range(40))  # sparsity levels 0, 0.025, ..., 0.975


def bin_index(score: jax.Array) -> jax.Array:
    """Histogram bin of non-negative float32 scores (below 2^-32 -> 0, above 2^16 -> last)."""
    bits = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.int32)
    return jnp.clip((bits >> _SHIFT) - _FIRST, 0, N_BINS - 1)


def bin_edges() -> np.ndarray:
    """(N_BINS + 1,) float64 bin edges; the first bin starts at 0."""
    bits = ((np.arange(N_BINS + 1, dtype=np.int64) + _FIRST) << _SHIFT).astype(np.int32)
    edges = bits.view(np.float32).astype(np.float64)
    edges[0] = 0.0
    return edges


@dataclasses.dataclass(frozen=True)
class ScoreHistogram:
    """Per-layer histogram (n_layers, N_BINS) of neuron scores over calibration tokens."""

    counts: np.ndarray
    score: str
    n_tokens: int

    def threshold(self, layer: int, sparsity: float) -> float:
        """The score under which a fraction ``sparsity`` of the layer's values lies (interpolated in the bin)."""
        row = self.counts[layer]
        target = sparsity * row.sum()
        if target <= 0:
            return 0.0
        cum = np.cumsum(row)
        b = int(np.searchsorted(cum, target, side="left"))
        before = cum[b - 1] if b else 0
        edges = bin_edges()
        return float(edges[b] + (edges[b + 1] - edges[b]) * (target - before) / row[b])

    def thresholds(self, sparsity: np.ndarray) -> np.ndarray:
        return np.array([self.threshold(l, float(s)) for l, s in enumerate(sparsity)], np.float32)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Thresholds (n_layers,) and the fraction of neurons each layer skips on the calibration data."""

    thresholds: np.ndarray
    layer_sparsity: np.ndarray
    target: float
    method: str
    score: str

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "method": self.method, "score": self.score,
                "layer_sparsity": [float(s) for s in self.layer_sparsity]}


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """Estimated held-out loss increase ``cost`` (n_layers, n_levels) of skipping each layer's
    lowest ``levels`` fraction of scores, alone; ``n_tokens`` held-out tokens measured.
    ``first_order`` (same shape) is the summed derivative, kept for inspection."""

    levels: np.ndarray
    cost: np.ndarray
    n_tokens: int
    first_order: np.ndarray | None = None


INPUT = "input"  # the histogram of the FFN input magnitudes |x_j| (input sparsity), beside a neuron score's


@dataclasses.dataclass(frozen=True)
class _HistogramFFN:
    """Dense FFN that also histograms its neuron scores and its input magnitudes |x_j| (invalid
    tokens go to a dropped bin)."""

    cfg: ModelConfig
    score: str

    def __call__(self, i: int, layer: Layer, x: jax.Array, state) -> tuple[jax.Array, jax.Array]:
        _, valid, _ = state
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        count = lambda v: jnp.bincount(jnp.where(valid[..., None], bin_index(v), N_BINS).ravel(),
                                       length=N_BINS + 1)[:N_BINS]
        return transformer.ffn_down(layer, a), jnp.stack([count(s), count(jnp.abs(x))])


def _check_sparsity(sparsity: float) -> float:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity is the fraction of neurons skipped: give 0 <= s < 1, got {sparsity!r}")
    return float(sparsity)


def histograms(
    model: ModelArg, windows: Any, *, score: Score = "product", batch_size: int = 4, progress: bool = False
) -> tuple[ScoreHistogram, ScoreHistogram]:
    """Histograms of every layer's neuron scores and of its FFN input magnitudes (score
    ``INPUT``) over token windows, from one dense pass."""
    loaded = resolve_model(model)
    check_score(score, loaded.cfg)
    tokens = passes.as_tokens(windows, loaded.cfg.vocab_size)
    counts = np.zeros((2, loaded.cfg.n_layers, N_BINS), np.int64)
    thresholds = np.zeros(loaded.cfg.n_layers, np.float32)
    collector = _HistogramFFN(loaded.cfg, score)
    for _, _, aux in passes.run(loaded, tokens, collector, thresholds, batch_size, progress, "calibrating"):
        counts += np.stack(aux, axis=1)
    return ScoreHistogram(counts[0], score, int(tokens.size)), ScoreHistogram(counts[1], INPUT, int(tokens.size))


def score_histogram(
    model: ModelArg, windows: Any, *, score: Score = "product", batch_size: int = 4, progress: bool = False
) -> ScoreHistogram:
    """Histogram the neuron scores of every layer over token windows (one dense pass)."""
    return histograms(model, windows, score=score, batch_size=batch_size, progress=progress)[0]


def uniform(hist: ScoreHistogram, sparsity: float) -> Calibration:
    """Every layer skips the same fraction ``sparsity`` of its neuron scores."""
    s = np.full(len(hist.counts), _check_sparsity(sparsity))
    return Calibration(hist.thresholds(s), s, float(sparsity), "uniform", hist.score)


@dataclasses.dataclass(frozen=True)
class _PerturbableFFN:
    """Dense FFN plus an additive zero probe: on the output (its gradient is dL/dy; aux = (a,
    score)) or, for score ``INPUT``, on the input (its gradient is dL/dx; aux = (x, |x|))."""

    cfg: ModelConfig
    score: str

    def __call__(self, i: int, layer: Layer, x: jax.Array, probe: jax.Array):
        if self.score == INPUT:
            x = x + probe
            return transformer.ffn_dense(layer, x, self.cfg), (x, jnp.abs(x))
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        return transformer.ffn_down(layer, a) + probe, (a, s)


@functools.partial(jax.jit, static_argnames=("cfg", "score"))
def _window_derivatives(weights, tokens, valid, level_thresholds, cfg, score):
    """(B, n_layers, n_levels): dL_w/dlambda for removing each layer's sub-threshold part."""
    b, t = tokens.shape
    probes = [jnp.zeros((b, t, cfg.d_model), weights.dtype) for _ in range(cfg.n_layers)]
    impl = _PerturbableFFN(cfg, score)

    def loss(probes):
        cache = transformer.KVCache.create(cfg, b, t, weights.dtype)
        h, _, aux = transformer.forward(weights, tokens, cache, cfg, impl, probes)
        lg = transformer.logits(weights, h[:, :-1], cfg)
        nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * valid[:, None]), aux

    grads, aux = jax.grad(loss, has_aux=True)(probes)
    out = []
    for l, (a, s) in enumerate(aux):  # contrib: each entry times dL/d(entry); removing it costs -contrib
        dl_da = grads[l] if score == INPUT else grads[l] @ quantized.as_float(weights.layers[l].w_down, grads[l].dtype)
        contrib = (a * dl_da).astype(jnp.float32)
        thr = level_thresholds[l]
        out.append(jnp.stack([-jnp.where(s <= thr[k], contrib, 0).sum((1, 2)) for k in range(thr.shape[0])], -1))
    return jnp.stack(out, 1)


def sensitivity(
    model: ModelArg,
    windows: Any,
    hist: ScoreHistogram,
    *,
    levels: tuple[float, ...] = DEFAULT_LEVELS,
    batch_size: int = 2,
    progress: bool = False,
) -> Sensitivity:
    """Fisher estimate, on held-out windows, of each layer's loss increase at each sparsity level
    of ``hist``'s score: skipping neurons, or FFN input dimensions for score ``INPUT``."""
    loaded = resolve_model(model)
    tokens = passes.as_tokens(windows, loaded.cfg.vocab_size)
    levels_arr = np.asarray(levels, np.float64)
    if levels_arr[0] != 0 or np.any(np.diff(levels_arr) <= 0) or levels_arr[-1] >= 1:
        raise ValueError("levels must increase from 0 and stay below 1")
    level_thr = jnp.asarray(np.stack([hist.thresholds(np.full(len(hist.counts), s)) for s in levels_arr], 1))
    squares = np.zeros((loaded.cfg.n_layers, len(levels_arr)))
    first = np.zeros_like(squares)
    with tqdm(total=int(tokens.size), unit="tok", desc="sensitivity", disable=not progress) as bar:
        for _, chunk, valid in passes.batches(tokens, batch_size):
            d = _window_derivatives(
                loaded.weights, jnp.asarray(chunk), jnp.asarray(valid[:, 0]), level_thr, loaded.cfg, hist.score
            )
            d = np.asarray(d, np.float64)[valid[:, 0]]
            squares += np.square(d).sum(0)
            first += d.sum(0)
            bar.update(int(valid.sum()))
    return Sensitivity(levels_arr, 0.5 * squares, int(tokens.size), first)


def greedy(hist: ScoreHistogram, sens: Sensitivity, sparsity: float) -> Calibration:
    """Layer sparsities averaging ``sparsity``, raised one level at a time where the estimated cost is least."""
    target = _check_sparsity(sparsity)
    levels = sens.levels
    if target > levels[-1]:
        raise ValueError(f"greedy allocation reaches at most sparsity {levels[-1]}; lower the target or add levels")
    cost = np.maximum.accumulate(sens.cost, axis=1)  # skipping more never helps; removes noise dips
    n_layers, rows = len(cost), np.arange(len(cost))
    level = np.zeros(n_layers, int)
    last = None
    while levels[level].mean() < target - 1e-12:
        nxt = np.minimum(level + 1, len(levels) - 1)
        rate = (cost[rows, nxt] - cost[rows, level]) / np.maximum(levels[nxt] - levels[level], 1e-12)
        last = int(np.argmin(np.where(nxt > level, rate, np.inf)))
        level[last] += 1
    s = levels[level].astype(np.float64)
    if last is not None:  # the last step overshot: give the excess back in that layer
        s[last] -= (s.mean() - target) * n_layers
    return Calibration(hist.thresholds(s), s, target, "greedy", hist.score)


def calibrate(
    model: ModelArg,
    windows: Any,
    sparsity: float,
    *,
    method: str = "uniform",
    heldout: Any = None,
    score: Score = "product",
    batch_size: int = 4,
    progress: bool = False,
) -> Calibration:
    """Thresholds for ``sparsity`` on calibration windows; ``greedy`` also needs ``heldout`` windows."""
    _check_sparsity(sparsity)
    if method not in ("uniform", "greedy"):
        raise ValueError(f"unknown allocation method {method!r}; choose 'uniform' or 'greedy'")
    if method == "greedy" and heldout is None:
        raise ValueError("method='greedy' measures the loss on held-out text: pass heldout= token windows")
    hist = score_histogram(model, windows, score=score, batch_size=batch_size, progress=progress)
    if method == "uniform":
        return uniform(hist, sparsity)
    return greedy(hist, sensitivity(model, heldout, hist, progress=progress), sparsity)
