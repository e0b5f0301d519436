"""The sparse FFN op: the dense FFN restricted to an explicit list of neurons.

``sparse_ffn(ffn, x, ids, count)`` returns ``sum_{j < count} act_{ids[j]}(x) *
down_{ids[j]}``, plus ``ffn.b_down`` once when the layout carries it (so the full list
over a whole layer equals the dense FFN output, up to rounding). The list has a static
capacity K (its length) and a traced valid count: entries at positions >= count are
padding and contribute nothing, so one compiled function serves every token.

Backends (``ops.listed`` picks each per lowering platform, ``ops.table``): ``backend="auto"`` runs on the CPU the
native fused kernel (float32 rows, int8 bundles, an int4 model's records; the library loaded), else the chunked
XLA loop (float rows) or the XLA gather (bundles); on CUDA GPUs the Pallas kernel for float rows when this jax has
the Triton lowering, else the XLA gather; on other accelerators the gather. ``backend="pallas"`` forces the kernel
(interpret mode on the CPU: tests; float rows only); ``backend="xla"`` forces the platform's XLA form (the chunked
loop on the CPU) and ``backend="gather"`` the XLA gather on any platform.

With experts (``NeuronFFN.router``) each listed activation is times its expert's routing weight: int8 bundles
pass the weights to their kernel; float lists run as the kernels' two halves (``ops.listed.weighted_ffn``), since
the fused float kernels and the Pallas ones take no weights (``backend="pallas"`` refuses experts).

``host_sparse_ffn(ffn)`` is ``sparse_ffn`` over a host layout as a plain Python call of the same native kernel (no
jax dispatch): the hybrid's host half.

``sparse_rows_product(matrix, x, ids, count)`` is the product x @ matrix over listed rows
only: the input-sparse linear map of the threshold mode (``threshold_layout.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.models import quantized
from jpinfer.ops import listed
from jpinfer.ordering import after
from jpinfer.quant import int8
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.sparse.neurons import NeuronFFN, routing_of

Backend = Literal["auto", "xla", "gather", "pallas"]
BACKENDS: tuple[str, ...] = ("auto", "xla", "gather", "pallas")
RowsBackend = Literal["auto", "loop", "gather"]
ROWS_BACKENDS: tuple[str, ...] = ("auto", "loop", "gather")


def _check(ffn: NeuronFFN, x: jax.Array, ids: jax.Array, count) -> None:
    if x.ndim not in (1, 2) or x.shape[-1] != ffn.d_model:
        raise ValueError(f"x must be (d_model,) or (T, d_model) with d_model={ffn.d_model}, got {x.shape}")
    _check_list(ids, count)


def _check_list(ids: jax.Array, count) -> None:
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be a 1-D integer array (padded neuron list), got {ids.dtype} {ids.shape}")
    if np.ndim(count) != 0:
        raise ValueError(f"count must be a scalar (number of valid ids), got shape {np.shape(count)}")


@functools.partial(jax.jit, static_argnames=("backend",))
def sparse_ffn(
    ffn: NeuronFFN,
    x: jax.Array,
    ids: jax.Array,
    count: jax.Array | int,
    *,
    backend: Backend = "auto",
) -> jax.Array:
    """FFN output over the first ``count`` neurons of ``ids`` (rows of ``ffn``).

    x: (d,) for one token or (T, d) for tokens sharing the list. ids: (K,) integer
    row indices into ``ffn.rows``; valid ones must lie in [0, n) and not repeat
    (not checked on the device: the XLA forms clamp an id outside, the native kernel skips
    it). Returns x's shape and dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check(ffn, x, ids, count)
    x2 = x.reshape(-1, ffn.d_model)
    ids = ids.astype(jnp.int32)
    count = jnp.asarray(count, jnp.int32)

    if ids.shape[0] == 0:
        y = jnp.zeros(x2.shape, jnp.float32)
    elif ffn.router is not None:
        y = _routed_ffn(ffn, x2, ids, count, backend)
    elif ffn.quantized:
        y = _quantized_ffn(ffn, x2, ids, count, backend)
    else:
        y = listed.float_ffn(ffn.rows, ffn.b_up, x2, ids, count, kind=ffn.kind, backend=backend)
    return _with_b_down(ffn, y).astype(x.dtype).reshape(x.shape)


def _routed_ffn(ffn: NeuronFFN, x: jax.Array, ids: jax.Array, count: jax.Array, backend: str) -> jax.Array:
    """``sparse_ffn`` of a layout with experts, float32 (T, d) without ``b_down``: each listed neuron's activation
    times its expert's routing weight. Int8 bundles pass the weights to their kernel; the fused float kernels take
    none, so a float list runs as the two halves: the listed activations, then the down rows weighted by them
    times the routing weights (the native ``sparse_activations`` and ``listed_rows_sum`` on the CPU, their XLA
    forms elsewhere and for backends "xla" and "gather"; ``ops.listed``); backend "pallas" is refused."""
    experts = jnp.take(ffn.neuron_experts, jnp.clip(ids, 0, ffn.n_neurons - 1))
    weights = routing_of(ffn.router, ffn.routing_rule, experts, x)  # (T, K)
    if ffn.quantized:
        return _quantized_ffn(ffn, x, ids, count, backend, weights)
    return listed.weighted_ffn(ffn.rows, ffn.b_up, x, ids, count, weights, kind=ffn.kind, backend=backend)


def _quantized_ffn(ffn: NeuronFFN, x: jax.Array, ids: jax.Array, count: jax.Array, backend: str,
                   weights: jax.Array | None = None) -> jax.Array:
    """``sparse_ffn`` over int8 bundles or an int4 model's (4-bit gate/up rows), float32 (T, d) without ``b_down``
    (``ops.listed.quantized_ffn``); ``weights`` (T, K) multiply the listed activations (the routing weights with
    experts)."""
    return listed.quantized_ffn(ffn.gate_up, ffn.rows, ffn.scales, ffn.down_scales, ffn.b_up, x, ids, count, weights,
                                kind=ffn.kind, backend=backend)


def host_sparse_ffn(ffn: NeuronFFN) -> Callable[[np.ndarray, np.ndarray, int], np.ndarray] | None:
    """``sparse_ffn`` over ``ffn`` (its arrays on the host) as a direct host call: ``call(x, ids, count)`` for numpy
    x (T, d) or (d,), 1..8 tokens, gives float32 of x's shape, the bits of ``sparse_ffn(ffn, x, ids, count)`` on the
    CPU as float32 (the same native kernel, ``ops.listed.host_ffn``, ``b_down`` added in float32 as there; the
    caller casts to its dtype). None where no native kernel reads the layout, and for a layout with experts (its
    routing weights are jax's computation): the caller keeps the jitted ``sparse_ffn``."""
    if ffn.router is not None or ffn.n_neurons == 0:
        return None
    call = listed.host_ffn(ffn.gate_up, ffn.rows, ffn.scales, ffn.down_scales, ffn.b_up, kind=ffn.kind)
    if call is None or ffn.b_down is None:
        return call
    b_down = np.asarray(ffn.b_down, np.float32)
    return lambda x, ids, count: call(x, ids, count) + b_down


@jax.jit
def all_rows_ffn(ffn: NeuronFFN, x: jax.Array, keep: jax.Array | None = None) -> jax.Array:
    """FFN output over every neuron of ``ffn`` (a whole layer, or its hot or cold part), as
    dense products over the neuron-major rows: ``sparse_ffn`` with the full list, for many
    tokens at once (prefill), where a batch of tokens activates most neurons anyway.

    The rows are viewed as an (n, R * d) matrix and each projection reads its column block:
    at the default model's layer shape and 64 tokens this ran as fast as the dense FFN
    (2.8 vs 2.5 ms), while an einsum over the (n, R, d) array's gate/up slice took twice as
    long (5.0 ms) (docs/architecture.md, "Engine modes").

    Up to ``native.kernels.MAX_TOKENS`` tokens (a decode step's batch, a short prompt) run as ``sparse_ffn`` over the
    full list with ``keep`` as 0/1 weights: natively on the CPU (float32 and int8 bundles; one pass over the rows,
    as the dense model's native products for so few tokens), and an int4 model's records on every platform. More
    tokens, or float / int8 bundles off the CPU, run the XLA products above; int8 bundles the dense int8 FFN's
    (``quant.int8.product``: W8A8) on their column blocks, an int4 model's records (more than 8 tokens) the dense
    4-bit product (``models.quantized.matmul``) over the matrix they hold, copied out of them for the call, then the
    int8 down slots.

    ``keep`` (T, n) boolean zeroes each token's other neurons' activations: the FFN over a list per token
    (a batch of sequences, each with its own predicted neurons), reading every row once. With experts each
    activation is times its expert's routing weight (``NeuronFFN.routing``).

    x: (d,) or (T, d); returns x's shape and dtype, ``b_down`` added when the layout has it.
    """
    if x.ndim not in (1, 2) or x.shape[-1] != ffn.d_model:
        raise ValueError(f"x must be (d_model,) or (T, d_model) with d_model={ffn.d_model}, got {x.shape}")
    n, d = ffn.n_neurons, ffn.d_model
    x2 = x.reshape(-1, d).astype(jnp.float32 if ffn.quantized else ffn.rows.dtype)
    keep = None if keep is None else keep.reshape(-1, n)
    routing = None if ffn.router is None else ffn.routing(x.reshape(-1, d))
    fmt = "int4" if ffn.gate_up is not None else "int8" if ffn.quantized else "float"
    y = listed.all_rows(_full_list, _xla_all_rows, ffn, x2, keep, routing, fmt=fmt, tokens=x2.shape[0], rows=ffn.rows)
    return _with_b_down(ffn, y).astype(x.dtype).reshape(x.shape)


def _full_list(ffn: NeuronFFN, x: jax.Array, keep: jax.Array | None, routing: jax.Array | None) -> jax.Array:
    """``ffn`` over every one of its neurons for up to 8 tokens, float32 (T, d) without b_down: the sparse op over
    the full list, ``keep`` (T, n) as 0/1 weights on the activations, times ``routing`` with experts; the native
    kernels (a 4-bit model's records: their own platform choice, ``_quantized_ffn``)."""
    weights = None if keep is None else keep.astype(jnp.float32)
    if routing is not None:
        weights = routing if weights is None else weights * routing
    if ffn.quantized:
        every, n = jnp.arange(ffn.n_neurons, dtype=jnp.int32), jnp.int32(ffn.n_neurons)
        return _quantized_ffn(ffn, x, every, n, "auto", weights)
    return listed.cpu_full_list(ffn.rows, ffn.b_up, x, weights, kind=ffn.kind)


def _xla_all_rows(ffn: NeuronFFN, x2: jax.Array, keep: jax.Array | None, routing: jax.Array | None) -> jax.Array:
    """``all_rows_ffn``'s dense products in XLA, float32 (T, d) without b_down (its docstring)."""
    n, n_rows, d = ffn.rows.shape
    flat = ffn.rows.reshape(n, n_rows * d)
    n_proj = n_rows - 1 if ffn.gate_up is None else ffn.gate_up.slots
    # each block is copied out of the bundles once the layer's tokens exist (``ordering.after``: XLA otherwise
    # copied every layer's at the start of a prompt's step and held them all, 4.4 GB for a 7B int8 model)
    block = lambda j: after(flat[:, j * d : (j + 1) * d], x2)
    if ffn.gate_up is not None:  # the dense 4-bit product over the gate/up rows, then the int8 down slots
        records = dataclasses.replace(ffn.gate_up, records=after(ffn.gate_up.records, x2))
        gate_up = quantized.matmul(x2, records.matrix())
        project = lambda j: gate_up[:, j * n : (j + 1) * n]
        down = lambda act: int8.product(act, Int8Matrix(block(0), ffn.down_scales, 1))
    elif ffn.quantized:
        project = lambda j: int8.product(x2, Int8Matrix(block(j), ffn.scales[:, j], 0))
        # the down block is (n, d) input-major: a scale per column
        down = lambda act: int8.product(act, Int8Matrix(block(n_proj), ffn.down_scales, 1))
    else:
        project = lambda j: jnp.einsum("td,nd->tn", x2, block(j), preferred_element_type=jnp.float32)
        down = lambda act: jnp.einsum("tn,nd->td", act.astype(flat.dtype), block(n_proj),
                                      preferred_element_type=jnp.float32)
    up = project(n_proj - 1)
    if ffn.b_up is not None:
        up = up + ffn.b_up.astype(jnp.float32)
    act = activate(ffn.kind, project(0) if n_proj == 2 else None, up)
    if routing is not None:
        act = act * routing
    return down(act if keep is None else jnp.where(keep, act, 0))


def _with_b_down(ffn: NeuronFFN, y: jax.Array) -> jax.Array:
    return y if ffn.b_down is None else y + ffn.b_down.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("backend",))
def sparse_rows_product(
    matrix: jax.Array, x: jax.Array, ids: jax.Array, count: jax.Array | int, *, backend: RowsBackend = "auto"
) -> jax.Array:
    """x @ matrix over the first ``count`` listed rows of ``matrix`` only, float32 (T, m), or the exact
    int32 product when both are int8 (W8A8: the caller applies the scales).

    matrix: (n, m), input-major (a row per input dimension), float, or int8 with an int8 x; x: (T, n);
    ids: (K,) row indices
    (padding past ``count``; valid ones in [0, n), clamped, not checked). Backends: ``loop``
    (``ops.chunked.sparse_rows_product``, chunks read in place: for the CPU), ``gather`` (all
    rows at once, then one product), ``auto`` (the loop on the CPU, the gather elsewhere; ``ops.listed.rows_product``).
    """
    if backend not in ROWS_BACKENDS:
        raise ValueError(f"backend must be one of {ROWS_BACKENDS}, got {backend!r}")
    if matrix.ndim != 2 or x.ndim != 2 or x.shape[1] != matrix.shape[0]:
        raise ValueError(f"need matrix (n, m) and x (T, n), got {matrix.shape} and {x.shape}")
    _check_list(ids, count)
    ids = ids.astype(jnp.int32)
    count = jnp.asarray(count, jnp.int32)
    if ids.shape[0] == 0:
        dtype = jnp.int32 if listed.integer_operands(matrix, x) else jnp.float32
        return jnp.zeros((x.shape[0], matrix.shape[1]), dtype)
    return listed.rows_product(matrix, x, ids, count, backend=backend)
