"""int8 weights (W8A8): int8 matrices with one float32 scale per output, int8 activations per token.

Decoding reads every weight once per token, so the bytes read set the speed. XLA:CPU does not
fuse an int8 -> float conversion into a matrix-vector product (42-68 ms for an 11008 x 4096
matrix, against 3.6-5.2 ms in float32), but it runs an int8 x int8 -> int32 product through
its YNNPACK fusion when the right operand has at least two columns: a single token is padded to
two columns, and then the same matrix took 1.4-1.9 ms (docs/architecture.md, measured facts). So the
activations are quantized too (symmetric, one scale per token), the product is exact in int32,
and the result is rescaled in float32: y = acc * (weight scale of the output) * (token scale).

An ``Int8Matrix`` holds ``values`` and ``scales`` with the scales running along ``scale_axis``:
0 for the decoder's (out, in) matrices (one scale per row), 1 for a transposed (in, out) copy
(input-major or neuron-major layouts of the sparse modes), so ``.T`` is free and every layout
keeps one scale per output. The rounding is symmetric and round-half-to-even: q = round(w / s)
with s = max|w| / 127 over the output's weights, so q lies in [-127, 127] (-128 is never used
and the grid is symmetric); an all-zero output gets s = 0 and q = 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127  # symmetric int8 grid [-127, 127]
MIN_COLUMNS = 2  # a one-token product padded to 2 columns runs as a GEMM (see the module docstring)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Matrix:
    """W ~= values * scales, the scales broadcast along ``scale_axis`` (0: one per row, 1: one per column).

    values: (rows, columns) int8; scales: float32, one per entry of ``values.shape[scale_axis]``.
    """

    values: jax.Array
    scales: jax.Array
    scale_axis: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def inputs(self) -> int:
        """Entries of x a product takes (``shape[1 - scale_axis]``)."""
        return self.values.shape[1 - self.scale_axis]

    @property
    def outputs(self) -> int:
        return self.values.shape[self.scale_axis]

    @property
    def T(self) -> "Int8Matrix":
        """The transposed matrix (the same scales, now along the other axis)."""
        return Int8Matrix(self.values.T, self.scales, 1 - self.scale_axis)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)

    def take(self, index, axis: int) -> "Int8Matrix":
        """The rows (axis 0) or columns (axis 1) at ``index`` (an index array or a slice); the scales
        follow when ``axis`` is the scale axis."""
        values = self.values[index] if axis == 0 else self.values[:, index]
        return Int8Matrix(values, self.scales[index] if axis == self.scale_axis else self.scales, self.scale_axis)


def concatenate(parts: list[Int8Matrix]) -> Int8Matrix:
    """The rows of several row-scaled matrices of one width stacked (e.g. q, k, v into one fused matrix), their
    scales with them."""
    if any(not isinstance(p, Int8Matrix) or p.scale_axis != 0 for p in parts):
        raise ValueError("can stack the rows of int8 matrices with one scale per row only")
    return Int8Matrix(jnp.concatenate([p.values for p in parts]), jnp.concatenate([p.scales for p in parts]), 0)

def quantize(w: np.ndarray | jax.Array, scale_axis: int = 0) -> Int8Matrix:
    """Quantize a float matrix: one scale per entry of ``w.shape[scale_axis]`` (the outputs).

    Computed in float64 on the host from the float32 scale that is stored, so the integers are
    exactly round(w / s) for the stored s (a numpy reference reproduces them bit for bit). One float64
    copy, worked in place: the peaks from the maximum and minimum (a NaN or inf shows in them), no
    temporaries beside it; 2.3x the speed of a temporary per step (a (1024, 4096) matrix 35-40 -> 15-16
    ms, 2-core Zen 4 VM, 2026-12-06), which is most of reading a 7B Q8_0 file into int8."""
    w64 = np.array(w, np.float64)  # a copy: worked in place below
    if w64.ndim != 2:
        raise ValueError(f"can quantize a 2-D matrix only, got shape {w64.shape}")
    reduce_axis = 1 - scale_axis
    peaks = np.maximum(w64.max(axis=reduce_axis), -w64.min(axis=reduce_axis))
    if not np.isfinite(peaks).all():
        raise ValueError("cannot quantize a matrix holding inf or nan")
    scales = (peaks / QMAX).astype(np.float32)
    s64 = np.expand_dims(scales.astype(np.float64), reduce_axis)
    np.divide(w64, s64, out=w64, where=s64 > 0)  # an all-zero line (scale 0) stays zero
    np.round(w64, out=w64)
    np.clip(w64, -QMAX, QMAX, out=w64)
    return Int8Matrix(jnp.asarray(w64.astype(np.int8)), jnp.asarray(scales), scale_axis)


def dequantize(m: Int8Matrix, dtype=jnp.float32) -> jax.Array:
    """values * scales as a float matrix."""
    scales = m.scales[:, None] if m.scale_axis == 0 else m.scales[None, :]
    return (m.values.astype(jnp.float32) * scales).astype(dtype)


def rows(m: Int8Matrix, index: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The dequantized weights of the outputs at ``index`` (any shape), (*index.shape, inputs): rows of a
    row-scaled matrix, columns of a column-scaled (input-major) one, e.g. a tied head's embeddings."""
    if m.scale_axis == 0:
        values = m.values[index]
    else:
        values = jnp.moveaxis(jnp.take(m.values, index, axis=1), 0, -1)
    return (values.astype(jnp.float32) * m.scales[index][..., None]).astype(dtype)


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8 of x (..., d): (q (..., d) int8, scale (...) float32), q = round(x * 127 /
    max|x|) (half to even). A product, not a division, so numpy's float32 reproduces q exactly. (The
    4-bit products quantize x this way per block of 32: x as (..., blocks, 32), ``q4.quantize_blocks``.)"""
    x32 = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x32), axis=-1)
    inverse = jnp.where(peak > 0, QMAX / jnp.where(peak > 0, peak, 1.0), 0.0)
    q = jnp.clip(jnp.round(x32 * inverse[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q, peak / QMAX


def integer_product(q: jax.Array, m: Int8Matrix) -> jax.Array:
    """The exact int32 product of int8 tokens q (N, in) and ``m``'s values, (N, out): the integer
    part of ``product``. One token is padded to ``MIN_COLUMNS`` (the fast GEMM shape)."""
    n = q.shape[0]
    if n < MIN_COLUMNS:
        q = jnp.pad(q, ((0, MIN_COLUMNS - n), (0, 0)))
    if m.scale_axis == 0:  # values (out, in): W @ Q^T, the form XLA:CPU ran fastest for (out, in) weights
        acc = jax.lax.dot_general(m.values, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32).T
    else:  # values (in, out)
        acc = jax.lax.dot_general(q, m.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc[:n]


def product(tokens: jax.Array, m: Int8Matrix) -> jax.Array:
    """The W8A8 product of float tokens (N, in) and ``m`` in XLA ops, float32 (N, out): W @ x per token
    for an (out, in) matrix (scale_axis 0), x @ M for an (in, out) one (scale_axis 1);
    y = acc * (token scale * output scale)."""
    q, token_scales = quantize_tokens(tokens)
    acc = integer_product(q, m)
    return acc.astype(jnp.float32) * (token_scales[:, None] * m.scales[None, :])
