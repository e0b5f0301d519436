"""Neuron-level refinement of a group-level placement.

The integer program decides per group of 64, so up to a group per layer of budget is
left unused or spent on a colder neuron than one elsewhere. Keeping its choice of which
layers are split, whole or CPU-only (the hard, combinatorial part), the rest is exact at
neuron granularity: each split layer takes its C_l hottest neurons, then the remaining
budget goes to the largest marginal gains across split layers. A layer's gains (mass,
or predicted time saved) are non-increasing in hottest-first order while positive, so
taking the globally largest ones is optimal for those modes. Split layers stay split
(completing a layer is a mode change, the program's call).
"""

from __future__ import annotations

import numpy as np

from jpinfer.solver.frequencies import hottest_first
from jpinfer.solver.latency import CostModel, evaluate


def _gains(cost: CostModel, sorted_freqs: np.ndarray, start: int, objective: str) -> np.ndarray:
    """Gain of moving the (k+1)-th hottest neuron to the accelerator, for k = start .. n-2."""
    if objective == "mass":
        return sorted_freqs[start:-1]
    cum = np.concatenate([[0.0], np.cumsum(sorted_freqs)])
    k = np.arange(start, sorted_freqs.size)  # neurons on the accelerator, split mode
    accel = cum[k]
    times = np.maximum(cost.accel_per_neuron * accel,
                       cost.cpu_per_neuron * (cum[-1] - accel) + cost.transfer + cost.sync)
    return times[:-1] - times[1:]


def refine(
    masks: list[np.ndarray],
    freqs: list[np.ndarray],
    capacity: int,
    min_neurons: np.ndarray,
    cost: CostModel,
    objective: str,
) -> list[np.ndarray]:
    """Per-layer masks at least as good as ``masks`` under ``objective`` with the same modes."""
    orders = [hottest_first(f) for f in freqs]
    counts = np.array([m.sum() for m in masks])
    split = [l for l, (k, f) in enumerate(zip(counts, freqs)) if 0 < k < f.size]
    new_counts = np.where(counts == np.array([f.size for f in freqs]), counts, 0)
    new_counts[split] = min_neurons[split]
    left = capacity - int(new_counts.sum())
    gains, layers = [], []
    for l in split:
        g = _gains(cost, freqs[l][orders[l]], int(min_neurons[l]), objective)
        gains.append(g)
        layers.append(np.full(g.size, l))
    if gains and left > 0:
        gain, layer = np.concatenate(gains), np.concatenate(layers)
        position = np.concatenate([np.arange(g.size) for g in gains])
        take = np.lexsort((position, layer, -gain))[: left]
        take = take[gain[take] > 0]
        new_counts += np.bincount(layer[take], minlength=len(freqs))
    refined = []
    for order, k in zip(orders, new_counts):
        mask = np.zeros(order.size, bool)
        mask[order[:k]] = True
        refined.append(mask)
    before = evaluate(cost, freqs, masks)
    after = evaluate(cost, freqs, refined)
    better = after[0] >= before[0] if objective == "mass" else after[1] <= before[1]
    return refined if better else masks
