"""The FFN activations in float64 numpy, written apart from jpinfer.activations: the reference the kernel
tests (float and int8) compare with."""

from __future__ import annotations

import numpy as np
import scipy.special


def activation64(kind: str, g, u):
    """act(g, u) of an FFN kind: swiglu silu(g) * u, geglu gelu(g) * u (the tanh form, as Gemma's
    gelu_pytorch_tanh defines it), reglu relu(g) * u, drelu relu(g) * relu(u), relu relu(u), gelu gelu(u)
    (the erf form, Falcon's)."""
    if kind in ("swiglu", "geglu"):
        return gate64(kind, g) * u
    if kind == "gelu":
        return 0.5 * u * (1 + scipy.special.erf(u / np.sqrt(2)))
    if kind == "reglu":
        return np.maximum(g, 0) * u
    if kind == "drelu":
        return np.maximum(g, 0) * np.maximum(u, 0)
    return np.maximum(u, 0)


def gate64(kind: str, g):
    """The gate's nonlinearity of a gated kind: silu, gelu (tanh form) or relu."""
    if kind == "swiglu":
        return g / (1 + np.exp(-g))
    if kind == "geglu":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    return np.maximum(g, 0)
