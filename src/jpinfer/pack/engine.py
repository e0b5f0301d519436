"""A pack as ``jpinfer.load``'s arguments: what each engine mode takes from it."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.pack.stages import prepare
from jpinfer.pack.settings import PackSettings
from jpinfer.pack.store import Pack


def default_pack(model: ModelArg = None, progress: bool = True) -> Pack:
    """The pack of ``model`` (default: the default model) with the default ``PackSettings``, in the
    cache directory: prepared on first use (the default model's in about five minutes on two CPU
    cores), then verified and reused."""
    return prepare(model, None, PackSettings(), progress=progress)


def pack_for(model: ModelArg = None, path: str | os.PathLike | None = None) -> Pack:
    """The pack at ``path``, checked to be ``model``'s (None: the default model), or (``path`` None) the
    model's default pack."""
    loaded = resolve_model(model)
    return default_pack(loaded) if path is None else Pack.load(path, loaded)


def mode_arguments(pack: Pack, mode: str, dtype: Any, *, predictors: Any = None, profile: Any = None,
                   placement: Any = None, gpu_budget: Any = None, thresholds: Any = None) -> dict[str, Any]:
    """``build_engine``'s keyword arguments for ``mode`` on a model loaded in ``dtype`` (a name or a
    dtype): what is given wins, the rest the mode needs comes from ``pack`` (the caller checks the
    pack is the model's).

    The profile carries the threshold mode's thresholds; the predictors serve the predictor modes
    (not the threshold ones); the hybrid takes the placement unless a ``gpu_budget`` or placement is
    given, and when the pack's placement was sized for another dtype (bytes per neuron) it is solved
    again for this one under the pack's budget.
    """
    args = dict(predictors=predictors, profile=profile, placement=placement, gpu_budget=gpu_budget,
                thresholds=thresholds)
    if mode == "dense":
        return args
    if profile is None:
        args["profile"] = pack.profile
    if mode != "threshold" and thresholds is None and predictors is None:
        args["predictors"] = pack.predictors
    if mode == "hybrid" and placement is None and gpu_budget is None:
        if pack.dtype == jnp.dtype(dtype).name:
            args["placement"] = pack.placement
        else:
            args["gpu_budget"] = pack.settings.gpu_budget
    return args
