"""The `hybrid` mode: hot neurons on the accelerator, cold neurons on the CPU device.

A jitted computation belongs to one device, so a step is a chain of small jitted functions
the host dispatches, per layer:

    accelerator: h += the previous layer's two partial FFN outputs; attention; the FFN
        input x (one call, the same for every layer); then the predictor's logits split into
        the hot and the cold part, each cut to at most its capacity (``select_neurons``), and
        the hot FFN (a second call, the layer's own shapes)
    x and the cold list -> CPU device (``jax.device_put``)
    cold FFN (CPU device): runs while the accelerator finishes its hot FFN
    cold output -> accelerator, added by the next layer's call (or the final one)

With threshold sparsity instead of predictors (``mode="hybrid"`` given thresholds) each part is
a ``ThresholdLayout`` of its neurons and keeps what the thresholds keep; there are no lists.

The down projection is a sum over neurons, so hot + cold is exactly the FFN over the
union of both lists; ``b_down`` lives in the hot part only. Prefill computes every neuron
of both parts (``all_rows_ffn``); so does a step of several sequences (batched decoding), keeping
each token's own selection in each part (a mask per token instead of a list). Without a GPU two
simulated CPU devices play the two roles (device 0 the accelerator), so the split, its transfers and
its merge run in tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig
from jpinfer.ffn import threshold_projections
from jpinfer.models import transformer
from jpinfer.models.params import Layer, Weights
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, select_neurons, selection_mask
from jpinfer.runtime.sampling import sample_next_jit
from jpinfer.sparse import NeuronFFN, ThresholdLayout, ThresholdProjection, all_rows_ffn, sparse_ffn, threshold_ffn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AcceleratorLayer:
    """What one layer keeps on the accelerator: attention (``layer``, FFN matrices removed),
    the predictor, the hot neurons (with ``b_down``), the neuron ids of both parts and, with model-wide
    threshold sparsity, the attention's products read by input rows (their matrices then not in ``layer``)."""

    layer: Layer
    predictor: PredictorWeights | None  # None: threshold sparsity (each part applies its thresholds)
    hot: NeuronFFN | ThresholdLayout
    hot_ids: jax.Array  # (n_hot,) int32: neuron id of each hot row
    cold_ids: jax.Array  # (n_cold,) int32: neuron id of each cold row, in the CPU part's order
    qkv: ThresholdProjection | None = None
    o: ThresholdProjection | None = None


def _part_list(logits: jax.Array, ids: jax.Array, cutoff: jax.Array, capacity: int):
    """One token's logits (n,): (positions in the part, valid count), an empty list for capacity 0. A batch's
    tokens' logits (B, n): a boolean (B, part size) mask per token of the same selections."""
    if logits.ndim == 2:
        if capacity == 0:
            return jnp.zeros((logits.shape[0], ids.shape[0]), bool)
        return selection_mask(select_neurons(logits[:, ids], cutoff, capacity), ids.shape[0])
    if capacity == 0:
        return jnp.zeros((0,), jnp.int32), jnp.int32(0)
    chosen = select_neurons(logits[ids], cutoff, capacity)
    return chosen.ids, chosen.count


def _part_ffn(ffn: NeuronFFN | ThresholdLayout, x: jax.Array,
              chosen: tuple[jax.Array, jax.Array] | jax.Array | None) -> jax.Array:
    """One part's FFN output (B, T, d): over its listed neurons (one token), each token's masked neurons (a
    batch of sequences) or all of them (prefill); a threshold part keeps what its thresholds keep, per token."""
    tokens = x.reshape(-1, x.shape[-1])
    if isinstance(ffn, ThresholdLayout):
        return threshold_ffn(ffn, tokens)[0].reshape(x.shape)
    if chosen is None or not isinstance(chosen, tuple):
        return all_rows_ffn(ffn, tokens, chosen).reshape(x.shape)
    return sparse_ffn(ffn, tokens[0], *chosen).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "window"), donate_argnames=("cache_k", "cache_v"))
def _attention(layer: Layer, qkv: ThresholdProjection | None, o: ThresholdProjection | None, previous: Layer, h,
               y_hot, y_cold, positions, rope_cs, cache_k, cache_v, *, cfg: ModelConfig, attend: int,
               window: int | None):
    """Accelerator, per layer: merge the ``previous`` layer's two FFN outputs (the first layer passes itself
    and zeros), then attention (its products by input rows where ``qkv`` / ``o`` are given). Returns the residual
    stream, the FFN input x and the layer's keys and values. Every layer has the same shapes here, so this
    compiles once per attention length (and window) for all layers."""
    h = transformer.ffn_residual(previous, h, y_hot + y_cold, cfg)
    return transformer.attention_residual(layer, h, positions, rope_cs, cache_k, cache_v, cfg, attend,
                                          window=window, project=threshold_projections(layer, qkv, o))


@functools.partial(jax.jit, static_argnames=("capacity",))
def _hot_part(part: AcceleratorLayer, x, *, capacity: tuple[int, int] | None):
    """Accelerator, per layer: (decode: ``capacity`` given) the predictor's hot and cold lists, and the
    hot FFN. Its shapes are the layer's own (part sizes, predictor width), so it compiles once per
    layer for prefill and once for decode, whatever the attention length: fused with the attention,
    it compiled once per layer and attention length (a bench's warm-up of the default model's 30
    layers over 5 attention lengths took minutes), for one dispatch fewer per layer."""
    hot_list = cold_list = None
    if capacity is not None and part.predictor is not None:
        tokens = x.reshape(-1, x.shape[-1])  # decode: one token per sequence
        logits = predict_logits(part.predictor, tokens[0] if tokens.shape[0] == 1 else tokens)
        hot_list = _part_list(logits, part.hot_ids, part.predictor.cutoff, capacity[0])
        cold_list = _part_list(logits, part.cold_ids, part.predictor.cutoff, capacity[1])
    return _part_ffn(part.hot, x, hot_list), cold_list


_cold_ffn = jax.jit(_part_ffn)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _final_logits(top: Weights, last_layer: Layer, h, y_hot, y_cold, last, *, cfg: ModelConfig):
    """Accelerator: merge the last layer's FFN, final norm, float32 logits (B, V) at position ``last``."""
    h = transformer.norm(top.final_norm, transformer.ffn_residual(last_layer, h, y_hot + y_cold, cfg), cfg)
    return transformer.logits(top, jax.lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False), cfg)


_inputs = jax.jit(transformer.step_inputs, static_argnames=("cfg",))


@dataclasses.dataclass
class HybridStepper:
    """``runtime.Stepper`` over two devices: ``top`` (embeddings, head, norms) and ``layers``
    on ``accelerator``, ``cold`` (one ``NeuronFFN``, or ``ThresholdLayout``, per layer) on ``host``.

    ``capacity`` per layer: (hot K, cold K), each at most its part's size; 0 for an empty part.
    """

    cfg: ModelConfig
    top: Weights
    layers: list[AcceleratorLayer]
    cold: list[NeuronFFN | ThresholdLayout]
    capacity: tuple[tuple[int, int], ...]
    accelerator: Any
    host: Any
    name: str = "hybrid"

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> transformer.KVCache:
        with jax.default_device(self.accelerator):
            return transformer.KVCache.create(self.cfg, batch, capacity, self.top.dtype, per_sequence=per_sequence)

    def _run(self, tokens, cache, attend: int, decode: bool, n_valid=None):
        h, positions, rope_cs = _inputs(self.top, tokens, cache.length, cfg=self.cfg, n_valid=n_valid)
        zeros = jnp.zeros_like(h)
        y_hot = y_cold = zeros
        keys, values = [], []
        for i, (part, cold) in enumerate(zip(self.layers, self.cold)):
            capacity = self.capacity[i] if decode else None
            previous = self.layers[max(i - 1, 0)].layer
            h, x, k, v = _attention(part.layer, part.qkv, part.o, previous, h, y_hot, y_cold, positions, rope_cs,
                                    cache.k[i], cache.v[i], cfg=self.cfg, attend=attend,
                                    window=self.cfg.layer_window(i))
            y_hot, cold_list = _hot_part(part, x, capacity=capacity)
            keys.append(k)
            values.append(v)
            if cold.n_neurons and (capacity is None or capacity[1]):
                y_cold = jax.device_put(_cold_ffn(cold, *jax.device_put((x, cold_list), self.host)), self.accelerator)
            else:
                y_cold = zeros
        return h, y_hot, y_cold, transformer.KVCache(keys, values, cache.length + tokens.shape[1])

    def first_logits(self, tokens, n_valid, cache, attend):
        h, y_hot, y_cold, cache = self._run(tokens, cache, attend, decode=False, n_valid=n_valid)
        logits = _final_logits(self.top, self.layers[-1].layer, h, y_hot, y_cold, n_valid - 1, cfg=self.cfg)
        return logits, dataclasses.replace(cache, length=cache.length - tokens.shape[1] + n_valid)

    def first(self, tokens, n_valid, cache, key, sampler, attend):
        logits, cache = self.first_logits(tokens, n_valid, cache, attend)
        token, key = sample_next_jit(logits, key, sampler=sampler)
        return token, cache, key

    def step_logits(self, token, cache, attend):
        h, y_hot, y_cold, cache = self._run(token[:, None], cache, attend, decode=True)
        return _final_logits(self.top, self.layers[-1].layer, h, y_hot, y_cold, 0, cfg=self.cfg), cache

    def next(self, token, cache, key, sampler, attend):
        step_logits, cache = self.step_logits(token, cache, attend)
        token, key = sample_next_jit(step_logits, key, sampler=sampler)
        return token, cache, key
