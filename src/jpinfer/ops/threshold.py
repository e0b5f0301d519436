"""Threshold rows: products that skip the inputs of magnitude at most a threshold, and the predictor's compaction.

- ``threshold_rows``: x (T, in) through an input-major matrix (float32, or int8 with one scale per column) with the
  small inputs skipped: on the CPU, for up to ``MAX_TOKENS`` tokens (decode), the native kernel that keeps,
  compacts and reads the kept rows in one call (``native.kernels.threshold_rows_product`` / ``_int8``: the same
  kept entries, the same integers in int8); the caller's XLA form otherwise.
- ``head_product``: the decoder's head with the same input sparsity (the threshold mode's head; without a
  threshold, the dense head): the native rows product over an input-major head (float or int8) for decode-sized
  steps on the CPU, up to 8 tokens a call (the kernel's pieces keep their outputs in L1: the default model's head
  took 3.3-3.5 ms for 8 tokens in one call against 5.2-6.2 in two calls of 4, 2-core Zen 5 VM, 2026-12-05); every
  other path computes the same values with the skipped entries zeroed (a (vocab, d) quantized head reads all its
  rows).
- ``select_over``: the neurons whose predictor logit is over the cut-off, compacted (``native.kernels.
  select_over``): the native pass on the CPU where the library is loaded (XLA's compaction of the mask is a
  cumulative sum and a scatter over every neuron: 3.4 against 0.5 ms a step for 32 layers of 11008 neurons with
  1101 over the cut-off, 0.9 against 0.2 ms for the default model's 30 layers of 1536; 2-core Zen 4 VM,
  2026-12-05, scratch probe), its XLA form elsewhere.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jpinfer.native import kernels as native_kernels
from jpinfer.native import native_available
from jpinfer.ops.dense import decode_sized, native_tokens, quantized_matmul
from jpinfer.ops.table import dispatch, pick
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix

MAX_TOKENS = native_kernels.MAX_TOKENS


def threshold_rows(matrix: jax.Array | Int8Matrix, x: jax.Array, threshold: jax.Array, *, xla: Callable,
                   backend: str) -> tuple[jax.Array, jax.Array]:
    """(x (T, in) through the input-major ``matrix``, float32 (T, out); inputs kept per token (T,)): the native
    kernel (module docstring) or ``xla(matrix, x, threshold)``; ``backend`` other than "auto" forces the XLA form."""
    is_int8 = isinstance(matrix, Int8Matrix)
    readable = matrix.scale_axis == 1 if is_int8 else matrix.dtype == jnp.float32
    ready = backend == "auto" and x.shape[0] <= MAX_TOKENS and readable and native_available()
    if is_int8:
        native = lambda m, x, t: native_kernels.threshold_rows_product_int8(m.values, m.scales, x, t, native=True)
    else:
        native = lambda m, x, t: native_kernels.threshold_rows_product(m, x, t, native=True)
    choice = lambda p: pick("threshold", "int8" if is_int8 else "float", p, native=ready, backend=backend)
    return dispatch(choice, {"native": native, "xla": xla}, matrix, x, threshold)


def head_product(h: jax.Array, head: jax.Array | Int8Matrix | Q4Matrix, input_threshold: float | None
                 ) -> jax.Array:
    """Float32 logits (..., vocab) of hidden states h (..., d) through the head: a float (d, vocab) matrix, a
    quantized (vocab, d) one, or an int8 input-major (d, vocab) copy; the entries of h of magnitude at most
    ``input_threshold`` (None: none) skipped (module docstring)."""
    if input_threshold is not None:
        h_kept = jnp.where(jnp.abs(h) > input_threshold, h, jnp.zeros_like(h))
        h_kept = jnp.where(jnp.isnan(h), h, h_kept)  # a NaN stays visible, as the native path keeps it
    else:
        h_kept = h
    int8_input_major = isinstance(head, Int8Matrix) and head.scale_axis == 1
    if isinstance(head, (Int8Matrix, Q4Matrix)) and not int8_input_major:
        return quantized_matmul(h_kept, head)
    if int8_input_major:
        xla, ready = quantized_matmul, h.dtype == jnp.float32 and native_tokens(h)
    else:
        xla = lambda h, head: jnp.dot(h, head, preferred_element_type=jnp.float32)
        ready = decode_sized(h, head)
    threshold = jnp.float32(-jnp.inf if input_threshold is None else input_threshold)

    def native(h, head):  # the input-major head: the rows product over the kept rows, each read once
        flat = h.reshape(-1, h.shape[-1])
        if int8_input_major:
            y = native_kernels.threshold_rows_product_int8(head.values, head.scales, flat, threshold)[0]
        else:
            y = native_kernels.threshold_rows_product(head, flat, threshold)[0]
        y = jnp.where(jnp.isnan(flat).any(-1, keepdims=True), jnp.nan, y)  # a NaN input is no row to skip
        return y.reshape(*h.shape[:-1], -1)

    default = lambda h, head: xla(h_kept, head)
    choice = lambda p: pick("threshold", "int8" if int8_input_major else "float", p, native=ready)
    return dispatch(choice, {"native": native, "xla": default}, h, head)


def select_over(logits: jax.Array, cutoff: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(the indices of the logits (n,) over ``cutoff`` in order, padded to ``capacity``; how many are over it), on
    float32 logits (module docstring)."""
    logits, cutoff = logits.astype(jnp.float32), jnp.asarray(cutoff, jnp.float32)
    xla = lambda lg, c: native_kernels.select_over(lg, c, capacity, native=False)
    native = lambda lg, c: native_kernels.select_over(lg, c, capacity, native=True)
    choice = lambda p: pick("select", "float", p, native=native_available())
    return dispatch(choice, {"native": native, "xla": xla}, logits, cutoff)
