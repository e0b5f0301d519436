"""A computation of the weights alone, made to wait for the tokens it serves.

XLA schedules an operation that depends on nothing but the weights (a 4-bit matrix dequantized for a prompt,
a column block copied out of the neuron-major bundles) wherever it likes, and XLA:CPU put every layer's at the
start of a step, all of them held at once: for a 32-token prompt of a Llama-2-7B-shaped model it asked for
25.9 GB (int4 weights dequantized) and held 4.4 GB more than the weights (int8 bundles' blocks); an
optimization barrier did not hold (XLA:CPU removed it and kept that order). ``after`` ties the value to the
tokens by data, so each layer's copy is made when its tokens exist and freed after its product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(value: jax.Array, anchor: jax.Array) -> jax.Array:
    """``value``, computed no earlier than ``anchor`` exists: a select on ``anchor``'s first entry equalling
    itself, which XLA cannot fold for floats (NaN is unequal to itself). Where that entry is NaN the value is
    zeros, and the product it feeds is NaN anyway (the NaN token)."""
    first = anchor.reshape(-1)[0]
    return jnp.where(first == first, value, jnp.zeros((), value.dtype))
