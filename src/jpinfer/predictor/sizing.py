"""Adaptive predictor sizing: each layer gets the width that minimises what it reads per token.

At a fixed recall target (the cut-off guarantees it on held-out data) a wider predictor
only changes how many *extra* neurons must be computed to reach it. So a layer's cost per
token, in parameters read, is

    cost(r) = predictor parameters(r) + predicted fraction(r) * d_ff * neuron parameters

(a neuron is its gate row, up row and down column: 3 d_model numbers, 2 for ReLU kinds),
and the layer's size is the rung of ``RANKS`` with the lowest cost. A layer whose
activity is hard to predict gets a small predictor (a big one would not pay for itself);
one that is easy gets the width that keeps the selection tight.

Search (PowerInfer's adaptive sizing, Song et al. 2023, made measurable): start each
layer at a rung chosen from its profile (sparser and more skewed layers are easier:
smaller start), climb up or down while the cost falls, on a quick proxy training
(``SearchConfig``); then, if the chosen sizes exceed the total parameter budget, shrink
the layer that loses least per parameter saved until they fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jpinfer.config import UNGATED_KINDS
from jpinfer.profiler import ActivationProfile

RANKS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One proxy training of one layer at one width."""

    rank: int
    n_params: int
    predicted: float  # held-out fraction of neurons selected at the target recall
    cost: float  # parameters read per token: predictor + selected neurons


def layer_cost(n_params: int, predicted: float, d_ff: int, neuron_params: int) -> float:
    return n_params + predicted * d_ff * neuron_params


def neuron_params(ffn_kind: str, d_model: int) -> int:
    """Weights one neuron reads: gate row, up row and down column (no gate for kind relu)."""
    return (2 if ffn_kind in UNGATED_KINDS else 3) * d_model


def predictor_params(rank: int, d_model: int, d_ff: int) -> int:
    return rank * (d_model + 1) + d_ff * (rank + 1)


def start_ranks(profile: ActivationProfile, base: int, ranks: tuple[int, ...] = RANKS) -> list[int]:
    """Per-layer starting rungs around ``base``: proportional to the fraction of neurons that
    carry 80% of the layer's activations times its active fraction (1 - sparsity)."""
    difficulty = profile.neurons_for_share(0.8) * (1.0 - profile.sparsity())
    scaled = base * difficulty / max(float(np.mean(difficulty)), 1e-12)
    ladder = np.log2(np.array(ranks, np.float64))
    return [ranks[int(np.argmin(np.abs(ladder - np.log2(max(s, 1.0)))))] for s in scaled]


def search(
    n_layers: int,
    trial: Callable[[int, int], Trial],
    start: list[int],
    budget_params: int,
    ranks: tuple[int, ...] = RANKS,
) -> tuple[list[int], dict[int, dict[int, Trial]]]:
    """Choose one rung per layer; ``trial(layer, rank)`` trains and measures (each pair once).

    Returns the ranks and every trial made (layer -> rank -> Trial). Raises ValueError if
    even the smallest rung for every layer exceeds ``budget_params``.
    """
    trials: dict[int, dict[int, Trial]] = {layer: {} for layer in range(n_layers)}

    def measured(layer: int, rank: int) -> Trial:
        if rank not in trials[layer]:
            trials[layer][rank] = trial(layer, rank)
        return trials[layer][rank]

    chosen = []
    for layer in range(n_layers):
        k = ranks.index(start[layer])
        best = measured(layer, ranks[k])
        for step in (1, -1):  # climb up while the cost falls; if the first step up did not help, climb down
            j = k + step
            while 0 <= j < len(ranks) and measured(layer, ranks[j]).cost < best.cost:
                best, k, j = trials[layer][ranks[j]], j, j + step
            if best.rank != start[layer]:
                break
        chosen.append(best.rank)

    smallest = sum(measured(layer, ranks[0]).n_params for layer in range(n_layers))
    if smallest > budget_params:
        raise ValueError(f"the predictor budget of {budget_params:,} parameters is below the smallest predictors "
                         f"({smallest:,} at width {ranks[0]} for every layer): raise the budget")
    while sum(trials[layer][r].n_params for layer, r in enumerate(chosen)) > budget_params:
        def loss_per_param(layer: int) -> float:
            k = ranks.index(chosen[layer])
            if k == 0:
                return np.inf
            now, smaller = trials[layer][chosen[layer]], measured(layer, ranks[k - 1])
            return (smaller.cost - now.cost) / (now.n_params - smaller.n_params)
        layer = min(range(n_layers), key=loss_per_param)
        chosen[layer] = ranks[ranks.index(chosen[layer]) - 1]
    return chosen, trials
