"""Baselines the integer program is compared with, returning per-layer neuron masks.

- ``greedy``: global top-K neurons by frequency per byte until the budget is spent,
  ignoring the communication constraint (what PowerInfer's released code effectively does).
- ``layers``: whole FFN blocks from the last layer down while they fit, as llama.cpp's
  ``-ngl`` offloads the last N layers.
"""

from __future__ import annotations

import numpy as np


def greedy(freqs: list[np.ndarray], neuron_capacity: int) -> list[np.ndarray]:
    """The ``neuron_capacity`` most frequent neurons of the model (all neurons cost the same bytes)."""
    flat = np.concatenate(freqs)
    chosen = np.zeros(flat.size, bool)
    chosen[np.argsort(-flat, kind="stable")[: max(0, neuron_capacity)]] = True
    return np.split(chosen, np.cumsum([f.size for f in freqs])[:-1])


def layers(freqs: list[np.ndarray], neuron_capacity: int) -> list[np.ndarray]:
    """Whole layers, last first, while the next whole layer still fits."""
    masks = [np.zeros(f.size, bool) for f in freqs]
    left = neuron_capacity
    for layer in reversed(range(len(freqs))):
        if freqs[layer].size > left:
            break
        masks[layer][:] = True
        left -= freqs[layer].size
    return masks
