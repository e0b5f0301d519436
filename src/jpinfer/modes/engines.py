"""Engines of the sparse modes: a loaded model and what a mode needs, turned into arrays.

- ``sparse_engine``: every neuron on one device, neuron-major; the predictor picks the neurons per
  token (``ffn.PredictorListFFN``; PowerInfer's CPU-only mode here, its GPU-only mode on a GPU).
- ``threshold_engine``: every neuron on one device; training-free activation and input sparsity
  with calibrated per-layer thresholds (``ffn.ThresholdRowsFFN``), no predictor.
- ``hybrid_engine``: the placement's hot neurons on the accelerator, the cold ones on the CPU
  device (``hybrid.HybridFFN``: one jitted step, the cold part called from it), chosen by the predictor
  or by the thresholds.

In each the decoder's FFN matrices are replaced by the mode's layout, not copied.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.errors import JpinferError
from jpinfer.ffn import PredictorListFFN, PredictorListState, ThresholdLayer, ThresholdRowsFFN
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer
from jpinfer.models.quantized import input_major_int8, weights_format
from jpinfer.modes.devices import cast_floats, default_devices, host_dtype_for
from jpinfer.modes.hybrid import ColdParts, HybridFFN, HybridLayer
from jpinfer.predictor.store import Predictors
from jpinfer.profiler import SparsityThresholds
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.sparse import ThresholdProjection, neurons, threshold_layout


def without_ffn(layer: Layer) -> Layer:
    """The layer's attention part: its FFN matrices live neuron-major elsewhere."""
    return dataclasses.replace(layer, w_gate_up=None, w_down=None, b_up=None, b_down=None, router=None)


def sparse_engine(model: LoadedModel, predictors: Predictors, capacity: tuple[int, ...],
                  backend: str = "auto") -> Engine:
    """One device; the model's FFN matrices are replaced by the neuron-major copies."""
    kind = model.cfg.ffn_kind
    fmt = weights_format(model.weights)
    states = [PredictorListState(neurons.from_layer(layer, kind, model.cfg.experts), p.in_format(fmt))
              for layer, p in zip(model.weights.layers, predictors.layers)]
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    sparse_model = LoadedModel(model.cfg, weights, model.tokenizer, model.source)
    return Engine(sparse_model, FfnStrategy(PredictorListFFN(model.cfg, capacity, backend), states, "sparse"))


def _check_layers(model: LoadedModel, thresholds: SparsityThresholds) -> None:
    if not thresholds.fits(model.cfg.n_layers):
        raise JpinferError(f"got thresholds for {thresholds.n_layers} layers; the model has {model.cfg.n_layers}")


def _layer_thresholds(thresholds: SparsityThresholds, layer: int) -> dict[str, float | None]:
    """``threshold_layout.from_layer``'s threshold arguments for one layer (None: that kind off)."""
    pick = lambda values: None if values is None else float(values[layer])
    return dict(input_threshold=pick(thresholds.input), activation_threshold=pick(thresholds.activation))


def _attention_projections(layer: Layer, thresholds: SparsityThresholds, i: int
                           ) -> tuple[ThresholdProjection | None, ThresholdProjection | None]:
    """Layer i's q|k|v and output products laid out for their thresholds (None where a kind is off)."""
    return tuple(None if getattr(thresholds, kind) is None else
                 threshold_layout.projection_from(*matrix, float(getattr(thresholds, kind)[i]))
                 for kind, matrix in (("qkv", (layer.w_qkv, layer.b_qkv)), ("o", (layer.wo, layer.bo))))


def _attention_part(layer: Layer, thresholds: SparsityThresholds | None) -> Layer:
    """The layer without its FFN matrices, and without the attention matrices ``thresholds`` read by rows (their
    input-major copies replace them)."""
    drop = {}
    if thresholds is not None and thresholds.qkv is not None:
        drop |= {"w_qkv": None, "b_qkv": None}
    if thresholds is not None and thresholds.o is not None:
        drop |= {"wo": None, "bo": None}
    return dataclasses.replace(without_ffn(layer), **drop)


def threshold_states(model: LoadedModel, thresholds: SparsityThresholds) -> list[ThresholdLayer]:
    """Per layer the FFN laid out for ``thresholds`` (None for a kind: that kind off), and the attention's
    q|k|v and output products where their kinds are on."""
    _check_layers(model, thresholds)
    return [ThresholdLayer(threshold_layout.from_layer(layer, model.cfg.ffn_kind, **_layer_thresholds(thresholds, i),
                                                       experts=model.cfg.experts),
                           *_attention_projections(layer, thresholds, i))
            for i, layer in enumerate(model.weights.layers)]


def _threshold_head(head: Any, thresholds: SparsityThresholds) -> Any:
    """The head as the threshold mode reads it: an int8 (vocab, d) head whose inputs are skipped replaced by its
    input-major copy (``transformer.logits`` then reads only the kept inputs' rows, as for a float head)."""
    if thresholds.head is None or not isinstance(head, Int8Matrix) or head.scale_axis != 0:
        return head
    return input_major_int8(head)


def threshold_engine(model: LoadedModel, thresholds: SparsityThresholds, backend: str = "auto") -> Engine:
    """One device; each layer's FFN matrices, the attention's where they are read sparsely, and an int8 head
    whose inputs are skipped replaced by their threshold-sparsity layout."""
    weights = dataclasses.replace(model.weights, layers=[_attention_part(layer, thresholds)
                                                         for layer in model.weights.layers],
                                  head=_threshold_head(model.weights.head, thresholds))
    strategy = FfnStrategy(ThresholdRowsFFN(backend, thresholds.head), threshold_states(model, thresholds),
                           "threshold")
    return Engine(LoadedModel(model.cfg, weights, model.tokenizer, model.source), strategy)


def hybrid_engine(model: LoadedModel, predictors: Predictors | None, hot_masks: Sequence[np.ndarray],
                  capacity: tuple[tuple[int, int], ...] | None, devices: tuple[Any, Any] | None = None,
                  host_dtype: Any = None, thresholds: SparsityThresholds | None = None) -> Engine:
    """Hot neurons (``hot_masks[layer]``, boolean (d_ff,)) on the accelerator, the rest on the host, each part in
    the model's weights format (the host part's float arrays in ``host_dtype``, default ``host_dtype_for``). The
    predictor picks each part's neurons, or, with ``thresholds`` instead (and no predictors or capacity), each part
    applies the threshold mode's FFN thresholds, and the attention and the head (on the accelerator) their "qkv",
    "o" and "head" thresholds."""
    accelerator, host = devices or default_devices()
    host_dtype = host_dtype_for(model.weights.dtype, host) if host_dtype is None else host_dtype
    cfg = model.cfg
    if len(hot_masks) != cfg.n_layers or any(np.shape(m) != (cfg.d_ff,) for m in hot_masks):
        raise JpinferError(f"need one boolean mask of {cfg.d_ff} neurons per layer ({cfg.n_layers})")
    layers, parts, colds, sizes = [], [], [], []
    for i, (layer, hot) in enumerate(zip(model.weights.layers, hot_masks)):
        hot_ids, cold_ids = np.flatnonzero(hot).astype(np.int32), np.flatnonzero(~np.asarray(hot)).astype(np.int32)
        if thresholds is None:
            full = neurons.from_layer(layer, cfg.ffn_kind, cfg.experts)
            hot_part, cold_part = full.subset(hot_ids)[0], full.subset(cold_ids, with_b_down=False)[0]
            predictor = predictors.layers[i]
        else:
            split = lambda ids, with_b_down: threshold_layout.from_layer(
                layer, cfg.ffn_kind, **_layer_thresholds(thresholds, i), neurons=ids, with_b_down=with_b_down,
                experts=cfg.experts)
            hot_part, cold_part, predictor = split(hot_ids, True), split(cold_ids, False), None
        cold_part = cast_floats(cold_part, host_dtype)
        sizes.append((hot_ids.size, cold_ids.size))
        projections = (None, None) if thresholds is None else _attention_projections(layer, thresholds, i)
        part = HybridLayer(predictor, hot_part, jnp.asarray(hot_ids), jnp.asarray(cold_ids), *projections)
        layers.append(jax.device_put(_attention_part(layer, thresholds), accelerator))
        parts.append(jax.device_put(part, accelerator))
        colds.append(jax.device_put(cold_part, host))
    top = jax.device_put(dataclasses.replace(model.weights, layers=[]), accelerator)
    weights = dataclasses.replace(top, layers=layers)
    cold = ColdParts(colds, host)
    head = None if thresholds is None else thresholds.head
    strategy = FfnStrategy(HybridFFN(capacity or tuple(sizes), weakref.ref(cold), head), parts, "hybrid", held=cold)
    return Engine(LoadedModel(cfg, weights, model.tokenizer, model.source), strategy)
