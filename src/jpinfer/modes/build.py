"""Engines for the modes: the model, predictors, profile and placement turned into arrays.

- ``dense``: the reference decoder.
- ``sparse``: every neuron on one device; the predictor picks the neurons per token
  (PowerInfer's CPU-only mode here, its GPU-only mode on a GPU).
- ``hybrid``: the placement's hot neurons on the accelerator, the cold ones on the CPU
  device (``hybrid.HybridStepper``).
- ``threshold``: every neuron on one device; training-free activation and input sparsity with
  calibrated per-layer thresholds (``threshold.ThresholdSparseFFN``), no predictor.

Capacities: a static K per layer (``layer_capacities``), by default the 0.99 quantile of the
number of neurons the predictor picks per token on its held-out samples, rounded up to the
sparse kernels' block of 32 neurons; in the hybrid each part gets K times its share of the
layer's activations (profile frequencies), rounded the same way, at most the part's size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.errors import JpinferError
from jpinfer.models import int8
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Layer, nbytes
from jpinfer.modes.arguments import check_mode_arguments
from jpinfer.modes.hybrid import AcceleratorLayer, HybridStepper
from jpinfer.modes.sparse import PredictedSparseFFN, SparseLayer
from jpinfer.modes.threshold import ThresholdSparseFFN
from jpinfer.predictor.store import Predictors
from jpinfer.profiler import ActivationProfile, SparsityThresholds
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.solver import HardwareProfile, ModelSizes, Placement, model_sizes, preset, solve_placement
from jpinfer.solver.memory import split_dense
from jpinfer.sparse import ThresholdFFN, neurons, threshold

BLOCK = 32  # capacities are rounded up to whole blocks of the sparse kernels (Pallas blocks, CPU loop chunks)
Capacity = str | float | int | Sequence[int]
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def whole_blocks(k: float) -> int:
    """k rounded up to whole blocks of ``BLOCK`` neurons."""
    return int(math.ceil(k / BLOCK) * BLOCK)


def without_ffn(layer: Layer) -> Layer:
    """The layer's attention part: its FFN matrices live neuron-major elsewhere."""
    return dataclasses.replace(layer, w_gate_up=None, w_down=None, b_up=None, b_down=None)


def layer_capacities(model: LoadedModel, capacity: Capacity, profile: ActivationProfile | None,
                     predictors: Predictors | None = None) -> tuple[int, ...]:
    """Per-layer K, rounded up to ``BLOCK`` and at most d_ff when derived from data.

    ``capacity``: "predicted" the 0.99 quantile of the neurons the predictors pick per token on
    their held-out samples (they rarely clip); a float in (0, 1] that quantile of the profile's
    active counts (tighter: a predictor picks more neurons than are active, so this clips);
    an int one K for every layer; a sequence one K per layer.
    """
    cfg = model.cfg
    if isinstance(capacity, str):
        if capacity != "predicted":
            raise JpinferError(f"capacity must be 'predicted', a quantile, an int or one int per layer, got {capacity!r}")
        scores = (predictors.meta.get("held_out_scores") if predictors is not None else None) or []
        if len(scores) != cfg.n_layers or any(s.get("predicted_q99") is None for s in scores):
            raise JpinferError("capacity='predicted' needs predictors scored on held-out samples with per-token "
                               "counts (train them, or jpinfer.predictor.retune them, with this jpinfer version), "
                               "or give the capacity as a profile quantile or an integer")
        ks = [min(whole_blocks(max(s["predicted_q99"], 1)), cfg.d_ff) for s in scores]
    elif isinstance(capacity, float):
        if profile is None:
            raise JpinferError("capacity as a quantile needs the profile (profile=...); or give K as an integer")
        if not 0 < capacity <= 1:
            raise JpinferError(f"capacity quantile must lie in (0, 1], got {capacity}")
        ks = [int(k) for k in profile.capacity(capacity, multiple=BLOCK)]
    elif isinstance(capacity, (int, np.integer)):
        ks = [int(capacity)] * cfg.n_layers
    else:
        ks = [int(k) for k in capacity]
    if len(ks) != cfg.n_layers:
        raise JpinferError(f"got {len(ks)} capacities for a model with {cfg.n_layers} layers")
    if any(not 1 <= k <= cfg.d_ff for k in ks):
        raise JpinferError(f"capacities must lie in [1, d_ff={cfg.d_ff}], got {ks}")
    return tuple(ks)


def part_capacities(ks: Sequence[int], hot_masks: Sequence[np.ndarray], frequency: np.ndarray | None
                    ) -> tuple[tuple[int, int], ...]:
    """(hot K, cold K) per layer: K split by each part's share of the layer's activations."""
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


def parse_budget(budget: str | int | float, model_bytes: int) -> int:
    """Bytes from "6GB", "512MiB", an int of bytes, or a fraction in (0, 1] of the model's weights (a float, or a
    string like "0.4")."""
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise JpinferError(f"a fractional gpu_budget must lie in (0, 1], got {budget}")
        return int(budget * model_bytes)
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise JpinferError(f"gpu_budget must be > 0 bytes, got {budget}")
        return int(budget)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
    if not match or match.group(2).lower() not in _UNITS:
        raise JpinferError(f"cannot read gpu_budget {budget!r}: give e.g. '6GB', '512MiB', bytes, or a fraction like 0.4")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:  # "0.4" (as the command line gives it) is a fraction, "1234" bytes
        return parse_budget(float(number) if "." in number else int(number), model_bytes)
    return parse_budget(int(float(number) * _UNITS[unit]), model_bytes)  # 0 bytes is an error there


def _placement_sizes(model: LoadedModel, predictor_bytes: Sequence[int], context: int) -> ModelSizes:
    """What the solver places for ``model``: weights and KV cache at the model's dtype, predictors as stored."""
    dtype_bytes = jnp.dtype(model.weights.dtype).itemsize
    return model_sizes(model.cfg, weight_bytes=dtype_bytes, kv_bytes=dtype_bytes,
                       context=min(context, model.cfg.max_position), predictor_bytes=tuple(predictor_bytes))


def check_gpu_budget(model: LoadedModel, gpu_budget: str | int | float, *, context: int = 2048) -> int:
    """``gpu_budget`` in bytes (``parse_budget``); an ``InfeasibleBudgetError`` stating the minimum when it
    cannot hold even what must live on the accelerator before any neuron (predictors not counted), so
    that a run which ends by placing neurons fails before its long stages, not after them."""
    budget = parse_budget(gpu_budget, nbytes(model.weights))
    split_dense(_placement_sizes(model, [0] * model.cfg.n_layers, context), budget, "strict")
    return budget


def choose_placement(model: LoadedModel, profile: ActivationProfile, predictors: Predictors | None,
                     gpu_budget: str | int | float, *, context: int = 2048,
                     hardware: HardwareProfile | None = None, objective: str | None = None) -> Placement:
    """The solver's placement for ``gpu_budget`` (see ``parse_budget``): maximise the accelerator's
    share of activations (objective ``mass``) or the predicted per-token time (``latency``; the
    default when a measured ``hardware`` is given, else ``mass`` on the rtx4090 preset's
    bandwidths). Embeddings, head, attention, predictors and a ``context``-token KV cache stay on
    the accelerator; a budget below them is an ``InfeasibleBudgetError`` that states the minimum."""
    budget = parse_budget(gpu_budget, nbytes(model.weights))
    base = hardware or preset("rtx4090")
    hw = dataclasses.replace(base.replace(accel_memory=budget, reserved=0), name=f"{base.name}, budget {budget} B")
    predictor_bytes = [p.n_params * 4 for p in predictors.layers] if predictors is not None else [0] * model.cfg.n_layers
    objective = objective or ("latency" if hardware else "mass")
    return solve_placement(profile.frequency(), _placement_sizes(model, predictor_bytes, context), hw,
                           objective=objective, dense_policy="strict")


def default_devices() -> tuple[Any, Any]:
    """(accelerator, host): the first device and the CPU; two simulated CPU devices without a GPU."""
    first = jax.devices()[0]
    if first.platform != "cpu":
        return first, jax.devices("cpu")[0]
    cpus = jax.devices("cpu")
    if len(cpus) < 2:
        raise JpinferError(
            "hybrid mode needs an accelerator, or two CPU devices to play one: call "
            "jax.config.update('jax_num_cpu_devices', 2) before JAX starts"
        )
    return cpus[0], cpus[1]


def sparse_engine(model: LoadedModel, predictors: Predictors, capacity: tuple[int, ...],
                  backend: str = "auto") -> Engine:
    """One device; the model's FFN matrices are replaced by the neuron-major copies."""
    kind = model.cfg.ffn_kind
    states = [SparseLayer(neurons.from_layer(layer, kind), p) for layer, p in zip(model.weights.layers, predictors.layers)]
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    sparse_model = LoadedModel(model.cfg, weights, model.tokenizer, model.source)
    return Engine(sparse_model, FfnStrategy(PredictedSparseFFN(model.cfg, capacity, backend), states, "sparse"))


def _check_layers(model: LoadedModel, thresholds: SparsityThresholds) -> None:
    if thresholds.n_layers != model.cfg.n_layers:
        raise JpinferError(f"got thresholds for {thresholds.n_layers} layers; the model has {model.cfg.n_layers}")


def _layer_thresholds(thresholds: SparsityThresholds, layer: int) -> dict[str, float | None]:
    """``threshold.from_layer``'s threshold arguments for one layer (None: that kind off)."""
    pick = lambda values: None if values is None else float(values[layer])
    return dict(input_threshold=pick(thresholds.input), activation_threshold=pick(thresholds.activation))


def threshold_states(model: LoadedModel, thresholds: SparsityThresholds) -> list[ThresholdFFN]:
    """Per layer the FFN laid out for ``thresholds`` (None for a kind: that kind off)."""
    _check_layers(model, thresholds)
    return [threshold.from_layer(layer, model.cfg.ffn_kind, **_layer_thresholds(thresholds, i))
            for i, layer in enumerate(model.weights.layers)]


def threshold_engine(model: LoadedModel, thresholds: SparsityThresholds, backend: str = "auto") -> Engine:
    """One device; each layer's FFN matrices replaced by their threshold-sparsity layout."""
    weights = dataclasses.replace(model.weights, layers=[without_ffn(layer) for layer in model.weights.layers])
    strategy = FfnStrategy(ThresholdSparseFFN(backend), threshold_states(model, thresholds), "threshold")
    return Engine(LoadedModel(model.cfg, weights, model.tokenizer, model.source), strategy)


def host_dtype_for(model_dtype: Any, host: Any) -> Any:
    """The cold neurons' dtype: float32 on a CPU when the model is 16-bit. XLA:CPU ran bfloat16
    matrix-vector products 5-8x slower than float32 (bench/results/dense_bench.md) and the sparse
    CPU loop 40x slower at 7B width (scratch probe, 2026-12-01): host memory is the cheap side."""
    if host.platform == "cpu" and jnp.dtype(model_dtype).itemsize < 4:
        return jnp.float32
    return model_dtype


def _host_copy(part: neurons.NeuronFFN | ThresholdFFN, host_dtype: Any) -> neurons.NeuronFFN | ThresholdFFN:
    """The cold part's weight arrays in ``host_dtype`` (ids and thresholds as they are)."""
    cast = lambda a: None if a is None else a.astype(host_dtype)
    if isinstance(part, ThresholdFFN):
        return dataclasses.replace(part, gate_up=cast(part.gate_up), down=cast(part.down), b_up=cast(part.b_up))
    return dataclasses.replace(part, rows=cast(part.rows), b_up=cast(part.b_up))


def hybrid_engine(model: LoadedModel, predictors: Predictors | None, hot_masks: Sequence[np.ndarray],
                  capacity: tuple[tuple[int, int], ...] | None, devices: tuple[Any, Any] | None = None,
                  host_dtype: Any = None, thresholds: SparsityThresholds | None = None) -> Engine:
    """Hot neurons (``hot_masks[layer]``, boolean (d_ff,)) on the accelerator, the rest on the host
    in ``host_dtype`` (default ``host_dtype_for``). The predictor picks each part's neurons, or, with
    ``thresholds`` instead (and no predictors or capacity), each part applies the threshold mode."""
    accelerator, host = devices or default_devices()
    host_dtype = host_dtype_for(model.weights.dtype, host) if host_dtype is None else host_dtype
    cfg = model.cfg
    if len(hot_masks) != cfg.n_layers or any(np.shape(m) != (cfg.d_ff,) for m in hot_masks):
        raise JpinferError(f"need one boolean mask of {cfg.d_ff} neurons per layer ({cfg.n_layers})")
    parts, colds, sizes = [], [], []
    for i, (layer, hot) in enumerate(zip(model.weights.layers, hot_masks)):
        hot_ids, cold_ids = np.flatnonzero(hot).astype(np.int32), np.flatnonzero(~np.asarray(hot)).astype(np.int32)
        if thresholds is None:
            full = neurons.from_layer(layer, cfg.ffn_kind)
            hot_part, cold_part = full.subset(hot_ids)[0], full.subset(cold_ids, with_b_down=False)[0]
            predictor = predictors.layers[i]
        else:
            split = lambda ids, with_b_down: threshold.from_layer(
                layer, cfg.ffn_kind, **_layer_thresholds(thresholds, i), neurons=ids, with_b_down=with_b_down)
            hot_part, cold_part, predictor = split(hot_ids, True), split(cold_ids, False), None
        cold_part = _host_copy(cold_part, host_dtype)
        sizes.append((hot_ids.size, cold_ids.size))
        part = AcceleratorLayer(without_ffn(layer), predictor, hot_part, jnp.asarray(hot_ids), jnp.asarray(cold_ids))
        parts.append(jax.device_put(part, accelerator))
        colds.append(jax.device_put(cold_part, host))
    top = jax.device_put(dataclasses.replace(model.weights, layers=[]), accelerator)
    stepper = HybridStepper(cfg, top, parts, colds, capacity or tuple(sizes), accelerator, host)
    weights = dataclasses.replace(top, layers=[part.layer for part in parts])
    return Engine(LoadedModel(cfg, weights, model.tokenizer, model.source), stepper=stepper)


def build_engine(
    model: LoadedModel,
    mode: str = "dense",
    *,
    predictors: Predictors | None = None,
    profile: ActivationProfile | None = None,
    capacity: Capacity = "predicted",
    gpu_budget: str | int | float | None = None,
    placement: Placement | Sequence[np.ndarray] | None = None,
    devices: tuple[Any, Any] | None = None,
    hardware: HardwareProfile | None = None,
    thresholds: SparsityThresholds | str | None = None,
) -> Engine:
    """The engine for ``mode`` (see the module docstring); arguments as in ``jpinfer.load``."""
    check_mode_arguments(mode, predictors, profile, gpu_budget, placement, thresholds,
                         "int8" if int8.is_int8(model.weights) else "float")
    if mode == "dense":
        return Engine(model)
    if mode == "threshold" or thresholds is not None:
        return _threshold_engine(model, mode, profile, thresholds, gpu_budget, placement, devices, hardware)
    predictors.check_model(model)
    if profile is not None:
        predictors.check_profile(profile)
    ks = layer_capacities(model, capacity, profile, predictors)
    if mode == "sparse":
        return sparse_engine(model, predictors, ks)
    masks = _placement_masks(model, profile, predictors, gpu_budget, placement, hardware)
    frequency = None if profile is None else profile.frequency()
    return hybrid_engine(model, predictors, masks, part_capacities(ks, masks, frequency), devices)


def _threshold_engine(model: LoadedModel, mode: str, profile: ActivationProfile | None,
                      thresholds: SparsityThresholds | str | None, gpu_budget: Any, placement: Any,
                      devices: tuple[Any, Any] | None, hardware: HardwareProfile | None) -> Engine:
    """The threshold mode on one device, or (``mode="hybrid"``) split by a placement over two.
    ``thresholds`` None or "profile": the profile's."""
    if profile is not None:
        profile.check_model(model)
    if thresholds is None or isinstance(thresholds, str):  # "profile" (check_mode_arguments refused others)
        thresholds = profile.sparsity_thresholds()
    if mode == "threshold":
        return threshold_engine(model, thresholds)
    _check_layers(model, thresholds)
    masks = _placement_masks(model, profile, None, gpu_budget, placement, hardware)
    return hybrid_engine(model, None, masks, None, devices, thresholds=thresholds)


def _placement_masks(model: LoadedModel, profile: ActivationProfile | None, predictors: Predictors | None,
                     gpu_budget: Any, placement: Any, hardware: HardwareProfile | None) -> list[np.ndarray]:
    """Per layer the boolean accelerator mask: of ``placement``, or of the solver's for ``gpu_budget``."""
    if placement is None:
        placement = choose_placement(model, profile, predictors, gpu_budget, hardware=hardware)
    return placement.masks() if isinstance(placement, Placement) else [np.asarray(m, bool) for m in placement]

