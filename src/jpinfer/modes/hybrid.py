"""The `hybrid` mode: hot neurons on the accelerator, cold neurons on the CPU device, in one jitted step.

The hybrid is an FFN strategy (``HybridFFN``) of the one-jitted-step engine: attention, the predictor,
the hot part of each FFN, sampling, all run in the accelerator's compiled step; per layer the cold
part is called from inside it (``jax.pure_callback``), runs on the CPU device as a jitted call of its
own (``_cold_ffn``: the native kernels there) and its output is added to the hot part's:

    accelerator: attention; the predictor's logits split into the hot and the cold part, each cut to
        at most its capacity (``select_neurons``); the hot FFN
    callback: x and the cold list (numpy) -> the cold FFN's native kernel on the host; its output -> accelerator
    accelerator: hot + cold, the residual

The callback calls the cold part's native kernel directly (``sparse.host_sparse_ffn``: a plain C function of the
native library through ctypes, on numpy views of the cold part's host arrays taken once when the engine is built),
for a decode token's list in every format the native kernels read (float32 rows, int8 bundles, 4-bit records):
the same kernel and bits as the jitted ``sparse_ffn`` on the CPU device, without its dispatch. That jitted call a
layer (``jax.device_put`` of x and the list, the call, ``np.asarray`` of its output) cost ~460 us a layer more than
the direct call (int8 at 7B shapes, a 0.9 budget: 20.6 against 5.9 ms a token on a 2-core Zen 3,
bench/results/hybrid_host.md). The jitted call remains for what the direct call does not take: without
the native library, threshold parts, experts' routing weights, a prompt's or a batch's all-rows form.

Why one step and a callback (measured, ``bench/hybrid_hops.py``, H200 with jax 0.11.2, 2026-12-04): the
first form dispatched each layer from Python as jitted calls on either device with ``jax.device_put``
between them, ~550 us a layer in dispatch, synchronisation and copies with the arithmetic taken out
(0.5 ms x 30 layers: the default model's shapes decoded at 18 tok/s against 780 dense); one jitted step
with a host callback a layer costs ~120 us a layer. Each layer still waits for its cold part (the next
layer's attention needs it), as in PowerInfer.

With threshold sparsity instead of predictors (``mode="hybrid"`` given thresholds) each part is
a ``ThresholdLayout`` of its neurons and keeps what the thresholds keep; there are no lists.

Every weights format: each part is the sparse (or threshold) mode's layout of its neurons in the model's
format (float rows, int8 bundles, an int4 model's 4-bit records), the cold part on the host through the same
native kernels as the one-device modes. A quantized part is its own W8A8 product, quantizing its activations on
its own peak: the same neurons as the one-device engine, a finer rounding of their activations.

The down projection is a sum over neurons, so hot + cold is exactly the FFN over the
union of both lists; ``b_down`` lives in the hot part only. Prefill computes every neuron
of both parts (``all_rows_ffn``); so does a step of several sequences (batched decoding), keeping
each token's own selection in each part (a mask per token instead of a list). Without a GPU two
simulated CPU devices play the two roles (device 0 the accelerator), so the split, its callbacks and
its merge run in tests.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.ffn import threshold_projections
from jpinfer.models.params import Layer
from jpinfer.predictor.mlp import PredictorWeights, predict_logits, routed_logits, select_neurons, selection_mask
from jpinfer.sparse import (
    NeuronFFN,
    ThresholdLayout,
    ThresholdProjection,
    all_rows_ffn,
    host_sparse_ffn,
    sparse_ffn,
    threshold_ffn,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridLayer:
    """What one layer keeps on the accelerator besides its attention: the predictor, the hot neurons (with
    ``b_down``), the neuron ids of both parts and, with model-wide threshold sparsity, the attention's products
    read by input rows (their matrices then not in the decoder's layer)."""

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
    batch of sequences) or all of them (prefill); a threshold part keeps what its thresholds keep, per token. A part
    without neurons (its layer wholly on the other device) adds its ``b_down`` only: the quantized products take no
    empty matrix (an int8 down product has no activation peak to scale by)."""
    if (ffn.d_ff if isinstance(ffn, ThresholdLayout) else ffn.n_neurons) == 0:
        return jnp.zeros(x.shape, x.dtype) + (0 if ffn.b_down is None else ffn.b_down.astype(x.dtype))
    tokens = x.reshape(-1, x.shape[-1])
    if isinstance(ffn, ThresholdLayout):
        return threshold_ffn(ffn, tokens)[0].reshape(x.shape)
    if chosen is None or not isinstance(chosen, tuple):
        return all_rows_ffn(ffn, tokens, chosen).reshape(x.shape)
    return sparse_ffn(ffn, tokens[0], *chosen).reshape(x.shape)


_cold_ffn = jax.jit(_part_ffn)


class ColdParts:
    """Every layer's cold part (``parts[layer]``, arrays on ``host``). The engine's strategy holds it
    (``FfnStrategy.held``); ``HybridFFN`` only refers to it: jax keeps a compiled step, and the static
    ``ffn_impl`` it was compiled for, in its caches after the engine is gone, and a 7B model's cold
    part is ~17 GB of host memory.

    ``direct[layer]``: the part's decode list as a direct host call (``sparse.host_sparse_ffn``, on views of the
    part's arrays), or None where the jitted ``_cold_ffn`` runs it (module docstring)."""

    def __init__(self, parts: list[NeuronFFN | ThresholdLayout], host: Any) -> None:
        self.parts = tuple(parts)
        self.host = host
        self.direct = tuple(host_sparse_ffn(p) if isinstance(p, NeuronFFN) else None for p in self.parts)


@dataclasses.dataclass(frozen=True, eq=False)
class HybridFFN:
    """Static ``ffn_impl`` of the hybrid (state per layer: ``HybridLayer``): the hot part in the step, the
    cold part (``cold[layer]``, on the host device) through a host callback.

    ``capacity`` per layer: (hot K, cold K), each at most its part's size; 0 for an empty part. Compared by
    identity: one engine's steps compile once per attention length. ``head_threshold``: the threshold mode's on
    the head's inputs (``transformer.logits``; None: dense head)."""

    capacity: tuple[tuple[int, int], ...]
    held: weakref.ref  # to the engine's ColdParts
    head_threshold: float | None = None

    @property
    def cold(self) -> tuple[NeuronFFN | ThresholdLayout, ...]:
        parts = self.held()
        if parts is None:
            raise RuntimeError("this hybrid engine's cold neurons were freed with the engine")
        return parts.parts

    def __call__(self, i: int, layer: Layer, x: jax.Array, state: HybridLayer) -> tuple[jax.Array, None]:
        capacity = None if x.ndim > 1 and x.shape[-2] > 1 else self.capacity[i]  # None: a prompt's positions
        hot_list = cold_list = None
        if capacity is not None and state.predictor is not None:
            tokens = x.reshape(-1, x.shape[-1])  # decode: one token per sequence
            x_sel = tokens[0] if tokens.shape[0] == 1 else tokens
            logits = routed_logits(predict_logits(state.predictor, x_sel), state.hot.router, x_sel,
                                   state.hot.routing_rule)
            hot_list = _part_list(logits, state.hot_ids, state.predictor.cutoff, capacity[0])
            cold_list = _part_list(logits, state.cold_ids, state.predictor.cutoff, capacity[1])
        y = _part_ffn(state.hot, x, hot_list)
        cold = self.cold[i]
        if cold.n_neurons and (capacity is None or capacity[1]):
            y = y + self._on_host(i, x, cold_list)
        return y, None

    def project(self, i: int, layer: Layer, name: str, x: jax.Array, state: HybridLayer) -> jax.Array:
        """The attention's ``name`` product ("qkv" or "o"): by its kept input rows where thresholds apply."""
        return threshold_projections(layer, state.qkv, state.o)(name, x)

    def _on_host(self, index: int, x: jax.Array, chosen: Any) -> jax.Array:
        """Layer ``index``'s cold output for x and its list (or mask), computed on the host device from inside
        the accelerator's step; shape and dtype as ``_part_ffn`` gives them (the host's dtype)."""
        leaves, tree = jax.tree_util.tree_flatten(chosen)
        struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
        out = jax.eval_shape(_part_ffn, self.cold[index], struct(x), jax.tree_util.tree_map(struct, chosen))
        held = self.held  # the compiled callback keeps neither the weights nor their holder alive

        listed = isinstance(chosen, tuple)  # a decode token's list (else a mask per token, or every row)

        def run(x_value, *chosen_values):
            parts = held()
            direct = parts.direct[index]
            if listed and direct is not None:  # the native kernel on the host arrays, no jax dispatch
                ids, count = chosen_values
                y = direct(x_value.reshape(-1, x_value.shape[-1])[:1], ids, count)
                return y.reshape(out.shape).astype(out.dtype, copy=False)
            args = jax.device_put((x_value, jax.tree_util.tree_unflatten(tree, chosen_values)), parts.host)
            return np.asarray(_cold_ffn(parts.parts[index], *args))

        return jax.pure_callback(run, out, x, *leaves)
