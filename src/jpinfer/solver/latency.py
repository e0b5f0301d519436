"""Predicted per-token decode time of a placement (batch 1, memory-bound).

Per layer l with expected active mass on the accelerator A_l and on the CPU C_l (sum of
the activation frequencies of the neurons placed there), the FFN takes
  - all neurons on the accelerator:  a*A_l
  - none on the accelerator:         c*C_l + X
  - split across both:               max(a*A_l, c*C_l + X + S)
where a and c are seconds per expected active neuron on each device (neuron bytes over
bandwidth), X moves the hidden state to the host and the partial sum back (two copies),
and S is the extra synchronisation a split layer pays. The rest of the step (attention,
predictors, KV cache reads at the full context, the logits) is a constant ``dense_time``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpinfer.solver.hardware import HardwareProfile
from jpinfer.solver.memory import DenseSplit, ModelSizes


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Coefficients of the latency model, in seconds."""

    accel_per_neuron: float
    cpu_per_neuron: float
    transfer: float
    sync: float
    dense_time: float

    @classmethod
    def build(cls, sizes: ModelSizes, hardware: HardwareProfile, split: DenseSplit) -> "CostModel":
        hidden = sizes.d_model * sizes.act_bytes
        copy = hardware.link_latency + hidden / hardware.link_bandwidth
        logits_on_cpu = "lm_head" in split.cpu_parts or (sizes.tied and "embed" in split.cpu_parts)
        logits_bytes = sizes.embed_bytes if sizes.tied else sizes.lm_head_bytes
        accel_read = sizes.required_bytes + (0 if logits_on_cpu else logits_bytes)
        dense_time = accel_read / hardware.accel_bandwidth
        if logits_on_cpu:
            dense_time += logits_bytes / hardware.cpu_bandwidth + 2 * copy
        if "embed" in split.cpu_parts:
            dense_time += copy  # the looked-up row travels to the accelerator
        return cls(
            accel_per_neuron=sizes.neuron_bytes / hardware.accel_bandwidth,
            cpu_per_neuron=sizes.neuron_bytes / hardware.cpu_bandwidth,
            transfer=2 * copy,
            sync=hardware.sync_cost,
            dense_time=dense_time,
        )

    def layer_times(
        self, accel_mass: np.ndarray, cpu_mass: np.ndarray, n_accel: np.ndarray, n_total: np.ndarray
    ) -> np.ndarray:
        """FFN seconds per layer (see the module docstring)."""
        accel = self.accel_per_neuron * np.asarray(accel_mass, np.float64)
        cpu = self.cpu_per_neuron * np.asarray(cpu_mass, np.float64) + self.transfer
        n_accel, n_total = np.asarray(n_accel), np.asarray(n_total)
        split = np.maximum(accel, cpu + self.sync)
        return np.where(n_accel == n_total, accel, np.where(n_accel == 0, cpu, split))

    def min_neurons(self, sorted_freqs: list[np.ndarray]) -> np.ndarray:
        """C_l: the fewest neurons worth splitting layer l for.

        Putting the k hottest neurons of a layer on the accelerator removes
        c * (their mass) from the CPU's path; a split pays S more than a CPU-only layer,
        so fewer than the smallest k with c * mass >= S never pays. When no k does,
        only the whole layer may go to the accelerator (C_l = n, which pays no X or S).
        """
        out = np.empty(len(sorted_freqs), np.int64)
        for layer, freqs in enumerate(sorted_freqs):
            saved = self.cpu_per_neuron * np.cumsum(freqs)
            worth = np.nonzero(saved >= self.sync)[0]
            out[layer] = worth[0] + 1 if worth.size else len(freqs)
        return out


def evaluate(
    cost: CostModel, freqs: list[np.ndarray], masks: list[np.ndarray]
) -> tuple[float, float, np.ndarray]:
    """(accelerator share of activation mass, predicted seconds per token, FFN seconds per layer)."""
    accel_mass = np.array([f[m].sum() for f, m in zip(freqs, masks)], np.float64)
    total_mass = np.array([f.sum() for f in freqs], np.float64)
    n_accel = np.array([m.sum() for m in masks])
    n_total = np.array([m.size for m in masks])
    times = cost.layer_times(accel_mass, total_mass - accel_mass, n_accel, n_total)
    return float(accel_mass.sum() / total_mass.sum()), float(cost.dense_time + times.sum()), times
