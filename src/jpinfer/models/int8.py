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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.models.params import Norm, Weights

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


def quantize(w: np.ndarray | jax.Array, scale_axis: int = 0) -> Int8Matrix:
    """Quantize a float matrix: one scale per entry of ``w.shape[scale_axis]`` (the outputs).

    Computed in float64 on the host from the float32 scale that is stored, so the integers are
    exactly round(w / s) for the stored s (a numpy reference reproduces them bit for bit)."""
    w64 = np.asarray(w, np.float64)
    if w64.ndim != 2:
        raise ValueError(f"can quantize a 2-D matrix only, got shape {w64.shape}")
    if not np.isfinite(w64).all():
        raise ValueError("cannot quantize a matrix holding inf or nan")
    reduce_axis = 1 - scale_axis
    scales = (np.abs(w64).max(axis=reduce_axis) / QMAX).astype(np.float32)
    s64 = np.expand_dims(scales.astype(np.float64), reduce_axis)
    q = np.divide(w64, s64, out=np.zeros_like(w64), where=s64 > 0)
    values = np.clip(np.round(q), -QMAX, QMAX).astype(np.int8)
    return Int8Matrix(jnp.asarray(values), jnp.asarray(scales), scale_axis)


def dequantize(m: Int8Matrix, dtype=jnp.float32) -> jax.Array:
    """values * scales as a float matrix."""
    scales = m.scales[:, None] if m.scale_axis == 0 else m.scales[None, :]
    return (m.values.astype(jnp.float32) * scales).astype(dtype)


def is_int8(weights: Weights) -> bool:
    """Whether ``weights`` came from ``quantize_weights``."""
    return isinstance(weights.head, Int8Matrix)


def as_float(w: jax.Array | Int8Matrix, dtype=jnp.float32) -> jax.Array:
    """A weight as a float matrix: dequantized when int8 (for the rare whole-matrix uses outside
    the products, e.g. a column norm), else ``w`` itself in ``dtype``."""
    return dequantize(w, dtype) if isinstance(w, Int8Matrix) else w.astype(dtype)


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8 of x (..., d): (q (..., d) int8, scale (...) float32), q = round(x * 127 /
    max|x|) (half to even). A product, not a division, so numpy's float32 reproduces q exactly. (The
    native 4-bit kernels quantize x this way per block of 32: x as (..., blocks, 32).)"""
    x32 = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x32), axis=-1)
    inverse = jnp.where(peak > 0, QMAX / jnp.where(peak > 0, peak, 1.0), 0.0)
    q = jnp.clip(jnp.round(x32 * inverse[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q, peak / QMAX


def integer_product(q: jax.Array, m: Int8Matrix) -> jax.Array:
    """The exact int32 product of int8 tokens q (N, in) and ``m``'s values, (N, out): the integer
    part of ``matmul``. One token is padded to ``MIN_COLUMNS`` (the fast GEMM shape)."""
    n = q.shape[0]
    if n < MIN_COLUMNS:
        q = jnp.pad(q, ((0, MIN_COLUMNS - n), (0, 0)))
    if m.scale_axis == 0:  # values (out, in): W @ Q^T, the form XLA:CPU ran fastest for (out, in) weights
        acc = jax.lax.dot_general(m.values, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32).T
    else:  # values (in, out)
        acc = jax.lax.dot_general(q, m.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc[:n]


def matmul(x: jax.Array, m: Int8Matrix) -> jax.Array:
    """x (..., in) times the matrix ``m`` represents, float32 (..., out): W @ x per token for an
    (out, in) matrix (scale_axis 0), x @ M for an (in, out) one (scale_axis 1).

    Differentiable in x (the loss sensitivities of ``profiler.calibration`` run through it): the
    derivative is the straight-through one, that of the dequantized matrix, since rounding x to
    int8 has a zero derivative almost everywhere and would silently zero every gradient."""
    inputs = m.shape[1 - m.scale_axis]
    if x.shape[-1] != inputs:
        raise ValueError(f"x has {x.shape[-1]} features, the int8 matrix {m.shape} takes {inputs}")
    y = _w8a8(x.reshape(-1, inputs), m.values, m.scales, m.scale_axis)
    return y.reshape(*x.shape[:-1], m.scales.shape[0])


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _w8a8(tokens: jax.Array, values: jax.Array, scales: jax.Array, scale_axis: int) -> jax.Array:
    q, token_scales = quantize_tokens(tokens)
    acc = integer_product(q, Int8Matrix(values, scales, scale_axis))
    return acc.astype(jnp.float32) * (token_scales[:, None] * scales[None, :])


@_w8a8.defjvp
def _w8a8_jvp(scale_axis: int, primals, tangents):
    tokens, values, scales = primals
    d_tokens, _, d_scales = tangents  # int8 values have no tangent
    y = _w8a8(tokens, values, scales, scale_axis)
    w = dequantize(Int8Matrix(values, jnp.ones_like(scales), scale_axis))  # values as float: (out, in) or (in, out)
    spec = "ti,oi->to" if scale_axis == 0 else "ti,io->to"
    dy = jnp.einsum(spec, d_tokens.astype(jnp.float32), w) * scales[None, :]
    dy = dy + jnp.einsum(spec, tokens.astype(jnp.float32), w) * d_scales[None, :]
    return y, dy


@dataclasses.dataclass(frozen=True)
class ChannelPeaks:
    """Per layer, max |input| of each input channel over calibration text (``profiler.smoothing``):
    ``attention`` (n_layers, d_model) of the q/k/v projection, ``ffn`` (n_layers, d_model) of gate/up,
    ``down`` (n_layers, d_ff) of the down projection (the activations), ``head`` (d_model,) of the head
    (the final norm's output)."""

    attention: np.ndarray
    ffn: np.ndarray
    down: np.ndarray
    head: np.ndarray


def _cast(a: np.ndarray, like: jax.Array) -> jax.Array:
    return jnp.asarray(a, like.dtype)


def migration_scales(input_peaks: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per input channel s_j = peak_j^alpha / max_i |w_ij|^(1 - alpha) for an (out, in)
    matrix (Xiao et al. 2023, eq. 4): dividing input j by s_j and multiplying column j by s_j leaves
    the product unchanged and evens out the channels' ranges between activations and weights.
    A channel that never fired or has no weight keeps s = 1."""
    peaks = np.asarray(input_peaks, np.float64)
    w_peaks = np.abs(np.asarray(w, np.float64)).max(axis=0)
    ok = (peaks > 0) & (w_peaks > 0)
    return np.where(ok, peaks ** alpha / np.where(ok, w_peaks, 1.0) ** (1 - alpha), 1.0)


def smooth(weights: Weights, peaks: ChannelPeaks, alpha: float) -> Weights:
    """Float weights computing the same function, with activation outliers moved into the weights.

    The inputs are divided where that costs nothing at run time, inside the operation that makes them:
    the q/k/v and gate/up inputs through the preceding norm's scale (and bias), the down projection's
    inputs (the activations a = act(gate) * up, linear in up for every kind) through the up rows and
    bias, the head's through the final norm (a tied input embedding becomes a float copy of the head as it
    was: the head itself changes). The attention output projection is left as it is
    (its input mixes value channels across a head group; quantizing it alone moved perplexity by 0.07%)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    layers = []
    for i, layer in enumerate(weights.layers):
        n = layer.w_down.shape[1]
        w_qkv, w_gate_up, w_down = (np.asarray(m, np.float64) for m in (layer.w_qkv, layer.w_gate_up, layer.w_down))
        s_attention = migration_scales(peaks.attention[i], w_qkv, alpha)
        s_ffn = migration_scales(peaks.ffn[i], w_gate_up, alpha)
        s_down = migration_scales(peaks.down[i], w_down, alpha)
        w_gate_up = w_gate_up * s_ffn[None, :]
        w_gate_up[-n:] /= s_down[:, None]  # the up rows: a_j / s_j
        layers.append(dataclasses.replace(
            layer, attn_norm=_divided(layer.attn_norm, s_attention), ffn_norm=_divided(layer.ffn_norm, s_ffn),
            w_qkv=_cast(w_qkv * s_attention[None, :], layer.w_qkv), w_gate_up=_cast(w_gate_up, layer.w_gate_up),
            w_down=_cast(w_down * s_down[None, :], layer.w_down),
            b_up=None if layer.b_up is None else _cast(np.asarray(layer.b_up, np.float64) / s_down, layer.b_up)))
    head = np.asarray(weights.head, np.float64)  # (d_model, vocab): input channel j is row j
    s_head = migration_scales(peaks.head, head.T, alpha)
    embed = weights.embed if weights.embed is not None else jnp.asarray(np.asarray(weights.head).T)
    return dataclasses.replace(weights, layers=layers, final_norm=_divided(weights.final_norm, s_head), embed=embed,
                               head=jnp.asarray(head * s_head[:, None], weights.head.dtype))


def _divided(norm: Norm, s: np.ndarray) -> Norm:
    """The norm whose output is divided by s per channel (scale and bias divided)."""
    divide = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64) / s, a.dtype)
    return dataclasses.replace(norm, scale=divide(norm.scale), bias=divide(norm.bias))


def quantize_weights(weights: Weights) -> Weights:
    """Every projection of the decoder as an ``Int8Matrix``: q/k/v, o, gate/up, down and the head.

    The head is quantized per vocabulary row, as a (vocab, d_model) matrix (its float form is
    stored (d_model, vocab), see ``params.Weights``); a tied model's input embedding is then read
    from those int8 rows, so nothing is stored twice. Norms, biases and an input embedding of its own
    stay in float: the embedding is read one row per token (nothing to gain in time), and quantizing
    it per row cost the default model 0.4% perplexity after the migration (scratch run; the migration
    gives a tied model an embedding of its own, ``smooth``)."""
    if is_int8(weights):
        raise ValueError("the weights are int8 already")
    layers = [
        dataclasses.replace(layer, w_qkv=quantize(layer.w_qkv), wo=quantize(layer.wo),
                            w_gate_up=quantize(layer.w_gate_up), w_down=quantize(layer.w_down))
        for layer in weights.layers
    ]
    return dataclasses.replace(weights, layers=layers, head=quantize(np.asarray(weights.head).T))


def rows(m: Int8Matrix, index: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The dequantized rows at ``index`` (any shape) of a row-scaled matrix: (*index.shape, columns)."""
    if m.scale_axis != 0:
        raise ValueError("rows() reads a matrix with one scale per row")
    return (m.values[index].astype(jnp.float32) * m.scales[index][..., None]).astype(dtype)
