"""jpinfer: activation-sparse LLM inference in JAX.

Public API: ``load`` a model into an ``Engine``, ``generate`` text, configure with
``GenerationConfig``, ``profile`` neuron activity into an ``ActivationProfile``,
``train_predictors`` from its samples into ``Predictors``. See README.md.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import jax

from jpinfer.config import ModelConfig
from jpinfer.errors import ArtifactError, CacheError, CheckpointError, JpinferError
from jpinfer.models.loading import LoadedModel, load_model, parse_dtype
from jpinfer.modes.arguments import check_mode, check_mode_arguments
from jpinfer.profiler import ActivationProfile, profile
from jpinfer.runtime.engine import Engine, FfnStrategy, GenerationConfig, GenerationResult

__all__ = [
    "load", "load_model", "generate", "Engine", "FfnStrategy", "GenerationConfig", "GenerationResult", "ModelConfig",
    "LoadedModel", "JpinferError", "CheckpointError", "ArtifactError", "CacheError", "profile", "ActivationProfile",
    "train_predictors", "Predictors", "prepare",
]
__version__ = "0.1.0"

_engines: dict[str, Engine] = {}
_LAZY = {"train_predictors": "predictor", "Predictors": "predictor", "prepare": "pack"}  # Flax loads only when used


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"jpinfer.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jpinfer' has no attribute {name!r}")


def load(
    source: str | pathlib.Path | None = None,
    *,
    dtype: Any = "float32",
    ffn_kind: str | None = None,
    mode: str = "dense",
    pack: Any = None,
    predictors: Any = None,
    profile: ActivationProfile | str | pathlib.Path | None = None,
    capacity: str | float | int | Sequence[int] = "predicted",
    gpu_budget: str | int | float | None = None,
    placement: Any = None,
    thresholds: Any = None,
    weights: str = "float",
) -> Engine:
    """Load a checkpoint (HF directory, .gguf file, or None for the default model) as an Engine.

    ``mode``: ``"dense"`` (default), ``"sparse"`` (the predictor picks each token's neurons, one
    device) or ``"hybrid"`` (hot neurons on the accelerator, cold on the CPU; without a GPU two
    simulated CPU devices). Sparse modes need ``predictors`` (a ``Predictors`` or its directory).
    ``capacity``, the most neurons a token computes per layer: "predicted" (the 0.99 quantile
    of what the predictors pick on held-out samples), a float quantile of the ``profile``'s
    active counts, an int, or one int per layer. ``hybrid`` needs the ``profile`` (an
    ``ActivationProfile`` or its file) and ``gpu_budget`` ("6GB", "512MiB", bytes, or a
    fraction of the model's weights; the solver places the neurons), or a ``placement`` (a
    ``solver.Placement`` or one boolean mask per layer, True = accelerator). ``"threshold"``
    (training-free: small activations and FFN inputs skipped) needs ``thresholds`` (a
    ``profiler.SparsityThresholds``) or a ``profile`` carrying them; ``"hybrid"`` given
    ``thresholds`` (or ``"profile"``: the profile's) instead of predictors splits that mode over
    the accelerator and the CPU.

    ``pack`` (a directory made by ``jpinfer prepare``, or a ``pack.Pack``) supplies the profile,
    predictors, placement and thresholds a mode needs where they are not given (``dense`` ignores
    it). For the default model (``source`` None) the other modes use its default pack when none of
    ``pack``, ``predictors``, ``profile`` and ``placement`` is given (and ``thresholds`` is None or
    "profile"): prepared into the cache on first use (about five minutes on two CPU cores), reused after.

    ``weights``: ``"float"`` (every tensor in ``dtype``) or ``"int8"`` (W8A8: the projections and
    the head quantized at load, one scale per output, after SmoothQuant's migration calibrated on a
    few thousand tokens of bundled text, ``profiler.smoothing``; modes ``dense`` and ``threshold``).
    """
    check_mode(mode, weights)  # before anything loads: fail fast
    given = dict(predictors=predictors, profile=profile, placement=placement, gpu_budget=gpu_budget,
                 thresholds=thresholds)
    default_pack = (mode != "dense" and pack is None and source is None and thresholds in (None, "profile")
                    and all(given[k] is None for k in ("predictors", "profile", "placement")))
    if mode != "dense" and pack is not None:
        from jpinfer.pack import Pack, mode_arguments

        pack = pack if isinstance(pack, Pack) else Pack.load(pack)  # verified before the model loads
        given = mode_arguments(pack, mode, parse_dtype(dtype), **given)
    if not default_pack:  # before the model loads: fail fast
        check_mode_arguments(mode, weights=weights, **given)
    if mode == "dense":
        return Engine(_load_model(source, dtype, ffn_kind, weights))
    from jpinfer.modes import build_engine, default_devices  # loads the predictor package (Flax)

    if mode == "hybrid":  # load on the host: the accelerator receives only its share
        with jax.default_device(default_devices()[1]):
            model = load_model(source, dtype=dtype, ffn_kind=ffn_kind)
    else:
        model = _load_model(source, dtype, ffn_kind, weights)
    if default_pack:
        from jpinfer.pack import default_pack as cached_pack, mode_arguments

        pack = cached_pack(model)
        given = mode_arguments(pack, mode, parse_dtype(dtype), **given)
        check_mode_arguments(mode, weights=weights, **given)
    elif pack is not None:
        pack.check_model(model)
    profile = given.pop("profile")
    if isinstance(profile, (str, pathlib.Path)):
        profile = ActivationProfile.load(profile, model)
    if isinstance(given["predictors"], (str, pathlib.Path)):
        from jpinfer.predictor import Predictors

        given["predictors"] = Predictors.load(given["predictors"], model, profile)
    return build_engine(model, mode, profile=profile, capacity=capacity, **given)


def _load_model(source: Any, dtype: Any, ffn_kind: str | None, weights: str) -> LoadedModel:
    model = load_model(source, dtype=dtype, ffn_kind=ffn_kind)
    if weights == "int8":
        from jpinfer.profiler.smoothing import int8_model

        model = int8_model(model, progress=True)
    return model


def generate(
    prompt: str | Sequence[int] | Sequence[str],
    model: str | pathlib.Path | Engine | None = None,
    **kwargs: Any,
) -> GenerationResult | list[GenerationResult]:
    """Generate text. ``model`` is an Engine, a checkpoint path, or None for the default model
    (loaded once and reused). Keyword arguments are GenerationConfig fields."""
    config = GenerationConfig(**kwargs)
    if isinstance(model, Engine):
        engine = model
    else:
        key = str(model)
        if key not in _engines:
            _engines[key] = load(model)
        engine = _engines[key]
    return engine.generate(prompt, config)
