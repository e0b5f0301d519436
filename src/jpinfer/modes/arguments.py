"""What each engine mode needs, checked before anything loads (a model load takes seconds)."""

from __future__ import annotations

from typing import Any

from jpinfer.config import ENGINE_MODES, WEIGHT_FORMATS
from jpinfer.errors import JpinferError

INT8_MODES = ("dense", "threshold")  # the modes whose matrices have an int8 form (models.int8)


def check_mode(mode: str, weights: str = "float") -> None:
    """Raise JpinferError when ``mode`` is unknown, or when ``weights`` ("float" or "int8") has no form in it."""
    if mode not in ENGINE_MODES:
        raise JpinferError(f"unknown mode {mode!r}; choose one of {', '.join(ENGINE_MODES)}")
    if weights not in WEIGHT_FORMATS:
        raise JpinferError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "int8" and mode not in INT8_MODES:
        raise JpinferError(f"int8 weights run in the modes {' and '.join(INT8_MODES)}; mode {mode!r} reads float "
                           "neuron bundles: use mode 'threshold' (training-free sparsity) or float weights")


def check_mode_arguments(mode: str, predictors: Any, profile: Any, gpu_budget: Any, placement: Any,
                         thresholds: Any = None, weights: str = "float") -> None:
    """Raise JpinferError when ``mode`` is unknown or lacks what it needs, or when ``weights``
    ("float" or "int8") has no form in that mode (``check_mode``).

    ``threshold`` needs ``thresholds`` (``profiler.SparsityThresholds``) or a profile carrying them;
    ``hybrid`` given thresholds instead of predictors is the threshold mode split over two devices."""
    check_mode(mode, weights)
    if mode == "dense":
        return
    if mode == "threshold" or (mode == "hybrid" and thresholds is not None):
        if predictors is not None:
            raise JpinferError("threshold sparsity needs no predictors: drop predictors= (or use mode 'sparse')")
        if profile is None and (thresholds is None or isinstance(thresholds, str)):
            raise JpinferError("threshold sparsity needs thresholds: a profile carrying them (profile=PATH, made by "
                               "jpinfer profile --activation-sparsity S) or thresholds=SparsityThresholds")
        if isinstance(thresholds, str) and thresholds != "profile":
            raise JpinferError(f"thresholds must be a SparsityThresholds or 'profile' (the profile's), got {thresholds!r}")
    elif predictors is None:
        raise JpinferError(f"mode {mode!r} needs predictors (jpinfer train-predictors, then predictors=PATH), "
                           "or mode 'threshold' (training-free)")
    elif thresholds is not None:
        raise JpinferError(f"mode {mode!r} chooses neurons with predictors: drop thresholds= (or use mode 'threshold')")
    if mode == "hybrid":
        if placement is None and (gpu_budget is None or profile is None):
            raise JpinferError("mode 'hybrid' needs a placement, or gpu_budget=... and the profile to solve one")
        if placement is not None and gpu_budget is not None:
            raise JpinferError("give either placement or gpu_budget, not both")
