"""Engine modes: ``dense``, ``sparse`` (predictor-driven, one device), ``hybrid`` (hot neurons on the
accelerator, cold ones on the CPU device; with thresholds, the threshold mode split so) and
``threshold`` (training-free). ``jpinfer.load(mode=...)`` is the front door.

Modules: catalog (the modes as objects: what each needs, takes from a pack, checks and builds;
``get_mode``), engines (the sparse modes' engines from a model and what they need), hybrid (the
two-device step), placement (GPU budgets and the solver's placement), devices (accelerator and
host), evaluation (an engine's decode step as an FFN strategy over whole windows).
"""

from __future__ import annotations

from typing import Any, Sequence

from jpinfer.models.loading import LoadedModel
from jpinfer.modes.catalog import MODE_NAMES, MODES, REFERENCE_MODE, Mode, ModeInputs, get_mode
from jpinfer.runtime.engine import Engine

__all__ = ["MODE_NAMES", "MODES", "REFERENCE_MODE", "Mode", "ModeInputs", "build_engine", "get_mode"]


def build_engine(
    model: LoadedModel,
    mode: str = "dense",
    *,
    predictors: Any = None,
    profile: Any = None,
    capacity: str | float | int | Sequence[int] = "predicted",
    gpu_budget: str | int | float | None = None,
    placement: Any = None,
    devices: tuple[Any, Any] | None = None,
    hardware: Any = None,
    thresholds: Any = None,
) -> Engine:
    """The engine for ``mode`` on a loaded ``model``; arguments as in ``jpinfer.load`` (objects or
    paths), ``devices`` (accelerator, host) and ``hardware`` (for the hybrid's placement)."""
    from jpinfer.models import quantized

    chosen = get_mode(mode, thresholds=thresholds, weights=quantized.weights_format(model.weights))
    inputs = ModeInputs(predictors, profile, placement, gpu_budget, thresholds, capacity)
    chosen.check(inputs)
    return chosen.build(model, inputs, devices=devices, hardware=hardware)
