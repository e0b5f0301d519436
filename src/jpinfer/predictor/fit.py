"""``train_predictors``: every layer's predictor for a model, from a profile's samples.

Input choice, measured (``bench/predictor_inputs.py``, bench/results/predictors.md): the
layer's own normalised FFN input predicts its active set best; the residual stream before
attention (Deja Vu's lookahead) and the previous layer's FFN input are worse at equal
width, so predictors read the FFN input, which the profiler's samples hold.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from jpinfer.errors import JpinferError
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.predictor import sizing
from jpinfer.predictor.store import Predictors, profile_fingerprint
from jpinfer.predictor.train import LayerData, TrainConfig, train_layer, with_cutoff
from jpinfer.profiler import ActivationProfile, model_fingerprint, profile as run_profile

DEFAULT_SAMPLES = 65536
BUDGET = 0.10  # of the model's parameters


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """The quick proxy training that compares widths: a subset of the samples, few epochs."""

    samples: int = 16384
    max_epochs: int = 3
    start_rank: int = 64


def model_params(model: ModelArg) -> int:
    import jax

    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(resolve_model(model).weights))


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
    the model's parameters); an int gives every layer that width; a sequence one per layer.
    ``config.recall`` is the held-out recall each layer's cut-off is chosen for.
    """
    loaded = resolve_model(model)
    cfg = loaded.cfg
    if profile is None:
        profile = run_profile(loaded, n_samples=DEFAULT_SAMPLES, progress=progress)
    fingerprint = model_fingerprint(cfg, loaded.weights)
    if profile.model_fingerprint != fingerprint:
        profile.check_model(loaded)
    samples = profile.samples()
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction of the model's parameters in (0, 1], got {budget}")
    n = len(samples) if max_samples is None else min(len(samples), max_samples)
    if n < 64:
        raise JpinferError(f"{n} predictor samples are too few to train on: profile with n_samples >= 1024")
    t0 = time.perf_counter()

    def layer_data(layer: int, count: int) -> LayerData:
        return LayerData(*samples.arrays(layer, count), cfg.d_ff)

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
        "model_name": cfg.name, "model_fingerprint": fingerprint, "profile_fingerprint": profile_fingerprint(profile),
        "thresholds": np.asarray(profile.thresholds, np.float32).tolist(), "score": profile.meta.get("score"),
        "recall": config.recall, "n_samples": n, "train_config": dataclasses.asdict(config), "ranks": ranks,
        "budget": budget, "budget_params": budget_params, "held_out_scores": scores, "epochs": epochs,
        "sizing": search_record, "seconds": time.perf_counter() - t0,
    }
    return Predictors(layers, meta)


def retune(predictors: Predictors, profile: ActivationProfile, recall: float) -> Predictors:
    """The same predictors with every layer's cut-off chosen for another ``recall`` on the held-out
    samples they were trained with (no retraining: a new operating point in seconds)."""
    if not 0 < recall <= 1:
        raise ValueError(f"recall must lie in (0, 1], got {recall}")
    predictors.check_profile(profile)
    samples = profile.samples()
    n, held_out = predictors.meta["n_samples"], predictors.meta["train_config"]["held_out"]
    layers, scores = [], []
    for layer, weights in enumerate(predictors.layers):
        data = LayerData(*samples.arrays(layer, n), profile.d_ff)
        weights, layer_scores = with_cutoff(weights, data.split(held_out)[1], recall)
        layers.append(weights)
        scores.append(dataclasses.asdict(layer_scores))
    return Predictors(layers, predictors.meta | {"recall": recall, "held_out_scores": scores})


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
                            sizing.layer_cost(n_params, predicted, d_ff, (3 if profile.ffn_kind != "relu" else 2) * d_model))

    try:
        start = sizing.start_ranks(profile, search.start_rank)
        ranks, trials = sizing.search(n_layers, trial, start, budget_params)
    finally:
        bar.close()
    record = {"start": start, "samples": n, "max_epochs": search.max_epochs,
              "trials": {str(layer): {str(r): dataclasses.asdict(t) for r, t in by_rank.items()}
                         for layer, by_rank in trials.items()}}
    return ranks, record
