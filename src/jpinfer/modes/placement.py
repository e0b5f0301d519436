"""Where the hybrid's neurons live: a GPU budget read, checked and solved into a placement.

``parse_budget`` reads "6GB", "512MiB", bytes or a fraction of the model's weights (of its float weights:
for an int8 or 4-bit model, of the float weights it stands for, so that one budget means about the same
memory for every weights format of a model; its quantized neurons take fewer bytes of it, and a fraction of
its own bytes could not even hold a small model's KV cache: the default model's int4 weights are 95 MB,
its 2048-token float32 KV cache 94 MB);
``check_gpu_budget`` refuses, before any long stage, a budget that cannot hold what must live on
the accelerator before any neuron; ``choose_placement`` runs the solver; ``placement_masks`` turns
a placement (or the solver's for a budget) into one boolean accelerator mask per layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jpinfer.errors import JpinferError
from jpinfer.models import quantized
from jpinfer.models.loading import LoadedModel
from jpinfer.solver import HardwareProfile, ModelSizes, Placement, model_sizes, preset, solve_placement
from jpinfer.solver.memory import split_dense

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


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
        raise JpinferError(f"cannot read gpu_budget {budget!r}: give e.g. '6GB', '512MiB', bytes, "
                           "or a fraction like 0.4")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:  # "0.4" (as the command line gives it) is a fraction, "1234" bytes
        return parse_budget(float(number) if "." in number else int(number), model_bytes)
    return parse_budget(int(float(number) * _UNITS[unit]), model_bytes)  # 0 bytes is an error there


def _placement_sizes(model: LoadedModel, predictor_bytes: Sequence[int], context: int) -> ModelSizes:
    """What the solver places for ``model``: weights at the bytes its FFN weights take (the dtype's, or an int8 or
    4-bit format's with its scales), the KV cache at the model's dtype, predictors as stored."""
    return model_sizes(model.cfg, weight_bytes=quantized.bytes_per_weight(model.weights),
                       kv_bytes=jnp.dtype(model.weights.dtype).itemsize,
                       context=min(context, model.cfg.max_position), predictor_bytes=tuple(predictor_bytes))


def check_gpu_budget(model: LoadedModel, gpu_budget: str | int | float, *, context: int = 2048) -> int:
    """``gpu_budget`` in bytes (``parse_budget``); an ``InfeasibleBudgetError`` stating the minimum when it
    cannot hold even what must live on the accelerator before any neuron (predictors not counted), so
    that a run which ends by placing neurons fails before its long stages, not after them."""
    budget = parse_budget(gpu_budget, quantized.float_bytes(model.weights))
    split_dense(_placement_sizes(model, [0] * model.cfg.n_layers, context), budget, "strict")
    return budget


def choose_placement(model: LoadedModel, profile: Any, predictors: Any, gpu_budget: str | int | float, *,
                     context: int = 2048, hardware: HardwareProfile | None = None, objective: str | None = None
                     ) -> Placement:
    """The solver's placement for ``gpu_budget`` (see ``parse_budget``): maximise the accelerator's
    share of activations (objective ``mass``) or the predicted per-token time (``latency``; the
    default when a measured ``hardware`` is given, else ``mass`` on the rtx4090 preset's
    bandwidths). Embeddings, head, attention, predictors and a ``context``-token KV cache stay on
    the accelerator; a budget below them is an ``InfeasibleBudgetError`` that states the minimum."""
    budget = parse_budget(gpu_budget, quantized.float_bytes(model.weights))
    base = hardware or preset("rtx4090")
    hw = dataclasses.replace(base.replace(accel_memory=budget, reserved=0), name=f"{base.name}, budget {budget} B")
    n_layers = model.cfg.n_layers
    predictor_bytes = [p.n_params * 4 for p in predictors.layers] if predictors is not None else [0] * n_layers
    objective = objective or ("latency" if hardware else "mass")
    return solve_placement(profile.frequency(), _placement_sizes(model, predictor_bytes, context), hw,
                           objective=objective, dense_policy="strict")


def placement_masks(model: LoadedModel, profile: Any, predictors: Any, gpu_budget: Any,
                    placement: Placement | Sequence[np.ndarray] | None, hardware: HardwareProfile | None
                    ) -> list[np.ndarray]:
    """Per layer the boolean accelerator mask: of ``placement``, or of the solver's for ``gpu_budget``."""
    if placement is None:
        placement = choose_placement(model, profile, predictors, gpu_budget, hardware=hardware)
    return placement.masks() if isinstance(placement, Placement) else [np.asarray(m, bool) for m in placement]
