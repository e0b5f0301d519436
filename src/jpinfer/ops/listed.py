"""Listed rows: the sparse FFN over a list of neurons, and x @ M over a list of M's rows.

Each function takes the layout's arrays (``sparse.neurons.NeuronFFN`` unpacks them: ``sparse.op``) and picks its
implementation per lowering platform (``ops.table``, products "listed", "weighted", "all_rows" and "rows"):

- float rows: on the CPU the native fused kernel (``native.kernels.sparse_ffn``: float32 rows, the library
  loaded), else the chunked XLA loop (``ops.chunked``); on CUDA GPUs the Pallas kernel (``pallas.DEFAULT_KERNEL``)
  when this jax has the Triton lowering, else the XLA gather (``gathered_ffn``); on other accelerators the gather;
- int8 bundles (W8A8) and an int4 model's records (4-bit gate/up): the native ``sparse_ffn_int8`` /
  ``sparse_ffn_q4`` on the CPU, their XLA gather forms elsewhere (the Pallas kernels read float rows only);
- with a weight per listed activation (experts' routing, keep masks) float rows run as the kernels' two halves,
  ``sparse_activations`` then ``listed_rows_sum``, natively on the CPU, in XLA elsewhere;
- x @ M over listed rows: the chunked loop on the CPU, the gather elsewhere;
- ``host_ffn``: the listed FFN as a direct host call (``native.host``: the same native kernel on the layout's host
  arrays, called from Python without a jax dispatch; the hybrid's host half), where the library reads the format.

Backends force a choice (tests, benches): "xla" the platform's XLA form, "gather" the gather everywhere, "pallas"
the kernel (interpret mode on the CPU); for the rows product "loop" or "gather".
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jpinfer.activations import activate
from jpinfer.native import host as native_host
from jpinfer.native import kernels as native_kernels
from jpinfer.native import native_available
from jpinfer.ops.chunked import sparse_ffn_chunked
from jpinfer.ops.chunked import sparse_rows_product as sparse_rows_chunked
from jpinfer.ops.table import dispatch, pick
from jpinfer.pallas import DEFAULT_KERNEL, KERNELS, triton_available
from jpinfer.quant.q4 import Q4Bundles

MAX_TOKENS = native_kernels.MAX_TOKENS


def native_reads(rows: jax.Array) -> bool:
    """Whether the native CPU kernels read these float rows: float32, the library loaded (``native.
    native_available``: else one warning said why, and XLA runs)."""
    return rows.dtype == jnp.float32 and native_available()


def float_ffn(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array, *,
              kind: str, backend: str) -> jax.Array:
    """The FFN over the first ``count`` listed neurons of float neuron-major rows (n, R, d), float32 (T, d) without
    ``b_down`` (module docstring)."""
    implementations = {
        "native": lambda rows, b_up, x, ids, count: native_kernels.sparse_ffn(rows, x, ids, count, kind=kind,
                                                                              b_up=b_up, native=True),
        "loop": lambda *a: sparse_ffn_chunked(*a, kind=kind),
        "gather": lambda *a: gathered_ffn(*a, kind=kind),
        "pallas": lambda *a: KERNELS[DEFAULT_KERNEL](*a, kind=kind),
        "pallas_interpret": lambda *a: KERNELS[DEFAULT_KERNEL](*a, kind=kind, interpret=True),
    }
    ready, triton = native_reads(rows), backend == "auto" and triton_available()
    choice = lambda p: pick("listed", "float", p, native=ready, triton=triton, backend=backend)
    return dispatch(choice, implementations, rows, b_up, x, ids, count)


def weighted_ffn(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array,
                 weights: jax.Array, *, kind: str, backend: str) -> jax.Array:
    """``float_ffn`` with each listed activation times ``weights`` (T, K): the two halves (module docstring)."""
    halves = functools.partial(_weighted_halves, kind=kind)
    choice = lambda p: pick("weighted", "float", p, native=native_reads(rows), backend=backend)
    implementations = {"native": functools.partial(halves, native=True), "xla": functools.partial(halves, native=False)}
    return dispatch(choice, implementations, rows, b_up, x, ids, count, weights)


def _weighted_halves(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array,
                     weights: jax.Array, *, kind: str, native: bool) -> jax.Array:
    """A float list's FFN with each listed activation times ``weights`` (T, K), float32 (T, d) without b_down: the
    listed activations, then the down rows weighted by them (the fused float kernels take no weights)."""
    act = native_kernels.sparse_activations(rows, x, ids, count, kind=kind, b_up=b_up, native=native)
    return native_kernels.listed_rows_sum(rows, act * weights, ids, count, native=native)


def cpu_full_list(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, weights: jax.Array | None, *,
                  kind: str) -> jax.Array:
    """Float rows' FFN over every neuron (``all_rows``' "listed" choice, which ``ops`` makes on the CPU only, where
    the native kernels read the rows), each activation times ``weights`` (T, n) where given."""
    every, n = jnp.arange(rows.shape[0], dtype=jnp.int32), jnp.int32(rows.shape[0])
    if weights is None:
        return native_kernels.sparse_ffn(rows, x, every, n, kind=kind, b_up=b_up, native=True)
    return _weighted_halves(rows, b_up, x, every, n, weights, kind=kind, native=True)


def quantized_ffn(gate_up: Q4Bundles | None, rows: jax.Array, scales: jax.Array | None, down_scales: jax.Array,
                  b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array,
                  weights: jax.Array | None, *, kind: str, backend: str) -> jax.Array:
    """The FFN over int8 bundles (``gate_up`` None: rows (n, R, d) int8 with ``scales``) or an int4 model's records
    (4-bit ``gate_up``, int8 down slots ``rows[:, 0]``), float32 (T, d) without ``b_down``; ``weights`` (T, K)
    multiply the listed activations."""
    if gate_up is not None:
        fmt, args = "int4", (gate_up, rows[:, 0], down_scales, b_up, x, ids, count, weights)
        gather = lambda *a: native_kernels.xla_sparse_ffn_q4(*a[:-1], kind=kind, weights=a[-1])
        native = lambda gate_up, down, down_scales, b_up, x, ids, count, weights: native_kernels.sparse_ffn_q4(
            gate_up, down, down_scales, x, ids, count, kind=kind, b_up=b_up, weights=weights, native=True)
    else:
        fmt, args = "int8", (rows, scales, down_scales, b_up, x, ids, count, weights)
        gather = lambda *a: native_kernels.xla_sparse_ffn_int8(*a[:-1], kind=kind, weights=a[-1])
        native = lambda rows, scales, down_scales, b_up, x, ids, count, weights: native_kernels.sparse_ffn_int8(
            rows, scales, down_scales, x, ids, count, kind=kind, b_up=b_up, weights=weights, native=True)
    ready = backend == "auto" and native_available()
    choice = lambda p: pick("listed" if weights is None else "weighted", fmt, p, native=ready, backend=backend)
    return dispatch(choice, {"native": native, "gather": gather}, *args)


def host_ffn(gate_up: Q4Bundles | None, rows: jax.Array, scales: jax.Array | None, down_scales: jax.Array | None,
             b_up: jax.Array | None, *, kind: str) -> native_host.HostFfn | None:
    """A layout's listed FFN (``quantized_ffn``'s operands, or float rows with ``scales`` and ``down_scales`` None) as
    a direct host call of its native kernel (``native.host.HostFfn``: ``call(x, ids, count[, weights])``, float32
    (T, d) without ``b_down``, the jitted kernel's bits), on views of its arrays, which must be on the host; None
    where the library is not loaded or does not read the rows (float rows other than float32)."""
    if not native_available():
        return None
    if gate_up is not None:
        return native_host.q4_ffn(gate_up.records, gate_up.kind, rows, down_scales, b_up, kind=kind)
    if rows.dtype == jnp.int8:
        return native_host.int8_ffn(rows, scales, down_scales, b_up, kind=kind)
    return native_host.float_ffn(rows, b_up, kind=kind) if rows.dtype == jnp.float32 else None


def all_rows(full_list: Callable, xla: Callable, *args, fmt: str, tokens: int, rows: jax.Array) -> jax.Array:
    """A layout's FFN over every neuron for ``tokens`` tokens: ``full_list(*args)`` (the listed FFN over the full
    list, one pass over the rows: for up to ``MAX_TOKENS`` tokens on the CPU where the native kernels read the
    bundles, and an int4 model's records on every platform) or ``xla(*args)`` (dense products over the rows)."""
    if tokens > MAX_TOKENS:
        return xla(*args)
    ready = rows.shape[0] > 0 and (rows.dtype == jnp.float32 or fmt != "float") and native_available()
    return dispatch(lambda p: pick("all_rows", fmt, p, native=ready), {"listed": full_list, "xla": xla}, *args)


def gathered_ffn(rows: jax.Array, b_up: jax.Array | None, x: jax.Array, ids: jax.Array, count: jax.Array, *,
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


def rows_product(matrix: jax.Array, x: jax.Array, ids: jax.Array, count: jax.Array, *, backend: str) -> jax.Array:
    """x @ matrix over the first ``count`` listed rows: the chunked loop (``ops.chunked``) or the gather (module
    docstring); float32, or int32 for int8 x int8."""
    fmt = "int8" if integer_operands(matrix, x) else "float"
    choice = lambda p: pick("rows", fmt, p, native=False, backend=backend)
    implementations = {"loop": sparse_rows_chunked, "gather": _gathered_rows_product}
    return dispatch(choice, implementations, matrix, x, ids, count)


def _gathered_rows_product(matrix: jax.Array, x: jax.Array, ids: jax.Array, count: jax.Array) -> jax.Array:
    """The listed rows gathered at once, then one product: for accelerators (on the CPU this spills
    the caches; docs/architecture.md)."""
    ids = jnp.clip(ids, 0, matrix.shape[0] - 1)  # padding may hold any value (the loop clamps its own)
    rows = matrix[ids]
    if integer_operands(matrix, x):
        weights = jnp.where(jnp.arange(ids.shape[0]) < count, x[:, ids], 0)
        return jnp.einsum("tk,km->tm", weights, rows, preferred_element_type=jnp.int32)
    weights = jnp.where(jnp.arange(ids.shape[0]) < count, x[:, ids].astype(jnp.float32), 0.0)
    return jnp.einsum("tk,km->tm", weights.astype(matrix.dtype), rows, preferred_element_type=jnp.float32)


def integer_operands(matrix: jax.Array, x: jax.Array) -> bool:
    return not (jnp.issubdtype(matrix.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.floating))
