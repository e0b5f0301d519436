"""Threshold sparsity (training-free): skip the small entries, read only the rows the kept ones need.

Two kinds, per layer, each with a calibrated threshold (``jpinfer.profiler.sparsity``):

- **activation sparsity** (CATS-like, on the product): compute gate and up for every neuron,
  keep the neurons with |a_i| = |act(g_i) * u_i| over the threshold, and run the down
  projection over those only: a row of the neuron-major down matrix W_down^T per kept neuron.
- **input sparsity** (TEAL-like): drop the FFN input dimensions with |x_j| under the threshold
  and read only the kept rows of the input-major gate/up matrix W_gate_up^T (a row per input
  dimension, holding that dimension's weight for every gate and up output).

Both are the same operation, ``op.sparse_rows_product``: x @ M over a list of M's rows. The
list is every kept index in order (a compaction, static length, traced count), so nothing is
ever clipped. One token reads only the kept rows; several tokens (prefill) run dense products
with the same entries zeroed, which computes the same values (each token keeps its own set).
A kind that is off keeps the decoder's (out, in) matrix and its dense product.

The attention's q|k|v and output products take input sparsity the same way (``ThresholdProjection``,
``threshold_projection``: TEAL's model-wide form, Liu et al. 2024): the input-major copy replaces the
decoder's matrix, and the inputs of magnitude at most the matrix's threshold are skipped.

int4 weights: a matrix read by rows is held as an int8 copy of the dequantized 4-bit matrix (one
scale per output, the int8 layout's), read by the int8 path and kernels. 4-bit blocks run along the
input (llama.cpp's 32 inputs per block), so an input-major or neuron-major row cuts across blocks;
re-blocking them along the other axis cost ~9% perplexity on the default model (1.094x dense int4
with nothing skipped, a scratch run), the int8 copies 0.9% (1.0086x on 4 WikiText-2 windows, nothing
skipped; their weights alone 0.2%, the rest is the int8 path's one activation scale per token). They
take 1 byte a weight against the blocks' 0.625 (Q4_1): the threshold mode in int4 reads its FFN at
int8's bytes (so a pack's "auto" input and attention targets are off for int4: ``pack.PackSettings``). The
attention's products without a threshold, the head and a matrix a kind that is off reads densely stay as loaded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.config import UNGATED_KINDS, ExpertRouting, FfnKind
from jpinfer.models import quantized
from jpinfer.models.params import Layer
from jpinfer.ops import dense
from jpinfer.ops.threshold import threshold_rows
from jpinfer.quant import int8
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Matrix
from jpinfer.sparse.neurons import routing_of
from jpinfer.sparse.op import RowsBackend, sparse_rows_product

Matrix = jax.Array | Int8Matrix | Q4Matrix


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ThresholdLayout:
    """One layer's FFN laid out for threshold sparsity.

    gate_up: (R n, d) as the decoder stores it, or (d, R n) input-major when ``input_sparse``
             (R = 2 gated, gate block first; R = 1 for kind relu).
    down:    (d, n) as the decoder stores it, or (n, d) neuron-major when ``activation_sparse``.
    (Either may be an ``quant.int8.Int8Matrix``, one scale per output, when the model's weights are int8, or
    int4 read by rows (the module docstring); a ``quant.q4.Q4Matrix`` when int4 and read densely.)
    input_threshold / activation_threshold: float32 scalars; an entry is kept when its
             magnitude is strictly greater (so 0 keeps every non-zero entry).
    router / neuron_experts / routing_rule: with experts (Mixtral), the router (n_experts, d), the expert of
             each neuron held (n,) and how the router weighs the experts (static): each activation is times its
             expert's routing weight (the router reads the whole input), so the neurons of experts not picked are
             zero and their down rows are skipped at any activation threshold. Gate and up are computed for every
             expert's neurons.
    """

    gate_up: Matrix
    down: Matrix
    b_up: jax.Array | None
    b_down: jax.Array | None
    input_threshold: jax.Array
    activation_threshold: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))
    input_sparse: bool = dataclasses.field(metadata=dict(static=True))
    activation_sparse: bool = dataclasses.field(metadata=dict(static=True))
    router: jax.Array | None = None
    neuron_experts: jax.Array | None = None
    routing_rule: ExpertRouting | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def d_ff(self) -> int:
        """Neurons held (the layer's, or one part's)."""
        return self.down.shape[0] if self.activation_sparse else self.down.shape[1]

    n_neurons = d_ff


def from_layer(layer: Layer, kind: FfnKind, *, input_threshold: float | None, activation_threshold: float | None,
               neurons: np.ndarray | None = None, with_b_down: bool = True,
               experts: tuple[int, ExpertRouting] | None = None) -> ThresholdLayout:
    """A decoder layer's FFN for threshold sparsity; a threshold of None turns that kind off. ``experts``:
    (neurons per expert, routing rule) of a layer with a router (``ModelConfig.experts``).

    Only the matrices a kind reads sparsely change layout (one transposed copy replaces the
    decoder's matrix), so memory does not grow (int4: the int8 copy of a 4-bit matrix takes 1.6x its
    bytes). ``neurons`` (ids) keeps only those neurons: one part of a layer split over two devices,
    whose outputs add up (keep ``b_down`` in one part)."""
    for name, value in (("input_threshold", input_threshold), ("activation_threshold", activation_threshold)):
        if value is not None and not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0 (or None: that kind off), got {value!r}")
    input_sparse, activation_sparse = input_threshold is not None, activation_threshold is not None
    gate_up = _readable_by_rows(layer.w_gate_up, input_sparse or neurons is not None)
    down = _readable_by_rows(layer.w_down, activation_sparse or neurons is not None)
    b_up = layer.b_up
    if (layer.router is None) != (experts is None):
        raise ValueError("a layer with a router needs experts=(neurons per expert, routing rule), and only it")
    routing = {}
    if experts is not None:
        ids = np.arange(layer.router.shape[0] * experts[0]) if neurons is None else np.asarray(neurons)
        routing = dict(router=layer.router, neuron_experts=jnp.asarray(ids // experts[0], jnp.int32),
                       routing_rule=experts[1])
    if neurons is not None:
        ids = jnp.asarray(neurons, jnp.int32)
        n = down.shape[1]
        rows = ids if kind in UNGATED_KINDS else jnp.concatenate([ids, ids + n])  # gate rows first, then up rows
        gate_up, down, b_up = _take(gate_up, rows, 0), _take(down, ids, 1), None if b_up is None else b_up[ids]
    return ThresholdLayout(
        gate_up=gate_up.T if input_sparse else gate_up,
        down=down.T if activation_sparse else down,
        b_up=b_up,
        b_down=layer.b_down if with_b_down else None,
        input_threshold=jnp.float32(input_threshold or 0.0),
        activation_threshold=jnp.float32(activation_threshold or 0.0),
        kind=kind,
        input_sparse=input_sparse,
        activation_sparse=activation_sparse,
        **routing,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ThresholdProjection:
    """One product read by input rows: ``matrix`` (in, out) input-major (float, or int8 with one scale per
    output), its ``bias`` (out,) or None, and the ``threshold`` on |x_j| (float32 scalar; entries at most it
    are skipped)."""

    matrix: Matrix
    bias: jax.Array | None
    threshold: jax.Array


def projection_from(matrix: Matrix, bias: jax.Array | None, threshold: float) -> ThresholdProjection:
    """The decoder's (out, in) ``matrix`` laid out for input sparsity at ``threshold`` (4-bit: its int8 copy)."""
    if not (np.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"an input threshold must be a finite number >= 0, got {threshold!r}")
    return ThresholdProjection(_readable_by_rows(matrix, True).T, bias, jnp.float32(threshold))


@functools.partial(jax.jit, static_argnames=("backend",))
def threshold_projection(proj: ThresholdProjection, x: jax.Array, *, backend: RowsBackend = "auto"
                         ) -> tuple[jax.Array, jax.Array]:
    """x (..., in) through ``proj`` with its small inputs skipped, plus the bias, in x's dtype; and per token
    the inputs read."""
    tokens = x.reshape(-1, x.shape[-1])
    y, n_inputs = _project(proj.matrix, tokens, True, proj.threshold, backend)
    if proj.bias is not None:
        y = y + proj.bias.astype(jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], -1), n_inputs.reshape(x.shape[:-1])


def _readable_by_rows(matrix: Matrix, by_rows: bool) -> Matrix:
    """``matrix``, or where it is read by rows (or cut into neurons) and 4-bit, the int8 copy of its
    dequantized form, one scale per output (module docstring: why not 4-bit rows)."""
    return quantized.int8_copy(matrix) if by_rows and isinstance(matrix, Q4Matrix) else matrix


def _take(matrix: jax.Array | Int8Matrix, index: jax.Array, axis: int) -> jax.Array | Int8Matrix:
    return matrix.take(index, axis) if isinstance(matrix, Int8Matrix) else jnp.take(matrix, index, axis)


def kept(values: jax.Array, threshold: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(indices of the entries of ``values`` (n,) with magnitude over ``threshold``, in order and
    padded to length n; their count)."""
    keep = jnp.abs(values.astype(jnp.float32)) > threshold
    return jnp.nonzero(keep, size=values.shape[0], fill_value=0)[0].astype(jnp.int32), keep.sum(dtype=jnp.int32)


def _project(matrix: Matrix, x: jax.Array, input_major: bool, threshold: jax.Array,
             backend: RowsBackend) -> tuple[jax.Array, jax.Array]:
    """(x (T, in) through ``matrix``, float32 (T, out); inputs kept per token (T,)): an input-major matrix through
    ``ops.threshold.threshold_rows`` (the native kernel that keeps, compacts and reads the kept rows in one call on
    the CPU for decode steps, else ``_xla_project``), the decoder's (out, in) matrix densely."""
    if not input_major:
        return _xla_project(matrix, x, False, threshold, backend)
    xla = lambda m, x, t: _xla_project(m, x, True, t, backend)
    return threshold_rows(matrix, x, threshold, xla=xla, backend=backend)


def _xla_project(matrix: Matrix, x: jax.Array, input_major: bool, threshold: jax.Array,
                 backend: RowsBackend) -> tuple[jax.Array, jax.Array]:
    """``_project`` in XLA ops.

    input_major: ``matrix`` is (in, out) and x's entries at most ``threshold`` are skipped;
    otherwise it is (out, in) and the product is dense. An int8 matrix (one scale per output): every
    product is W8A8 (``quantized.matmul``); one token quantizes x whole (its peak is kept, so the token's
    scale is that of x with the skipped entries zeroed) and sums the kept rows in int32."""
    is_int8 = isinstance(matrix, Int8Matrix)
    if not input_major:
        # the decoder's own products (``transformer.linear``): one token or a batch's, the same sums, so a
        # sequence's keep decisions downstream do not depend on its batch
        if quantized.is_quantized(matrix):
            product = quantized.matmul(x, matrix)
        else:
            product = dense.float_product(x, matrix, accumulate=jnp.float32)
        return product, jnp.full(x.shape[:1], x.shape[1], jnp.int32)
    if x.shape[0] == 1:
        ids, count = kept(x[0], threshold)
        if is_int8:  # the same integers as quantized.matmul of x with the skipped entries zeroed
            q, token_scales = int8.quantize_tokens(x)
            acc = sparse_rows_product(matrix.values, q, ids, count, backend=backend)
            return acc.astype(jnp.float32) * (token_scales[:, None] * matrix.scales[None, :]), count[None]
        return sparse_rows_product(matrix, x, ids, count, backend=backend), count[None]
    keep = jnp.abs(x.astype(jnp.float32)) > threshold
    masked = jnp.where(keep, x, 0)
    if is_int8:
        product = quantized.matmul(masked, matrix)
    else:
        product = jnp.einsum("ti,io->to", masked.astype(matrix.dtype), matrix, preferred_element_type=jnp.float32)
    return product, keep.sum(-1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("backend",))
def threshold_ffn(ffn: ThresholdLayout, x: jax.Array, *, backend: RowsBackend = "auto"
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The FFN output for x (..., d) with small inputs and activations skipped, in x's dtype, and
    per token the kept counts: {"inputs": FFN input dimensions read, "neurons": down rows read}
    (d and d_ff for a kind that is off)."""
    tokens = x.reshape(-1, x.shape[-1])
    h, n_inputs = _project(ffn.gate_up, tokens, ffn.input_sparse, ffn.input_threshold, backend)
    n = ffn.d_ff
    up = h[:, -n:]
    if ffn.b_up is not None:
        up = up + ffn.b_up.astype(jnp.float32)
    a = activate(ffn.kind, None if ffn.kind in UNGATED_KINDS else h[:, :n], up)
    if ffn.router is not None:
        a = a * routing_of(ffn.router, ffn.routing_rule, ffn.neuron_experts, tokens)
    y, n_neurons = _project(ffn.down, a, ffn.activation_sparse, ffn.activation_threshold, backend)
    if ffn.b_down is not None:
        y = y + ffn.b_down.astype(jnp.float32)
    lead = x.shape[:-1]
    return y.astype(x.dtype).reshape(x.shape), {"inputs": n_inputs.reshape(lead), "neurons": n_neurons.reshape(lead)}
