"""Batched, jitted prefill-style passes over token windows, with a progress bar.

Every profiler statistic is gathered the same way: a static, hashable *collector* replaces
the dense FFN in ``transformer.forward`` (``ffn_impl``), returns the dense FFN output so the
model runs unchanged, and emits per-layer aux statistics for one batch. The host adds the
batch results into fixed-size accumulators, so nothing grows with the corpus. ``evaluate`` is the
same pass scored: the perplexity of the model with any ``ffn_impl`` (the profiler measures held-out
losses with it; the FFN strategies their accuracy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel, ModelArg, resolve_model
from jpinfer.profiler.corpus import TokenWindows


@functools.partial(jax.tree_util.register_dataclass, data_fields=["thresholds", "valid", "extra"], meta_fields=[])
@dataclasses.dataclass
class LayerState:
    """The traced ``ffn_state``: indexing it with a layer gives (threshold, valid, extra).

    ``valid`` (B, T) marks real tokens (padding windows fill the last batch); ``extra`` is
    whatever else a collector needs, shared by all layers (``None`` for nothing).
    """

    thresholds: jax.Array  # (n_layers,) float32
    valid: jax.Array  # (B, T) bool
    extra: Any = None

    def __getitem__(self, layer_index: int) -> tuple[jax.Array, jax.Array, Any]:
        return self.thresholds[layer_index], self.valid, self.extra


def as_tokens(windows: TokenWindows | np.ndarray, vocab_size: int) -> np.ndarray:
    """Validated (n_windows, window) int32 tokens."""
    tokens = windows.tokens if isinstance(windows, TokenWindows) else np.asarray(windows)
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"token windows must be a non-empty (n_windows, window >= 2) array, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token windows must hold integer ids, got dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}): got {tokens.min()}..{tokens.max()}")
    return tokens.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "collector"))
def collect(weights, tokens: jax.Array, state: LayerState, cfg, collector) -> list[Any]:
    """One batch through the model with ``collector`` as the FFN; returns its per-layer aux, and after them, for
    a collector with a ``final(h, valid)``, its statistic of the final hidden states (the head's inputs)."""
    cache = transformer.KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, _, aux = transformer.forward(weights, tokens, cache, cfg, collector, state)
    final = getattr(collector, "final", None)
    return aux if final is None else [*aux, final(h, state.valid)]


def batches(tokens: np.ndarray, batch_size: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(first window, tokens (B, T), valid (B, T)); the last batch is padded with invalid copies."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    n, t = tokens.shape
    batch_size = min(batch_size, n)
    for start in range(0, n, batch_size):
        chunk = tokens[start : start + batch_size]
        real = len(chunk)
        if real < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - real, axis=0)])
        valid = np.zeros((batch_size, t), bool)
        valid[:real] = True
        yield start, chunk, valid


def run(
    model: LoadedModel,
    tokens: np.ndarray,
    collector: Callable,
    thresholds: np.ndarray,
    batch_size: int,
    progress: bool,
    desc: str,
    extra: Callable[[int, np.ndarray], Any] | None = None,
) -> Iterator[tuple[int, np.ndarray, list[Any]]]:
    """Yield (first window, valid, per-layer aux as numpy) for every batch.

    ``extra(first_window, valid)`` builds the batch's shared collector input. The next
    batch is dispatched before the previous one is read back, so host work overlaps.
    """
    cfg, weights = model.cfg, model.weights
    thr = jnp.asarray(thresholds, jnp.float32)
    bar = tqdm(total=int(tokens.size), unit="tok", desc=desc, disable=not progress, dynamic_ncols=True)
    pending = None
    try:
        for start, chunk, valid in batches(tokens, batch_size):
            state = LayerState(thr, jnp.asarray(valid), None if extra is None else extra(start, valid))
            out = collect(weights, jnp.asarray(chunk), state, cfg, collector)
            if pending is not None:
                yield _finish(pending, bar)
            pending = (start, valid, out)
        if pending is not None:
            yield _finish(pending, bar)
    finally:
        bar.close()


def _finish(pending, bar) -> tuple[int, np.ndarray, list[Any]]:
    start, valid, out = pending
    out = jax.tree_util.tree_map(np.asarray, out)
    bar.update(int(valid.sum()))
    return start, valid, out


@functools.partial(jax.jit, static_argnames=("cfg", "ffn_impl"))
def _nll_sum(weights, tokens, valid, ffn_state, cfg, ffn_impl):
    """Summed next-token NLL over the valid windows (B,) of a batch, and per-layer aux
    sums over the valid windows' tokens (every aux leaf is (B, T))."""
    cache = transformer.KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, _, aux = transformer.forward(weights, tokens, cache, cfg, ffn_impl, ffn_state)
    nll = transformer.next_token_nll(weights, h, tokens, cfg, transformer.head_threshold(ffn_impl))
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
    tokens = as_tokens(windows, loaded.cfg.vocab_size)
    total, sums = 0.0, None
    with tqdm(total=int(tokens.size), unit="tok", desc="perplexity", disable=not progress) as bar:
        for _, chunk, valid in batches(tokens, batch_size):
            nll, aux = _nll_sum(loaded.weights, jnp.asarray(chunk), jnp.asarray(valid[:, 0]), ffn_state, loaded.cfg,
                                ffn_impl)
            total += float(nll)
            aux = jax.tree_util.tree_map(float, aux)
            sums = aux if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, aux)
            bar.update(int(valid.sum()))
    return math.exp(total / (tokens.shape[0] * (tokens.shape[1] - 1))), sums
