"""FFN activation kinds: what one neuron computes from its gate and up projections.

Shared by the dense decoder, the sparse kernels and the profiler, so that every stage
agrees on what a neuron's activation is.
"""

from __future__ import annotations

import jax

from jpinfer.config import FFN_KINDS

# Kinds whose inactive neurons are small but not exactly zero: their activity needs a calibrated threshold
# (the ReLU kinds' inactive neurons are exactly 0, threshold 0).
SMOOTH_KINDS: tuple[str, ...] = ("swiglu", "geglu", "gelu")


def activate(kind: str, gate: jax.Array | None, up: jax.Array) -> jax.Array:
    """Neuron activation a_i (``up`` includes ``b_up``); the FFN output is sum_i a_i * down_i (+ b_down).

    ``swiglu`` silu(g)*u, ``geglu`` gelu(g)*u (GELU's tanh form, Gemma's ``gelu_pytorch_tanh``),
    ``reglu`` relu(g)*u, ``drelu`` relu(g)*relu(u), ``relu`` relu(u) (no gate, OPT), ``gelu`` gelu(u) (no gate,
    the erf form: Falcon's).
    """
    if kind == "relu":
        return jax.nn.relu(up)
    if kind == "gelu":
        return jax.nn.gelu(up, approximate=False)
    if kind == "drelu":
        return jax.nn.relu(gate) * jax.nn.relu(up)
    if kind in FFN_KINDS:  # swiglu, geglu, reglu: the gate's nonlinearity times up
        return gate_activation(kind, gate) * up
    raise ValueError(f"unknown FFN kind {kind!r}; supported: {', '.join(FFN_KINDS)}")


def gate_activation(kind: str, gate: jax.Array) -> jax.Array:
    """The gate's own nonlinearity (silu, gelu or relu) of a gated kind: what the profiler's gate score
    compares, and what ``activate`` multiplies up by."""
    if kind == "swiglu":
        return jax.nn.silu(gate)
    if kind == "geglu":
        return jax.nn.gelu(gate, approximate=True)
    return jax.nn.relu(gate)
