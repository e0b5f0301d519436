"""Neuron placement: which FFN neurons live on the accelerator, under a memory budget.

    from jpinfer.solver import solve_placement, synthetic_frequencies
    placement = solve_placement(freqs, cfg, "rtx4090", objective="latency", context=4096)
    placement.save(pack_dir / "placement")
"""

from jpinfer.solver.frequencies import load_frequencies, synthetic_frequencies
from jpinfer.solver.hardware import PRESETS, HardwareProfile, measure_hardware, preset
from jpinfer.solver.memory import InfeasibleBudgetError, ModelSizes, model_sizes
from jpinfer.solver.milp import SolverError
from jpinfer.solver.result import Placement, PlacementError, PlacementVersionError
from jpinfer.solver.solve import solve_placement

__all__ = [
    "PRESETS",
    "HardwareProfile",
    "InfeasibleBudgetError",
    "ModelSizes",
    "Placement",
    "PlacementError",
    "PlacementVersionError",
    "SolverError",
    "load_frequencies",
    "measure_hardware",
    "model_sizes",
    "preset",
    "solve_placement",
    "synthetic_frequencies",
]
