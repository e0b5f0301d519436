"""The sparse FFN op: the dense FFN restricted to an explicit list of neurons.

``sparse_ffn(ffn, x, ids, count)`` returns ``sum_{j < count} act_{ids[j]}(x) *
down_{ids[j]}``, plus ``ffn.b_down`` once when the layout carries it (so the full list
over a whole layer equals the dense FFN output, up to rounding). The list has a static
capacity K (its length) and a traced valid count: entries at positions >= count are
padding and contribute nothing, so one compiled function serves every token.

Backends, picked per lowering platform (``backend="auto"``, so a function jitted for the CPU
device on a GPU machine still gets the CPU kernel): on CUDA GPUs the Pallas kernel
(``jpinfer.pallas.DEFAULT_KERNEL``) when this jax has the Triton lowering, else the XLA gather
(``_gathered_ffn``: the listed rows taken at once, then products); on other accelerators the XLA
gather; on the CPU the native fused kernel (``jpinfer.native``: float32 rows, the library loaded),
else the chunked XLA loop (``ops.chunked``). ``backend="pallas"`` forces the kernel (interpret mode
on the CPU: tests); ``backend="xla"`` forces the platform's XLA form (the chunked loop on the CPU)
and ``backend="gather"`` the XLA gather on any platform.

Int8 bundles (``NeuronFFN.quantized``, W8A8: the dense int8 FFN's integers over the list) run the
native ``native.kernels.sparse_ffn_int8`` on the CPU (library loaded) and its XLA gather form
(``native.kernels.xla_sparse_ffn_int8``) elsewhere and for ``backend="xla"`` / ``"gather"``; an int4
model's (4-bit gate/up records, ``NeuronFFN.gate_up``) ``sparse_ffn_q4`` and ``xla_sparse_ffn_q4``
likewise. The Pallas kernels read float rows only, so ``backend="pallas"`` refuses quantized bundles.

With experts (``NeuronFFN.router``) each listed activation is times its expert's routing weight: int8 bundles
pass the weights to their kernel; float lists run as the kernels' two halves (``sparse_activations``, then
``listed_rows_sum`` over the weighted activations), since the fused float kernels and the Pallas ones take no
weights (``backend="pallas"`` refuses experts).

``sparse_rows_product(matrix, x, ids, count)`` is the product x @ matrix over listed rows
only: the input-sparse linear map of the threshold mode (``threshold_layout.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.models import quantized
from jpinfer.native import kernels as native_kernels
from jpinfer.native import native_available
from jpinfer.ops.chunked import sparse_ffn_chunked
from jpinfer.ops.chunked import sparse_rows_product as sparse_rows_chunked
from jpinfer.ordering import after
from jpinfer.pallas import DEFAULT_KERNEL, KERNELS, triton_available
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
        args = (ffn.rows, ffn.b_up, x2, ids, count)
        loop = lambda *a: sparse_ffn_chunked(*a, kind=ffn.kind)
        cpu = _native_ffn(ffn.kind) if native_serves(ffn.rows) else loop
        gather = lambda *a: _gathered_ffn(*a, kind=ffn.kind)
        kernel = lambda *a: KERNELS[DEFAULT_KERNEL](*a, kind=ffn.kind)
        if backend == "xla":
            y = jax.lax.platform_dependent(*args, cpu=loop, default=gather)
        elif backend == "gather":
            y = gather(*args)
        elif backend == "pallas":
            interpreted = lambda *a: KERNELS[DEFAULT_KERNEL](*a, kind=ffn.kind, interpret=True)
            y = jax.lax.platform_dependent(*args, cpu=interpreted, default=kernel)
        else:
            y = jax.lax.platform_dependent(*args, cpu=cpu, cuda=kernel if triton_available() else gather,
                                           default=gather)
    return _with_b_down(ffn, y).astype(x.dtype).reshape(x.shape)


def _routed_ffn(ffn: NeuronFFN, x: jax.Array, ids: jax.Array, count: jax.Array, backend: str) -> jax.Array:
    """``sparse_ffn`` of a layout with experts, float32 (T, d) without ``b_down``: each listed neuron's activation
    times its expert's routing weight. Int8 bundles pass the weights to their kernel; the fused float kernels take
    none, so a float list runs as the two halves: the listed activations, then the down rows weighted by them
    times the routing weights (the native ``sparse_activations`` and ``listed_rows_sum`` on the CPU, their XLA
    forms elsewhere and for backends "xla" and "gather")."""
    if backend == "pallas":
        raise ValueError("a layout with experts runs with backend 'auto', 'xla' or 'gather' (the Pallas kernels "
                         "take no routing weights)")
    listed = jnp.take(ffn.neuron_experts, jnp.clip(ids, 0, ffn.n_neurons - 1))
    weights = routing_of(ffn.router, ffn.experts_per_token, listed, x)  # (T, K)
    if ffn.quantized:
        return _quantized_ffn(ffn, x, ids, count, backend, weights)

    args = (ffn.rows, ffn.b_up, x, ids, count, weights)
    halves = functools.partial(_weighted_halves, kind=ffn.kind)
    if backend == "auto" and native_serves(ffn.rows):
        return jax.lax.platform_dependent(*args, cpu=functools.partial(halves, native=True),
                                          default=functools.partial(halves, native=False))
    return halves(*args, native=False)


def _weighted_halves(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array,
                     weights: jax.Array, *, kind: str, native: bool) -> jax.Array:
    """A float list's FFN with each listed activation times ``weights`` (T, K), float32 (T, d) without b_down: the
    listed activations, then the down rows weighted by them (the fused float kernels take no weights)."""
    act = native_kernels.sparse_activations(rows, x, ids, count, kind=kind, b_up=b_up, native=native)
    return native_kernels.listed_rows_sum(rows, act * weights, ids, count, native=native)


def _quantized_ffn(ffn: NeuronFFN, x: jax.Array, ids: jax.Array, count: jax.Array, backend: str,
                   weights: jax.Array | None = None) -> jax.Array:
    """``sparse_ffn`` over int8 bundles or an int4 model's (4-bit gate/up rows), float32 (T, d) without ``b_down``
    (module docstring); ``weights`` (T, K) multiply the listed activations (the routing weights with experts)."""
    if backend == "pallas":
        raise ValueError("the Pallas kernels take float rows: quantized bundles run with backend 'auto', 'xla' or "
                         "'gather'")
    if ffn.gate_up is not None:
        args = (ffn.gate_up, ffn.rows[:, 0], ffn.down_scales, ffn.b_up, x, ids, count, weights)
        gather = lambda *a: native_kernels.xla_sparse_ffn_q4(*a[:-1], kind=ffn.kind, weights=a[-1])
        native = lambda gate_up, down, down_scales, b_up, x, ids, count, weights: native_kernels.sparse_ffn_q4(
            gate_up, down, down_scales, x, ids, count, kind=ffn.kind, b_up=b_up, weights=weights, native=True)
    else:
        args = (ffn.rows, ffn.scales, ffn.down_scales, ffn.b_up, x, ids, count, weights)
        gather = lambda *a: native_kernels.xla_sparse_ffn_int8(*a[:-1], kind=ffn.kind, weights=a[-1])
        native = lambda rows, scales, down_scales, b_up, x, ids, count, weights: native_kernels.sparse_ffn_int8(
            rows, scales, down_scales, x, ids, count, kind=ffn.kind, b_up=b_up, weights=weights, native=True)
    if backend != "auto" or not native_available():
        return gather(*args)
    return jax.lax.platform_dependent(*args, cpu=native, default=gather)


def native_serves(matrix: jax.Array) -> bool:
    """Whether the native CPU kernels serve this matrix: float32 (they read float32 rows) and the
    library loaded (``native.native_available``: else one warning said why, and XLA runs)."""
    return matrix.dtype == jnp.float32 and native_available()


def _native_ffn(kind: str):
    """The native fused sparse FFN (``native.kernels.sparse_ffn``) in ``sparse_ffn_chunked``'s signature."""
    return lambda rows, b_up, x, ids, count: native_kernels.sparse_ffn(rows, x, ids, count, kind=kind, b_up=b_up,
                                                                       native=True)


def _gathered_ffn(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array, *,
                  kind: str) -> jax.Array:
    """The listed neurons' rows gathered at once, then dense products (float32 (T, d)): the XLA form
    for accelerators, where one gather of K rows is one wide parallel read (on the CPU the gathered
    copy spills the caches: the chunked loop is faster there)."""
    ids = jnp.clip(ids, 0, rows.shape[0] - 1)
    picked = rows[ids]  # (K, R, d)
    n_in = rows.shape[1] - 1
    h = jnp.einsum("td,krd->rtk", x.astype(rows.dtype), picked[:, :n_in], preferred_element_type=jnp.float32)
    up = h[n_in - 1] + (0.0 if b_up is None else b_up[ids].astype(jnp.float32))
    act = activate(kind, h[0] if n_in == 2 else None, up)
    act = jnp.where(jnp.arange(ids.shape[0]) < count, act, 0.0)
    return jnp.einsum("tk,kd->td", act.astype(rows.dtype), picked[:, n_in], preferred_element_type=jnp.float32)


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
    args = (ffn, x2, keep, routing)
    if x2.shape[0] > native_kernels.MAX_TOKENS:
        y = _xla_all_rows(*args)
    elif ffn.gate_up is not None:  # an int4 model's records: the sparse op on every platform
        y = _full_list(*args)
    elif n > 0 and _native_serves_bundles(ffn):
        y = jax.lax.platform_dependent(*args, cpu=_full_list, default=_xla_all_rows)
    else:
        y = _xla_all_rows(*args)
    return _with_b_down(ffn, y).astype(x.dtype).reshape(x.shape)


def _native_serves_bundles(ffn: NeuronFFN) -> bool:
    """Whether the native CPU kernels serve this layout's bundles: float32 (``native_serves``) or int8 ones, the
    library loaded."""
    return native_serves(ffn.rows) or (ffn.quantized and native_available())


def _full_list(ffn: NeuronFFN, x: jax.Array, keep: jax.Array | None, routing: jax.Array | None) -> jax.Array:
    """``ffn`` over every one of its neurons for up to 8 tokens, float32 (T, d) without b_down: the sparse op over
    the full list, ``keep`` (T, n) as 0/1 weights on the activations, times ``routing`` with experts; the native
    kernels (a 4-bit model's records: their own platform choice, ``_quantized_ffn``)."""
    weights = None if keep is None else keep.astype(jnp.float32)
    if routing is not None:
        weights = routing if weights is None else weights * routing
    every, n = jnp.arange(ffn.n_neurons, dtype=jnp.int32), jnp.int32(ffn.n_neurons)
    if ffn.quantized:
        return _quantized_ffn(ffn, x, every, n, "auto", weights)
    if weights is None:
        return native_kernels.sparse_ffn(ffn.rows, x, every, n, kind=ffn.kind, b_up=ffn.b_up, native=True)
    return _weighted_halves(ffn.rows, ffn.b_up, x, every, n, weights, kind=ffn.kind, native=True)


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


def _gathered_rows_product(matrix: jax.Array, x: jax.Array, ids: jax.Array, count: jax.Array) -> jax.Array:
    """The listed rows gathered at once, then one product: for accelerators (on the CPU this spills
    the caches; docs/architecture.md)."""
    ids = jnp.clip(ids, 0, matrix.shape[0] - 1)  # padding may hold any value (the loop clamps its own)
    rows = matrix[ids]
    if _integer(matrix, x):
        weights = jnp.where(jnp.arange(ids.shape[0]) < count, x[:, ids], 0)
        return jnp.einsum("tk,km->tm", weights, rows, preferred_element_type=jnp.int32)
    weights = jnp.where(jnp.arange(ids.shape[0]) < count, x[:, ids].astype(jnp.float32), 0.0)
    return jnp.einsum("tk,km->tm", weights.astype(matrix.dtype), rows, preferred_element_type=jnp.float32)


def _integer(matrix: jax.Array, x: jax.Array) -> bool:
    return not (jnp.issubdtype(matrix.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.floating))


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
    rows at once, then one product), ``auto`` (the loop on the CPU, the gather elsewhere).
    """
    if backend not in ROWS_BACKENDS:
        raise ValueError(f"backend must be one of {ROWS_BACKENDS}, got {backend!r}")
    if matrix.ndim != 2 or x.ndim != 2 or x.shape[1] != matrix.shape[0]:
        raise ValueError(f"need matrix (n, m) and x (T, n), got {matrix.shape} and {x.shape}")
    _check_list(ids, count)
    ids = ids.astype(jnp.int32)
    count = jnp.asarray(count, jnp.int32)
    if ids.shape[0] == 0:
        return jnp.zeros((x.shape[0], matrix.shape[1]), jnp.int32 if _integer(matrix, x) else jnp.float32)
    args = (matrix, x, ids, count)
    if backend == "loop":
        return sparse_rows_chunked(*args)
    if backend == "gather":
        return _gathered_rows_product(*args)
    return jax.lax.platform_dependent(*args, cpu=sparse_rows_chunked, default=_gathered_rows_product)
