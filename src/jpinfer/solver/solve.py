"""solve_placement: frequencies + model sizes + hardware -> Placement, by any method."""

from __future__ import annotations

import time
from typing import Literal, Sequence

import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.solver import baselines
from jpinfer.solver.frequencies import check_frequencies
from jpinfer.solver.groups import make_groups
from jpinfer.solver.hardware import HardwareProfile, preset
from jpinfer.solver.latency import CostModel, evaluate
from jpinfer.solver.memory import DensePolicy, ModelSizes, model_sizes, split_dense
from jpinfer.solver.milp import OBJECTIVES, Objective, solve_milp
from jpinfer.solver.refine import refine
from jpinfer.solver.result import Placement

Method = Literal["milp", "greedy", "layers"]
METHODS = ("milp", "greedy", "layers")


def solve_placement(
    frequencies: Sequence[np.ndarray] | np.ndarray,
    model: ModelConfig | ModelSizes,
    hardware: HardwareProfile | str,
    *,
    objective: Objective = "mass",
    method: Method = "milp",
    group_size: int = 64,
    time_limit: float = 60.0,
    mip_gap: float = 1e-3,
    dense_policy: DensePolicy = "offload",
    **size_options: float | int | Sequence[int],
) -> Placement:
    """Choose the FFN neurons that live on the accelerator.

    frequencies: one array per layer of activation frequencies (count / tokens).
    model: a ModelConfig (``size_options`` go to ``model_sizes``: weight_bytes, context,
    batch, kv_bytes, predictor_bytes, vector_bytes, act_bytes) or explicit ModelSizes.
    hardware: a HardwareProfile or a preset name. objective: "mass" (maximise the
    accelerator's share of activation mass, as in the PowerInfer paper) or "latency"
    (minimise the predicted per-token time); used by method "milp" only, the baselines
    "greedy" and "layers" are heuristics. Raises InfeasibleBudgetError (a ValueError)
    stating the minimum budget when the dense part cannot fit.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    if isinstance(model, ModelConfig):
        sizes = model_sizes(model, **size_options)
    elif isinstance(model, ModelSizes):
        if size_options:
            raise ValueError(
                f"options {sorted(size_options)} apply to a ModelConfig; bake them into the ModelSizes instead"
            )
        sizes = model
    else:
        raise ValueError(f"model must be a ModelConfig or ModelSizes, got {type(model).__name__}")
    hw = preset(hardware) if isinstance(hardware, str) else hardware
    freqs = check_frequencies(frequencies, sizes.n_neurons)
    if len(freqs) != sizes.n_layers:
        raise ValueError(f"got frequencies for {len(freqs)} layers, but the model has {sizes.n_layers}")

    split = split_dense(sizes, hw.budget, dense_policy)
    cost = CostModel.build(sizes, hw, split)
    capacity = split.ffn_budget // sizes.neuron_bytes
    min_neurons = cost.min_neurons([np.sort(f)[::-1] for f in freqs])
    start = time.perf_counter()
    if method == "milp":
        groups = make_groups(freqs, group_size)
        chosen, info = solve_milp(
            groups, cost, min_neurons, capacity, objective, time_limit=time_limit, mip_gap=mip_gap
        )
        masks = refine(groups.masks(chosen), freqs, capacity, min_neurons, cost, objective)
        solve = dict(
            objective=objective,
            status=info.status,
            objective_value=info.objective_value,
            gap=info.gap,
            solve_time=info.solve_time,
            group_size=group_size,
        )
    else:
        masks = (baselines.greedy if method == "greedy" else baselines.layers)(freqs, capacity)
        solve = dict(
            objective=None,
            status="heuristic",
            objective_value=None,
            gap=None,
            solve_time=time.perf_counter() - start,
            group_size=None,
        )
    share, seconds, layer_times = evaluate(cost, freqs, masks)
    return Placement.from_masks(
        masks,
        accel_share=share,
        per_token_time=seconds,
        layer_times=layer_times,
        min_neurons=min_neurons,
        dense_accel_bytes=split.accel_bytes,
        ffn_accel_bytes=int(sum(m.sum() for m in masks)) * sizes.neuron_bytes,
        budget_bytes=split.budget,
        cpu_dense=split.cpu_parts,
        method=method,
        hardware=hw.to_dict(),
        **solve,
    )
