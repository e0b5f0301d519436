"""The FFN activations in float64 numpy, written apart from jpinfer.activations: the reference the kernel
tests (float and int8) compare with."""

from __future__ import annotations

import numpy as np


def activation64(kind: str, g, u):
    """act(g, u) of an FFN kind: swiglu silu(g) * u, reglu relu(g) * u, drelu relu(g) * relu(u), relu relu(u)."""
    if kind == "swiglu":
        return g / (1 + np.exp(-g)) * u
    if kind == "reglu":
        return np.maximum(g, 0) * u
    if kind == "drelu":
        return np.maximum(g, 0) * np.maximum(u, 0)
    return np.maximum(u, 0)
