"""Engine modes: ``dense``, ``sparse`` (predictor-driven, one device) and ``hybrid`` (hot neurons
on the accelerator, cold ones on the CPU device). ``build_engine`` makes one from a loaded
model, its predictors, profile and placement; ``jpinfer.load(mode=...)`` is the front door.
Modules: arguments (what each mode needs, checked first), sparse (the one-device sparse FFN),
hybrid (the two-device step), build (capacities, budgets, placement, assembling the engines).
The names of ``build`` load on first use: it imports the predictor package (Flax), which
checking arguments does not need.
"""

from typing import Any

from jpinfer.modes.arguments import check_mode_arguments

__all__ = ["build_engine", "check_gpu_budget", "check_mode_arguments", "choose_placement", "default_devices",
           "layer_capacities", "parse_budget"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jpinfer.modes import build

        return getattr(build, name)
    raise AttributeError(f"module 'jpinfer.modes' has no attribute {name!r}")
