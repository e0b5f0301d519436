"""Neuron groups: per layer, neurons sorted by frequency and cut into consecutive groups.

The integer program decides per group, which keeps it small (11008 neurons -> 172
binaries per layer at group size 64) and matches kernel-friendly block sizes. A group
never spans two layers; the last group of a layer may be smaller.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpinfer.solver.frequencies import hottest_first


@dataclasses.dataclass(frozen=True)
class Groups:
    """Flat arrays over all groups of all layers (group g of the model)."""

    order: tuple[np.ndarray, ...]  # per layer: neuron ids, hottest first
    layer: np.ndarray  # (G,) layer of each group
    start: np.ndarray  # (G,) first position of the group in its layer's order
    size: np.ndarray  # (G,) neurons in the group
    mass: np.ndarray  # (G,) summed activation frequency

    @property
    def n_layers(self) -> int:
        return len(self.order)

    def __len__(self) -> int:
        return int(self.layer.size)

    def masks(self, chosen: np.ndarray) -> list[np.ndarray]:
        """Per layer boolean mask over neuron ids of the neurons in the chosen groups."""
        chosen = np.asarray(chosen, bool)
        if chosen.shape != self.layer.shape:
            raise ValueError(f"expected one decision per group ({len(self)}), got shape {chosen.shape}")
        masks = [np.zeros(o.size, bool) for o in self.order]
        for g in np.nonzero(chosen)[0]:
            layer, lo = self.layer[g], self.start[g]
            masks[layer][self.order[layer][lo : lo + self.size[g]]] = True
        return masks


def make_groups(freqs: list[np.ndarray], group_size: int) -> Groups:
    """Sort each layer's neurons by descending frequency (ties by id) and group them."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    order, layer, start, size, mass = [], [], [], [], []
    for index, f in enumerate(freqs):
        ids = hottest_first(f)
        order.append(ids)
        starts = np.arange(0, f.size, group_size)
        sizes = np.minimum(group_size, f.size - starts)
        layer.append(np.full(starts.size, index))
        start.append(starts)
        size.append(sizes)
        mass.append(np.add.reduceat(f[ids].astype(np.float64), starts))
    return Groups(
        order=tuple(order),
        layer=np.concatenate(layer),
        start=np.concatenate(start),
        size=np.concatenate(size),
        mass=np.concatenate(mass),
    )
