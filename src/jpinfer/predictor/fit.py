"""``train_predictors``: every layer's predictor for a model, from a profile's samples.

Input, measured (``bench/predictor_inputs.py``, bench/results/predictor_inputs.md): the
layer's normalised FFN input, the residual before attention (Deja Vu's lookahead) and the
previous layer's FFN input predict a layer's active set equally well at equal width (within
0.006 of the neurons needed for recall 0.9 and 0.99). Predictors read the FFN input, which
the profiler's samples hold and the decoder hands to every FFN strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer.config import ModelConfig
from jpinfer.errors import JpinferError
from jpinfer.models import quantized, transformer
from jpinfer.models.identity import model_record
from jpinfer.models.loading import LoadedModel, ModelArg, resolve_model
from jpinfer.models.params import Layer
from jpinfer.predictor import sizing
from jpinfer.predictor.store import Predictors, profile_fingerprint
from jpinfer.predictor.train import LayerData, TrainConfig, train_layer, with_cutoff
from jpinfer.profiler import ActivationProfile, PredictorSamples, ProfileSettings
from jpinfer.profiler import profile as run_profile

DEFAULT_SAMPLES = 65536
BUDGET = 0.10  # of the model's parameters
STRONG_QUANTILE = 0.9  # strong pairs: the top 10% of a layer's active pairs by contribution
LIMIT_SAMPLES = 4096  # samples the strong limit is estimated on (6M pairs for the default model)


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """The quick proxy training that compares widths: a subset of the samples, few epochs."""

    samples: int = 16384
    max_epochs: int = 3
    start_rank: int = 64


def model_params(model: ModelArg) -> int:
    """Parameters of the model's weights (what the predictor budget is a fraction of): a quantized matrix
    counts as the matrix it stands for, not as its stored bytes and scales, so every weights format of a
    model gets the same budget."""
    leaves = jax.tree_util.tree_leaves(resolve_model(model).weights, is_leaf=quantized.is_quantized)
    return sum(int(np.prod(leaf.shape)) for leaf in leaves)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _contributions(layer: Layer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """|a_i| * ||down_i||: how far each neuron moves the FFN output, per sample (n, d_ff)."""
    a = transformer.ffn_activations(layer, x.astype(jnp.float32), cfg)
    return jnp.abs(a) * jnp.linalg.norm(quantized.as_float(layer.w_down), axis=0)


def strong_limit(model: LoadedModel, layer: int, inputs: np.ndarray, masks: np.ndarray,
                 quantile: float = STRONG_QUANTILE) -> float:
    """The contribution |a_i| * ||down_i|| above which an active pair is strong: the ``quantile``
    of the active pairs' contributions over the given samples (+inf if none is active).

    Why strong pairs: measured on the default model, predictors cut off for 0.99 recall of
    active neurons alone raised perplexity 6.6% while computing 94% of the neurons (the oracle
    at that count: +0.0%): the 1% they missed included large activations. Contributions are
    recomputed from the stored float16 inputs and the model's weights, so the samples need no
    extra field.
    """
    c = np.asarray(_contributions(model.weights.layers[layer], jnp.asarray(inputs), model.cfg))
    active = np.unpackbits(masks, axis=-1, count=model.cfg.d_ff).astype(bool)
    return float(np.quantile(c[active], quantile)) if active.any() else np.inf


def strong_masks(model: LoadedModel, layer: int, inputs: np.ndarray, masks: np.ndarray, limit: float,
                 chunk: int = 4096) -> np.ndarray:
    """Packed masks of the active pairs whose contribution exceeds ``limit`` (``strong_limit``)."""
    out = np.empty_like(masks)
    for start in range(0, len(inputs), chunk):
        part = slice(start, start + chunk)
        c = np.asarray(_contributions(model.weights.layers[layer], jnp.asarray(inputs[part]), model.cfg))
        active = np.unpackbits(masks[part], axis=-1, count=model.cfg.d_ff).astype(bool)
        out[part] = np.packbits(active & (c > limit), axis=-1)
    return out


def _layer_data(model: LoadedModel, samples: PredictorSamples, layer: int, count: int,
                held_out: float | None = None) -> LayerData:
    """The first ``count`` samples of one layer (verified on first read) with their strong masks;
    with ``held_out``, only that tail (``LayerData.split``), strong limit still from the head.
    The limit comes from the first ``LIMIT_SAMPLES`` samples, so a layer's training and its
    held-out tail always share it."""
    inputs, masks = samples.arrays(layer, count)
    limit = strong_limit(model, layer, inputs[:LIMIT_SAMPLES], masks[:LIMIT_SAMPLES])
    data = LayerData(inputs, masks, samples.d_ff)
    if held_out is not None:
        data = data.split(held_out)[1]
    return dataclasses.replace(data, strong=strong_masks(model, layer, data.inputs, data.masks, limit))


def train_predictors(
    model: ModelArg = None,
    profile: ActivationProfile | None = None,
    *,
    ranks: int | Sequence[int] | None = None,
    budget: float = BUDGET,
    config: TrainConfig = TrainConfig(),
    search: SearchConfig = SearchConfig(),
    max_samples: int | None = None,
    progress: bool = True,
) -> Predictors:
    """Train one predictor per layer of ``model`` on ``profile``'s samples.

    ``profile`` None profiles the model first (default corpus, ``DEFAULT_SAMPLES`` samples).
    ``ranks``: None sizes each layer adaptively (``sizing``) under ``budget`` (a fraction of
    the model's parameters); an int gives every layer that width, a sequence one per layer
    (given widths are not held to the budget).
    ``config.recall`` is the held-out recall each layer's cut-off is chosen for.
    """
    loaded = resolve_model(model)
    cfg = loaded.cfg
    if profile is None:
        profile = run_profile(loaded, settings=ProfileSettings(n_samples=DEFAULT_SAMPLES), progress=progress)
    profile.check_model(loaded)
    fingerprint = profile.model_fingerprint
    samples = profile.samples()
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction of the model's parameters in (0, 1], got {budget}")
    n = len(samples) if max_samples is None else min(len(samples), max_samples)
    if n < 64:
        raise JpinferError(f"{n} predictor samples are too few to train on: profile with n_samples >= 1024")
    t0 = time.perf_counter()

    def layer_data(layer: int, count: int) -> LayerData:
        return _layer_data(loaded, samples, layer, count)

    budget_params = int(budget * model_params(loaded))
    search_record = None
    if ranks is None:
        ranks, search_record = _search(profile, layer_data, min(n, search.samples), config, search, budget_params,
                                       progress)
    elif isinstance(ranks, int):
        ranks = [ranks] * cfg.n_layers
    ranks = [int(r) for r in ranks]
    if len(ranks) != cfg.n_layers or min(ranks) < 1:
        raise ValueError(f"ranks must be one integer >= 1 per layer ({cfg.n_layers}), got {ranks}")

    layers, scores, epochs = [], [], []
    for layer in tqdm(range(cfg.n_layers), desc="training predictors", unit="layer", disable=not progress):
        result = train_layer(layer_data(layer, n), ranks[layer], config, progress=progress, desc=f"layer {layer}")
        layers.append(result.weights)
        scores.append(dataclasses.asdict(result.scores))
        epochs.append(result.epochs)
    meta = {
        "model_name": cfg.name, "model": model_record(loaded), "model_fingerprint": fingerprint,
        "profile_fingerprint": profile_fingerprint(profile),
        "thresholds": np.asarray(profile.thresholds, np.float32).tolist(), "score": profile.meta.get("score"),
        "recall": config.recall, "strong_recall": config.strong_recall, "strong_quantile": STRONG_QUANTILE,
        "n_samples": n, "train_config": dataclasses.asdict(config), "ranks": ranks,
        "budget": budget, "budget_params": budget_params, "held_out_scores": scores, "epochs": epochs,
        "sizing": search_record, "seconds": time.perf_counter() - t0,
    }
    return Predictors(layers, meta)


def retune(model: ModelArg, predictors: Predictors, profile: ActivationProfile, recall: float,
           strong_recall: float | None = None) -> Predictors:
    """The same predictors with every layer's cut-off chosen for another ``recall`` (and
    ``strong_recall``, default: as trained) on the held-out samples they were trained with
    (no retraining: a new operating point in seconds)."""
    strong_recall = predictors.meta["train_config"]["strong_recall"] if strong_recall is None else strong_recall
    for name, value in (("recall", recall), ("strong_recall", strong_recall)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must lie in (0, 1], got {value}")
    loaded = resolve_model(model)
    predictors.check_model(loaded)
    predictors.check_profile(profile)
    samples = profile.samples()
    n, held_out = predictors.meta["n_samples"], predictors.meta["train_config"]["held_out"]
    layers, scores = [], []
    for layer, weights in enumerate(predictors.layers):
        held = _layer_data(loaded, samples, layer, n, held_out)
        weights, layer_scores = with_cutoff(weights, held, recall, strong_recall)
        layers.append(weights)
        scores.append(dataclasses.asdict(layer_scores))
    return Predictors(layers, predictors.meta | {"recall": recall, "strong_recall": strong_recall,
                                                 "held_out_scores": scores})


def _search(profile, layer_data, n, config, search, budget_params, progress) -> tuple[list[int], dict]:
    """Adaptive ranks from proxy trainings on the first ``n`` samples of each layer."""
    n_layers, d_ff = profile.n_layers, profile.d_ff
    quick = dataclasses.replace(config, max_epochs=search.max_epochs)
    data: dict[int, LayerData] = {}
    bar = tqdm(desc="sizing predictors", unit="trial", disable=not progress, dynamic_ncols=True)

    def trial(layer: int, rank: int) -> sizing.Trial:
        if layer not in data:
            data.clear()  # one layer's subset in memory at a time: the search visits layers in order
            data[layer] = layer_data(layer, n)
        result = train_layer(data[layer], rank, quick, progress=False)
        d_model = data[layer].inputs.shape[1]
        n_params = sizing.predictor_params(rank, d_model, d_ff)
        predicted = result.scores.predicted
        bar.update(1)
        bar.set_postfix(layer=layer, rank=rank, predicted=f"{predicted:.3f}")
        return sizing.Trial(rank, n_params, predicted,
                            sizing.layer_cost(n_params, predicted, d_ff,
                                              sizing.neuron_params(profile.ffn_kind, d_model)))

    try:
        start = sizing.start_ranks(profile, search.start_rank)
        ranks, trials = sizing.search(n_layers, trial, start, budget_params)
    finally:
        bar.close()
    record = {"start": start, "samples": n, "max_epochs": search.max_epochs,
              "trials": {str(layer): {str(r): dataclasses.asdict(t) for r, t in by_rank.items()}
                         for layer, by_rank in trials.items()}}
    return ranks, record
