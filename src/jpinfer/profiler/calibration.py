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

4. ``held_out_loss``: the measured loss of given thresholds of every kind on held-out windows, by which
   ``jpinfer.profiler.sparsity`` chooses among allocations.

The same histograms and estimates serve input sparsity (``INPUT``: the magnitudes |x_j| of the
FFN input, the derivative taken with respect to x; ``QKV`` and ``O``: of the inputs of the attention's
q|k|v and output products, through the decoder's ``project`` seam): ``jpinfer.profiler.sparsity``.

The attention's inputs reach the collectors through ``project``, whose values no aux returns: the decoder
calls a layer's ``project`` before its FFN, in one trace, so ``project`` leaves its statistics in a
per-trace dict (``_Pending``) and the layer's FFN call returns them with its own.
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

    def fraction_at_most(self, layer: int, value: float) -> float:
        """The fraction of the layer's values at most ``value`` (``threshold``'s inverse, interpolated in the bin)."""
        row = self.counts[layer]
        total = row.sum()
        if total == 0 or value <= 0:
            return 0.0
        edges = bin_edges()
        b = min(int(np.searchsorted(edges, value, side="right")) - 1, N_BINS - 1)
        before = row[:b].sum()
        within = min((value - edges[b]) / (edges[b + 1] - edges[b]), 1.0) * row[b]
        return float((before + within) / total)

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
QKV, O = "qkv", "o"  # of the inputs of the attention's q|k|v and output products
ATTENTION = (QKV, O)
HEAD = "head"  # of the head's inputs (the final hidden states): one row, as one head serves every layer


class _Pending(dict):
    """What a layer's ``project`` calls leave for its FFN call in the same trace (module docstring); never part
    of a collector's identity (every instance compares equal and hashes alike)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Pending)

    def __hash__(self) -> int:
        return 0


def _count(v: jax.Array, valid: jax.Array) -> jax.Array:
    """Histogram (N_BINS,) of v (B, T, n) over the valid tokens (B, T) (the others go to a dropped bin)."""
    return jnp.bincount(jnp.where(valid[..., None], bin_index(v), N_BINS).ravel(), length=N_BINS + 1)[:N_BINS]


@dataclasses.dataclass(frozen=True)
class _HistogramFFN:
    """Dense model that also histograms each layer's neuron scores, its FFN input magnitudes |x_j| and
    the input magnitudes of its attention's two products, and (``final``) those of the head's inputs."""

    cfg: ModelConfig
    score: str
    pending: _Pending = dataclasses.field(default_factory=_Pending)

    def project(self, i: int, layer: Layer, name: str, x: jax.Array, state) -> jax.Array:
        _, valid, _ = state
        self.pending[i, name] = _count(jnp.abs(x), valid)
        return transformer.dense_projection(layer, name, x)

    def __call__(self, i: int, layer: Layer, x: jax.Array, state) -> tuple[jax.Array, jax.Array]:
        _, valid, _ = state
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        attention = [self.pending.pop((i, name)) for name in ATTENTION]
        return transformer.ffn_down(layer, a), jnp.stack([_count(s, valid), _count(jnp.abs(x), valid), *attention])

    def final(self, h: jax.Array, valid: jax.Array) -> jax.Array:
        return _count(jnp.abs(h), valid)


def _check_sparsity(sparsity: float) -> float:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity is the fraction of neurons skipped: give 0 <= s < 1, got {sparsity!r}")
    return float(sparsity)


def histograms(
    model: ModelArg, windows: Any, *, score: Score = "product", batch_size: int = 4, progress: bool = False
) -> tuple[ScoreHistogram, ...]:
    """Histograms of every layer's neuron scores, of its FFN input magnitudes (score ``INPUT``), of the
    input magnitudes of its attention's q|k|v and output products (``QKV``, ``O``) and of the head's input
    magnitudes (``HEAD``, one row) over token windows, from one dense pass."""
    loaded = resolve_model(model)
    check_score(score, loaded.cfg)
    tokens = passes.as_tokens(windows, loaded.cfg.vocab_size)
    n_layers = loaded.cfg.n_layers
    counts = np.zeros((4, n_layers, N_BINS), np.int64)
    head = np.zeros((1, N_BINS), np.int64)
    thresholds = np.zeros(n_layers, np.float32)
    collector = _HistogramFFN(loaded.cfg, score)
    for _, _, aux in passes.run(loaded, tokens, collector, thresholds, batch_size, progress, "calibrating"):
        counts += np.stack(aux[:n_layers], axis=1)
        head[0] += aux[n_layers]
    n = int(tokens.size)
    return (*(ScoreHistogram(c, name, n) for c, name in zip(counts, (score, INPUT, QKV, O))),
            ScoreHistogram(head, HEAD, n))


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
    """Dense model plus an additive zero probe: on the FFN's output (its gradient is dL/dy; aux = (a,
    score)) or, for score ``INPUT``, on its input (its gradient is dL/dx; aux = (x, |x|)); for ``QKV`` and
    ``O`` on the input of that attention product (aux the same)."""

    cfg: ModelConfig
    score: str
    pending: _Pending = dataclasses.field(default_factory=_Pending)

    def project(self, i: int, layer: Layer, name: str, x: jax.Array, state: jax.Array) -> jax.Array:
        if name == self.score:  # the state is the probe
            x = x + state
            self.pending[i] = (x, jnp.abs(x))
        return transformer.dense_projection(layer, name, x)

    def __call__(self, i: int, layer: Layer, x: jax.Array, probe: jax.Array):
        if self.score in ATTENTION:
            return transformer.ffn_dense(layer, x, self.cfg), self.pending.pop(i)
        if self.score == INPUT:
            x = x + probe
            return transformer.ffn_dense(layer, x, self.cfg), (x, jnp.abs(x))
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        return transformer.ffn_down(layer, a) + probe, (a, s)


@functools.partial(jax.jit, static_argnames=("cfg", "score"))
def _window_derivatives(weights, tokens, valid, level_thresholds, cfg, score):
    """(B, n_layers, n_levels): dL_w/dlambda for removing each layer's sub-threshold part."""
    b, t = tokens.shape
    width = cfg.q_dim if score == O else cfg.d_model  # the probed input's
    probes = [jnp.zeros((b, t, width), weights.dtype) for _ in range(cfg.n_layers)]
    impl = _PerturbableFFN(cfg, score)

    def loss(probes):
        cache = transformer.KVCache.create(cfg, b, t, weights.dtype)
        h, _, aux = transformer.forward(weights, tokens, cache, cfg, impl, probes)
        return jnp.sum(transformer.next_token_nll(weights, h, tokens, cfg) * valid[:, None]), aux

    grads, aux = jax.grad(loss, has_aux=True)(probes)
    out = []
    for l, (a, s) in enumerate(aux):  # contrib: each entry times dL/d(entry); removing it costs -contrib
        on_input = score in (INPUT, *ATTENTION)
        dl_da = grads[l] if on_input else grads[l] @ quantized.as_float(weights.layers[l].w_down, grads[l].dtype)
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
    of ``hist``'s score: skipping neurons, FFN input dimensions for score ``INPUT``, or the inputs of an
    attention product for ``QKV`` and ``O``."""
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
    s = greedy_levels(sens.cost, sens.levels, np.ones(len(sens.cost)), target)
    return Calibration(hist.thresholds(s), s, target, "greedy", hist.score)


def greedy_levels(cost: np.ndarray, levels: np.ndarray, weight: np.ndarray, target: float) -> np.ndarray:
    """A sparsity per unit (a row of ``cost``, (units, n_levels): the estimated loss increase at each of
    ``levels``) whose ``weight``-weighted mean is ``target``: units are raised one level at a time where the
    cost per weight skipped is least, and the last step's excess is given back in its unit. Weights are the
    units' sizes (bytes of a matrix read by rows: ``sparsity.model_wide``), or equal (``greedy``)."""
    if target > levels[-1]:
        raise ValueError(f"greedy allocation reaches at most sparsity {levels[-1]}; lower the target or add levels")
    cost = np.maximum.accumulate(cost, axis=1)  # skipping more never helps; removes noise dips
    weight = np.asarray(weight, np.float64)
    share = weight / weight.sum()
    rows = np.arange(len(cost))
    level = np.zeros(len(cost), int)
    last = None
    while levels[level] @ share < target - 1e-12:
        nxt = np.minimum(level + 1, len(levels) - 1)
        rate = (cost[rows, nxt] - cost[rows, level]) / np.maximum((levels[nxt] - levels[level]) * weight, 1e-12)
        last = int(np.argmin(np.where(nxt > level, rate, np.inf)))
        level[last] += 1
    s = levels[level].astype(np.float64)
    if last is not None:
        s[last] -= (s @ share - target) / share[last]
    return s


@dataclasses.dataclass(frozen=True)
class _SkippingFFN:
    """Dense model with what the threshold mode skips zeroed. Per layer, (4,) float32 thresholds in
    ``histograms``' order: on the neuron activations |a| (the down rows), the FFN input |x_j| (gate/up rows), the
    q|k|v input and the o input; an entry at or under its threshold is zeroed (-1 keeps a kind whole). The
    activations come from the FFN input as skipped, as in the threshold mode."""

    cfg: ModelConfig

    def project(self, i: int, layer: Layer, name: str, x: jax.Array, state: jax.Array) -> jax.Array:
        kept = jnp.abs(x) > state[2 if name == QKV else 3]
        return transformer.dense_projection(layer, name, jnp.where(kept, x, 0))

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: jax.Array) -> tuple[jax.Array, None]:
        a, s = activation_and_score(layer, jnp.where(jnp.abs(x) > state[1], x, 0), self.cfg, "product", routed_by=x)
        return transformer.ffn_down(layer, jnp.where(s > state[0], a, 0)), None


def held_out_loss(model: ModelArg, windows: Any, thresholds: np.ndarray, *, batch_size: int = 4) -> float:
    """Mean next-token NLL on ``windows`` of the model with what ``thresholds`` (n_layers, 4: per layer its
    activation, FFN input, q|k|v input and o input thresholds; -1 keeps a kind whole) skip zeroed: the measured
    loss an allocation is judged by."""
    loaded = resolve_model(model)
    thresholds = np.asarray(thresholds, np.float32)
    if thresholds.shape != (loaded.cfg.n_layers, 4):
        raise ValueError(f"thresholds must be (n_layers, 4) = ({loaded.cfg.n_layers}, 4), got {thresholds.shape}")
    ppl, _ = passes.evaluate(loaded, windows, _SkippingFFN(loaded.cfg), jnp.asarray(thresholds),
                             batch_size=batch_size)
    return math.log(ppl)


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
