"""The native CPU kernels as functions of plain jax arrays (usable under jit, inside lax.scan).

Each function runs the native kernel (an XLA FFI custom call, ``csrc/``) when the library is loaded
and ``native`` allows it, else an XLA implementation of the same semantics (slower, and summing in
another order: equal within float32 rounding, and exactly for the integer parts). ``native``: None =
the native kernel when available, True = require it (RuntimeError when unavailable), False = XLA.

Shapes are static; counts and ids are device arrays. ``x`` is (T, d) (or (d,), giving a 1-D result);
one native call takes 1 to ``MAX_TOKENS`` tokens, longer batches run as several calls of up to 8.
Every product accumulates in float32 (int32 for int8 x int8 sums).

Lists (``ids`` int32 (K,), ``count`` int32 scalar): the count is clamped to [0, K]; entries at
positions >= count are padding and ignored; ids outside [0, n) are skipped (never read: unlike the
XLA chunk loop of jpinfer.sparse.cpu_backend, which clamps them onto row 0 or n - 1); a repeated id
counts each time it is listed (like the XLA loop, which sums every listed entry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.config import UNGATED_KINDS
from jpinfer.native.library import native_available, unavailable_reason
from jpinfer.quant import int8, q4
from jpinfer.quant.int8 import Int8Matrix
from jpinfer.quant.q4 import Q4Bundles, Q4Matrix

MAX_TOKENS = 8
KINDS = {"swiglu": 0, "reglu": 1, "drelu": 2, "relu": 3, "geglu": 4, "gelu": 5}  # csrc/sparse_ffn.cc Kind


def _use_native(native: bool | None) -> bool:
    if native is None:
        return native_available()
    if native and not native_available():
        raise RuntimeError(f"native kernels requested but unavailable: {unavailable_reason()}")
    return bool(native)


def _tokens(x, d: int, name: str = "x") -> tuple[jax.Array, bool]:
    """x as float32 (T, d), and whether it was 1-D."""
    x = jnp.asarray(x)
    if x.ndim not in (1, 2) or x.shape[-1] != d:
        raise ValueError(f"{name} must be (T, {d}) or ({d},), got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a float array, got {x.dtype}")
    if x.ndim == 2 and x.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one token")
    return x.reshape(x.shape[0] if x.ndim == 2 else 1, d).astype(jnp.float32), x.ndim == 1


def _per_group(fn, x: jax.Array, *rest_batched):
    """fn(x_group, *rest_groups) over groups of at most MAX_TOKENS tokens, outputs concatenated along 0."""
    T = x.shape[0]
    if T <= MAX_TOKENS:
        return fn(x, *rest_batched)
    outs = [fn(x[s:s + MAX_TOKENS], *(r[s:s + MAX_TOKENS] for r in rest_batched)) for s in range(0, T, MAX_TOKENS)]
    if isinstance(outs[0], tuple):
        return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*outs))
    return jnp.concatenate(outs, axis=0)


def _list(ids, count) -> tuple[jax.Array, jax.Array]:
    ids = jnp.asarray(ids)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} {tuple(ids.shape)}")
    count = jnp.asarray(count)
    if count.size != 1 or not jnp.issubdtype(count.dtype, jnp.integer):
        raise ValueError(f"count must be an integer scalar, got {count.dtype} {tuple(count.shape)}")
    return ids.astype(jnp.int32), count.reshape(()).astype(jnp.int32)


def _f32(a, name: str, shape: tuple[int, ...] | None = None) -> jax.Array:
    a = jnp.asarray(a)
    if a.dtype != jnp.float32:
        raise ValueError(f"{name} must be float32 (convert the weights once, not per call), got {a.dtype}")
    if shape is not None and tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
    return a


def _int8_matrix(values, layout: str) -> jax.Array:
    """``values`` as an int8 2-D array, whose axes ``layout`` names for the error message, e.g. "(out, in)"."""
    values = jnp.asarray(values)
    if values.dtype != jnp.int8 or values.ndim != 2:
        raise ValueError(f"values must be an int8 {layout} matrix, got {values.dtype} {tuple(values.shape)}")
    return values


def _scalar(value, name: str) -> jax.Array:
    """``value`` as a float32 scalar (a ValueError for anything with more than one entry)."""
    value = jnp.asarray(value, jnp.float32)
    if value.size != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
    return value.reshape(())


def _valid(ids: jax.Array, count: jax.Array, n: int) -> jax.Array:
    """Which list positions count: before ``count`` and an id in [0, n)."""
    k = ids.shape[0]
    return (jnp.arange(k) < jnp.clip(count, 0, k)) & (ids >= 0) & (ids < n)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown FFN kind {kind!r}; supported: {', '.join(KINDS)}")


def _biases(b_up, b_down, n: int, d: int) -> tuple[jax.Array | None, jax.Array | None]:
    """An FFN's optional up bias (n,) as float32 and down bias (d,), shapes checked."""
    b_up = None if b_up is None else _f32(b_up, "b_up", (n,))
    b_down = None if b_down is None else jnp.asarray(b_down)
    if b_down is not None and tuple(b_down.shape) != (d,):
        raise ValueError(f"b_down must have shape {(d,)}, got {tuple(b_down.shape)}")
    return b_up, b_down


def _check_ffn(rows, kind: str, b_up, b_down):
    _check_kind(kind)
    rows = _f32(rows, "rows")
    if rows.ndim != 3 or rows.shape[1] != (2 if kind in UNGATED_KINDS else 3):
        raise ValueError(f"rows must be (n, {2 if kind in UNGATED_KINDS else 3}, d) neuron-major bundles for kind "
                         f"{kind!r}, got shape {tuple(rows.shape)}")
    n, _, d = rows.shape
    b_up, b_down = _biases(b_up, b_down, n, d)
    return rows, b_up, b_down


@functools.partial(jax.jit, static_argnames=("kind",))
def _xla_activations(rows, b_up, x, ids, count, kind):
    n = rows.shape[0]
    valid = _valid(ids, count, n)
    safe = jnp.where(valid, ids, 0)
    proj = rows[safe, : rows.shape[1] - 1]  # (K, R-1, d)
    h = jnp.einsum("krd,td->tkr", proj, x, precision=jax.lax.Precision.HIGHEST)
    up = h[..., -1]
    if b_up is not None:
        up = up + b_up[safe]
    a = activate(kind, h[..., 0] if rows.shape[1] == 3 else None, up)
    return jnp.where(valid[None, :], a, 0.0)


@functools.partial(jax.jit, static_argnames=("slot",))
def _xla_rows_sum(m3, slot, w, ids, count):
    n = m3.shape[0]
    valid = _valid(ids, count, n)
    rows = m3[jnp.where(valid, ids, 0), slot]  # (K, d)
    return jnp.einsum("tk,kd->td", jnp.where(valid[None, :], w, 0.0), rows, precision=jax.lax.Precision.HIGHEST)


def sparse_ffn(rows, x, ids, count, *, kind: str, b_up=None, b_down=None, native: bool | None = None) -> jax.Array:
    """The sparse FFN of one layer over listed neurons, float32 (T, d) (or (d,) for a 1-D x):
    sum over the listed neurons i of act_i(x) * down_i (+ b_down when given, added once).

    rows: (n, R, d) float32 neuron-major bundles (jpinfer.sparse.neurons.NeuronFFN.rows): R = 3
    [gate, up, down], R = 2 [up, down] for kind relu; b_up (n,) float32 or None; ids/count: the list
    (module docstring). The native kernel fuses gate/up, activation and down four neurons a pass."""
    rows, b_up, b_down = _check_ffn(rows, kind, b_up, b_down)
    n, _, d = rows.shape
    x2, flat = _tokens(x, d)
    ids, count = _list(ids, count)
    if _use_native(native):
        empty = jnp.zeros((0,), jnp.float32) if b_up is None else b_up
        call = lambda xt: jax.ffi.ffi_call("jpinfer_sparse_ffn", jax.ShapeDtypeStruct(xt.shape, jnp.float32),
                                           vmap_method="sequential")(rows, empty, xt, ids, count,
                                                                     kind=np.int32(KINDS[kind]))
        y = _per_group(call, x2)
    else:
        a = _xla_activations(rows, b_up, x2, ids, count, kind)
        y = _xla_rows_sum(rows, rows.shape[1] - 1, a, ids, count)
    if b_down is not None:
        y = y + b_down.astype(jnp.float32)
    return y[0] if flat else y


def _check_int8_ffn(rows, scales, down_scales, kind: str, b_up, b_down):
    _check_kind(kind)
    rows = jnp.asarray(rows)
    R = 2 if kind in UNGATED_KINDS else 3
    if rows.dtype != jnp.int8 or rows.ndim != 3 or rows.shape[1] != R:
        raise ValueError(f"rows must be int8 (n, {R}, d) neuron-major bundles for kind {kind!r}, "
                         f"got {rows.dtype} {tuple(rows.shape)}")
    n, _, d = rows.shape
    scales = _f32(scales, "scales", (n, R - 1))
    down_scales = _f32(down_scales, "down_scales", (d,))
    b_up, b_down = _biases(b_up, b_down, n, d)
    return rows, scales, down_scales, b_up, b_down


@functools.partial(jax.jit, static_argnames=("kind",))
def xla_sparse_ffn_int8(rows, scales, down_scales, b_up, x, ids, count, kind, weights=None):
    """``sparse_ffn_int8`` in XLA ops (no b_down): the listed bundles gathered at once, the kernel's
    integers and scales (the full list: those of ``quant.int8.product`` on the dense matrices). The
    fallback here and the form ``sparse.op`` runs on accelerators. ``weights`` (T, K): as in
    ``sparse_ffn_int8``."""
    n, R, d = rows.shape
    if ids.shape[0] == 0:  # an empty list (quantize_tokens needs at least one activation)
        return jnp.zeros((x.shape[0], d), jnp.float32)
    valid = _valid(ids, count, n)
    safe = jnp.where(valid, ids, 0)
    picked = rows[safe]  # (K, R, d)
    q, token_scales = int8.quantize_tokens(x)
    acc = jnp.einsum("td,krd->tkr", q, picked[:, : R - 1], preferred_element_type=jnp.int32)
    h = acc.astype(jnp.float32) * (token_scales[:, None, None] * scales[safe][None])
    up = h[..., -1] if b_up is None else h[..., -1] + b_up[safe]
    a = jnp.where(valid[None, :], activate(kind, h[..., 0] if R == 3 else None, up), 0.0)
    return _xla_quantized_down(a if weights is None else a * weights, picked[:, R - 1], down_scales)


def _xla_quantized_down(a: jax.Array, down: jax.Array, down_scales: jax.Array) -> jax.Array:
    """The int8 sparse FFNs' down half: the listed activations a (T, K) quantized per token, times the listed
    int8 down slots (K, d) exactly in int32, scaled by the activation's and each output's scale."""
    qa, act_scales = int8.quantize_tokens(a)
    acc = jnp.einsum("tk,kd->td", qa, down, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * (act_scales[:, None] * down_scales[None, :])


def sparse_ffn_int8(rows, scales, down_scales, x, ids, count, *, kind: str, b_up=None, b_down=None, weights=None,
                    native: bool | None = None) -> jax.Array:
    """``sparse_ffn`` over int8 bundles (W8A8), float32 (T, d) (or (d,)).

    rows: (n, R, d) int8 bundles (``sparse.neurons.NeuronFFN`` of an int8 model: the gate/up slots rows of
    the dense ``w_gate_up`` values, the down slot a column of ``w_down``'s); scales: (n, R - 1) float32,
    each gate/up row's scale; down_scales: (d,) float32, ``w_down``'s scale per output. Arithmetic of
    ``quant.int8.product`` on the dense matrices restricted to the list: x quantized per token, gate/up
    h = exact int32 dot * (token scale * row scale) (+ b_up), float activations; the listed activations
    quantized per token (the peak of the dense activation vector with the unlisted neurons at 0), the
    listed down slots summed exactly in int32, y = acc * (activation scale * down scale) (+ b_down).
    With every neuron listed the integers are those of the dense int8 FFN. ``weights`` (T, K) (or (K,)), by list
    position, multiply the float activations before their quantization: a neuron's routing weight with experts,
    so the full list gives the dense int8 FFN's integers over the routed activations."""
    rows, scales, down_scales, b_up, b_down = _check_int8_ffn(rows, scales, down_scales, kind, b_up, b_down)
    xla = lambda *a: xla_sparse_ffn_int8(rows, scales, down_scales, *a[:-1], kind, a[-1])
    return _quantized_sparse_ffn("jpinfer_sparse_ffn_int8", (rows, scales, down_scales), xla, rows.shape[2], x, ids,
                                 count, kind, b_up, b_down, weights, native)


def _check_q4_ffn(gate_up, down, down_scales, kind: str, b_up, b_down):
    _check_kind(kind)
    if not isinstance(gate_up, Q4Bundles) or gate_up.kind not in q4.KINDS:
        raise ValueError("gate_up must be a quant.q4.Q4Bundles (the neurons' 4-bit gate/up records)")
    down = jnp.asarray(down)
    if down.dtype != jnp.int8 or down.ndim != 2:
        raise ValueError(f"down must be int8 (n, d) (a down column per neuron), got {down.dtype} {tuple(down.shape)}")
    n, d = down.shape
    P = 1 if kind in UNGATED_KINDS else 2
    if (gate_up.n, gate_up.slots, gate_up.inputs) != (n, P, d) or gate_up.records.dtype != jnp.uint8:
        rows = "up" if P == 1 else "gate and up"
        raise ValueError(f"gate_up must hold {n} records of {P} 4-bit rows of {d} (the {rows} rows of each neuron) "
                         f"for kind {kind!r}, got {gate_up.n} of {gate_up.slots} rows of {gate_up.inputs}")
    down_scales = _f32(down_scales, "down_scales", (d,))
    b_up, b_down = _biases(b_up, b_down, n, d)
    return down, down_scales, b_up, b_down


@functools.partial(jax.jit, static_argnames=("kind",))
def xla_sparse_ffn_q4(gate_up: Q4Bundles, down, down_scales, b_up, x, ids, count, kind, weights=None):
    """``sparse_ffn_q4`` in XLA ops (no b_down): the listed neurons' records taken at once and their 4-bit rows
    multiplied as ``quant.q4.product`` does (the dense 4-bit product's function), then the int8 down half of
    ``xla_sparse_ffn_int8``. The fallback here and the form ``sparse.op`` runs on accelerators."""
    n, d = down.shape
    if ids.shape[0] == 0:  # an empty list (quantize_tokens needs at least one activation)
        return jnp.zeros((x.shape[0], d), jnp.float32)
    valid = _valid(ids, count, n)
    safe = jnp.where(valid, ids, 0)
    gated = kind not in UNGATED_KINDS
    h = q4.product(gate_up.take(safe).matrix(), x)  # (T, P K): the gate rows, then the up rows
    k = ids.shape[0]
    up = h[:, -k:] if b_up is None else h[:, -k:] + b_up[safe]
    a = jnp.where(valid[None, :], activate(kind, h[:, :k] if gated else None, up), 0.0)
    return _xla_quantized_down(a if weights is None else a * weights, down[safe], down_scales)


def sparse_ffn_q4(gate_up: Q4Bundles, down, down_scales, x, ids, count, *, kind: str, b_up=None, b_down=None,
                  weights=None, native: bool | None = None) -> jax.Array:
    """``sparse_ffn`` of a 4-bit model's neurons, float32 (T, d) (or (d,)): their gate/up rows read from ``gate_up``,
    the model's 4-bit rows in records by neuron (``quant.q4.Q4Bundles``: gate and up rows, up only for an ungated
    kind), their down columns as int8 ``down`` (n, d) with ``w_down``'s scale per output ``down_scales`` (d,)
    (``sparse.neurons``). Gate/up are the dense 4-bit product's arithmetic on the listed rows (x quantized in
    blocks of 32, ``q4_matvec``), the rest ``sparse_ffn_int8``'s (activations quantized per token, exact int32
    down sums, scaled); ``weights`` likewise."""
    down, down_scales, b_up, b_down = _check_q4_ffn(gate_up, down, down_scales, kind, b_up, b_down)
    xla = lambda *a: xla_sparse_ffn_q4(gate_up, down, down_scales, *a[:-1], kind, a[-1])
    return _quantized_sparse_ffn(f"jpinfer_sparse_ffn_{gate_up.kind}", (gate_up.records, down, down_scales), xla,
                                 down.shape[1], x, ids, count, kind, b_up, b_down, weights, native)


def _quantized_sparse_ffn(target: str, operands: tuple, xla, d: int, x, ids, count, kind: str, b_up, b_down, weights,
                          native: bool | None) -> jax.Array:
    """The int8 and 4-bit sparse FFNs' shared part: x, the list and the weights checked; the native ``target``
    (``operands``, then b_up, x, ids, count, weights; groups of up to 8 tokens), else ``xla(b_up, x, ids, count,
    weights)``; b_down added."""
    x2, flat = _tokens(x, d)
    ids, count = _list(ids, count)
    if weights is not None:
        weights = jnp.broadcast_to(_f32(weights, "weights"), (x2.shape[0], ids.shape[0]))
    if _use_native(native):
        empty = jnp.zeros((0,), jnp.float32)
        call = lambda xt, *wt: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(xt.shape, jnp.float32),
                                                vmap_method="sequential")(
            *operands, empty if b_up is None else b_up, xt, ids, count, wt[0] if wt else empty,
            kind=np.int32(KINDS[kind]))
        y = _per_group(call, x2, *([] if weights is None else [weights]))
    else:
        y = xla(b_up, x2, ids, count, weights)
    if b_down is not None:
        y = y + b_down.astype(jnp.float32)
    return y[0] if flat else y


def sparse_activations(rows, x, ids, count, *, kind: str, b_up=None, native: bool | None = None) -> jax.Array:
    """The activations act_i(x) of the listed neurons, float32 (T, K) by list position (0 at padding
    positions and skipped ids): the first half of ``sparse_ffn``."""
    rows, b_up, _ = _check_ffn(rows, kind, b_up, None)
    n, _, d = rows.shape
    x2, flat = _tokens(x, d)
    ids, count = _list(ids, count)
    K = ids.shape[0]
    if _use_native(native):
        empty = jnp.zeros((0,), jnp.float32) if b_up is None else b_up
        call = lambda xt: jax.ffi.ffi_call("jpinfer_sparse_activations",
                                           jax.ShapeDtypeStruct((xt.shape[0], K), jnp.float32),
                                           vmap_method="sequential")(rows, empty, xt, ids, count,
                                                                     kind=np.int32(KINDS[kind]))
        a = _per_group(call, x2)
    else:
        a = _xla_activations(rows, b_up, x2, ids, count, kind)
    return a[0] if flat else a


def listed_rows_sum(matrix, weights, ids, count, *, slot: int | None = None, native: bool | None = None) -> jax.Array:
    """sum over list positions k of weights[t, k] * row ids[k], float32 (T, d) (or (d,)): the second half
    of ``sparse_ffn`` with ``matrix`` the (n, R, d) bundles and ``slot`` their down slot (default R - 1),
    or any (n, d) matrix (slot ignored). weights: (T, K) or (K,) by list position."""
    matrix = _f32(matrix, "matrix")
    if matrix.ndim == 2:
        matrix, slot = matrix[:, None, :], 0
    if matrix.ndim != 3:
        raise ValueError(f"matrix must be (n, d) or (n, R, d), got shape {tuple(matrix.shape)}")
    slot = matrix.shape[1] - 1 if slot is None else int(slot)
    if not 0 <= slot < matrix.shape[1]:
        raise ValueError(f"slot must lie in [0, {matrix.shape[1]}), got {slot}")
    ids, count = _list(ids, count)
    w2, flat = _tokens(weights, ids.shape[0], "weights")
    d = matrix.shape[2]
    if _use_native(native):
        result = lambda wt: jax.ShapeDtypeStruct((wt.shape[0], d), jnp.float32)
        call = lambda wt: jax.ffi.ffi_call("jpinfer_listed_rows_sum", result(wt), vmap_method="sequential")(
            matrix, wt, ids, count, slot=np.int32(slot))
        y = _per_group(call, w2)
    else:
        y = _xla_rows_sum(matrix, slot, w2, ids, count)
    return y[0] if flat else y


def threshold_rows_product(matrix, x, threshold, *, native: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(x' @ matrix, float32 (T, M); kept counts int32 (T,)) with x'[t, j] = x[t, j] where
    |x[t, j]| > threshold (strictly) and 0 elsewhere; rows no token keeps are never read.

    matrix (N, M) float32 row-major: the input-major gate/up matrix (d, R n) for input sparsity, or
    the neuron-major down matrix (n, d) with x the activations for activation sparsity
    (jpinfer.sparse.threshold_layout). A 1-D x gives (M,) and a scalar count."""
    matrix = _f32(matrix, "matrix")
    if matrix.ndim != 2:
        raise ValueError(f"matrix must be (N, M), got shape {tuple(matrix.shape)}")
    N, M = matrix.shape
    x2, flat = _tokens(x, N)
    thr = _scalar(threshold, "threshold")
    if _use_native(native):
        call = lambda xt: jax.ffi.ffi_call(
            "jpinfer_threshold_rows",
            (jax.ShapeDtypeStruct((xt.shape[0], M), jnp.float32), jax.ShapeDtypeStruct((xt.shape[0],), jnp.int32)),
            vmap_method="sequential")(matrix, xt, thr)
        y, counts = _per_group(call, x2)
    else:
        keep = jnp.abs(x2) > thr
        y = jnp.einsum("tn,nm->tm", jnp.where(keep, x2, 0.0), matrix, precision=jax.lax.Precision.HIGHEST)
        counts = keep.sum(-1, dtype=jnp.int32)
    return (y[0], counts[0]) if flat else (y, counts)


def threshold_rows_product_int8(values, scales, x, threshold, *, native: bool | None = None
                                ) -> tuple[jax.Array, jax.Array]:
    """``threshold_rows_product`` over an int8 matrix: (y float32 (T, M), kept counts int32 (T,)).

    values int8 (N, M) with one float32 scale per column (``quant.int8.Int8Matrix`` with scale_axis
    1: the input-major / neuron-major copies of the threshold layout). x is quantized per token whole
    (``quant.int8.quantize_tokens``), the entries with |x| > threshold (on the float x) keep their integers, the
    kept rows are summed exactly in int32, and y = acc * (token scale * column scale): the integers and
    formula of jpinfer.sparse.threshold_layout's int8 path for one token, and of its masked product for several
    (quantizing the masked x gives the same integers: its peak is x's when anything is kept)."""
    values = _int8_matrix(values, "(N, M)")
    N, M = values.shape
    scales = _f32(scales, "scales", (M,))
    x2, flat = _tokens(x, N)
    thr = _scalar(threshold, "threshold")
    if _use_native(native):
        result = lambda xt: (jax.ShapeDtypeStruct((xt.shape[0], M), jnp.float32),
                             jax.ShapeDtypeStruct((xt.shape[0],), jnp.int32))
        call = lambda xt: jax.ffi.ffi_call("jpinfer_threshold_rows_int8", result(xt), vmap_method="sequential")(
            values, scales, xt, thr)
        y, counts = _per_group(call, x2)
    else:
        keep = jnp.abs(x2) > thr
        q, token_scales = int8.quantize_tokens(x2)
        acc = int8.integer_product(jnp.where(keep, q, 0), Int8Matrix(values, scales, 1))
        y = acc.astype(jnp.float32) * (token_scales[:, None] * scales[None, :])
        counts = keep.sum(-1, dtype=jnp.int32)
    return (y[0], counts[0]) if flat else (y, counts)


# ---------------------------------------------------------------- neuron selection

def select_over(logits, cutoff, capacity: int, *, native: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(ids int32 (..., capacity), wanted int32 (...)) for logits float32 (..., n): per row, the first
    ``capacity`` indices i with logits[..., i] > cutoff (a scalar; a NaN is never over it), in increasing order,
    then zeros; and how many indices are over it. The predictor modes' compaction
    (``predictor.mlp.select_neurons``); its XLA form is ``jnp.nonzero`` with a static size."""
    logits = _f32(logits, "logits")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., n) with n >= 1, got shape {tuple(logits.shape)}")
    if int(capacity) < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    capacity, cut, lead = int(capacity), _scalar(cutoff, "cutoff"), logits.shape[:-1]
    if _use_native(native):
        return jax.ffi.ffi_call("jpinfer_select_over", (jax.ShapeDtypeStruct((*lead, capacity), jnp.int32),
                                                        jax.ShapeDtypeStruct(lead, jnp.int32)),
                                vmap_method="broadcast_all")(logits, cut)
    over = logits > cut
    first = lambda row: jnp.nonzero(row, size=capacity, fill_value=0)[0].astype(jnp.int32)
    ids = jax.vmap(first)(over.reshape(-1, over.shape[-1])).reshape(*lead, capacity)
    return ids, over.sum(-1, dtype=jnp.int32)


# ---------------------------------------------------------------- float32, a few tokens

def float_matvec(w, x, *, native: bool | None = None) -> jax.Array:
    """W @ x per token, float32 (T, out) (or (out,)) for w float32 (out, in) and 1-8 tokens x (T, in): each
    row read once for all tokens (batched decoding's products; ``models.transformer.linear`` picks it for
    2-8 tokens on the CPU). A token's result does not depend on the others (fixed-order sums). Its XLA form
    is the einsum."""
    w = _f32(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be an (out, in) matrix, got shape {tuple(w.shape)}")
    out, inp = w.shape
    x2, flat = _tokens(x, inp)
    if _use_native(native):
        call = lambda xt: jax.ffi.ffi_call("jpinfer_float_matvec", jax.ShapeDtypeStruct((xt.shape[0], out),
                                                                                        jnp.float32),
                                           vmap_method="sequential")(w, xt)
        y = _per_group(call, x2)
    else:
        y = jnp.einsum("ti,oi->to", x2, w, precision=jax.lax.Precision.HIGHEST)
    return y[0] if flat else y


# ---------------------------------------------------------------- int8 (W8A8)

def int8_matvec(values, scales, x, *, native: bool | None = None) -> jax.Array:
    """W8A8 product W @ x per token, float32 (T, out) (or (out,)): ``values`` int8 (out, in) with one
    float32 scale per row (``quant.int8.Int8Matrix`` with scale_axis 0); x quantized per token
    inside (``quant.int8.quantize_tokens``); exact int32 sums; y = acc * (token scale * row scale), the
    formula of ``quant.int8.product``. Values of -128 are allowed (the symmetric quantizer never makes them)."""
    values = _int8_matrix(values, "(out, in)")
    out, inp = values.shape
    scales = _f32(scales, "scales", (out,))
    x2, flat = _tokens(x, inp)
    if _use_native(native):
        call = lambda xt: jax.ffi.ffi_call("jpinfer_int8_matvec", jax.ShapeDtypeStruct((xt.shape[0], out), jnp.float32),
                                           vmap_method="sequential")(values, scales, xt)
        y = _per_group(call, x2)
    else:
        y = int8.product(x2, Int8Matrix(values, scales, 0))
    return y[0] if flat else y


# ---------------------------------------------------------------- 4-bit blocks (llama.cpp Q4_0 / Q4_1)

def q4_matvec(m: Q4Matrix, x, *, native: bool | None = None) -> jax.Array:
    """W @ x per token for a 4-bit matrix, float32 (T, out) (or (out,)). x is quantized to int8 in blocks
    of 32 (``quant.q4.quantize_blocks``, llama.cpp's Q8_0 pairing): y = sum over blocks of
    scale_w * scale_x * (exact int32 block sum) [+ min_w * scale_x * sum of the block's q for q4_1]."""
    q4.check(m)
    out, inp = m.shape
    x2, flat = _tokens(x, inp)
    if _use_native(native):
        mins = m.mins if m.kind == "q4_1" else jnp.zeros((0,), jnp.float16)
        result = lambda xt: jax.ShapeDtypeStruct((xt.shape[0], out), jnp.float32)
        call = lambda xt: jax.ffi.ffi_call(f"jpinfer_{m.kind}_matvec", result(xt), vmap_method="sequential")(
            m.packed, m.scales, mins, xt)
        y = _per_group(call, x2)
    else:
        y = q4.product(m, x2)
    return y[0] if flat else y


# ---------------------------------------------------------------- attention over a KV cache

def _attention_operands(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array) -> bool:
    """float32 q (B, T >= 1, H, hd) and caches of one shape (B, KV, S, hd), H a multiple of KV."""
    return (q.ndim == 4 and cache_k.ndim == 4 and cache_v.shape == cache_k.shape
            and q.dtype == cache_k.dtype == cache_v.dtype == jnp.float32 and q.shape[1] >= 1
            and q.shape[3] == cache_k.shape[3] and q.shape[0] == cache_k.shape[0]
            and q.shape[2] % cache_k.shape[1] == 0)


def cached_attention_fits(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array) -> bool:
    """Whether ``cached_attention`` takes these operands: float32 q (B, T <= 8, H, hd) and caches of one
    shape (B, KV, S, hd), hd a multiple of 8, H a multiple of KV."""
    return _attention_operands(q, cache_k, cache_v) and q.shape[1] <= MAX_TOKENS and q.shape[3] % 8 == 0


def prefill_attention_fits(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array) -> bool:
    """Whether ``prefill_attention`` takes these operands: float32 q (B, T, H, hd) and caches of one shape
    (B, KV, S, hd), hd a multiple of 16, H a multiple of KV."""
    return _attention_operands(q, cache_k, cache_v) and q.shape[3] % 16 == 0


def cached_attention(q, cache_k, cache_v, positions, *, window: int | None = None,
                     softcap: float | None = None) -> jax.Array:
    """Causal grouped-query attention of T new tokens over a KV cache, one native call that reads the
    cache in place: float32 (B, T, H, hd). q (B, T, H, hd) (rotary embedding applied); cache_k and
    cache_v (B, KV, S, hd) already holding the new tokens' keys and values; positions int32 (T,) shared by
    the batch, or (B, T) one row per sequence (batched decoding: a sequence's output then does not depend
    on the others'). Query head h reads kv head h // (H // KV); token t sees slots s <= positions[t] (and
    s > positions[t] - window with a window), softmax(q . k / sqrt(hd)) weighting the values (each score
    s first made softcap * tanh(s / softcap) with a softcap: Gemma 2's); a token that sees no slot gets
    zeros. Slots after the last position are never read.

    Native only (RuntimeError without the library): its XLA form is the model's own attention,
    ``ops.attention.cached_attention``, which calls this on the CPU."""
    _use_native(True)
    q, cache_k, cache_v = jnp.asarray(q), jnp.asarray(cache_k), jnp.asarray(cache_v)
    if not cached_attention_fits(q, cache_k, cache_v):
        raise ValueError(f"cached_attention takes float32 q (B, T <= {MAX_TOKENS}, H, hd) and caches (B, KV, S, hd), "
                         f"hd a multiple of 8 and H of KV; got q {q.dtype} {tuple(q.shape)}, caches "
                         f"{cache_k.dtype} {tuple(cache_k.shape)} and {cache_v.dtype} {tuple(cache_v.shape)}")
    return _attention_call("jpinfer_cached_attention", q, cache_k, cache_v, positions, (q.shape[1:2], q.shape[:2]),
                           window, softcap)


def prefill_attention(q, cache_k, cache_v, positions, *, window: int | None = None,
                      softcap: float | None = None) -> jax.Array:
    """``cached_attention`` for a prompt: any number T of new tokens at one position row (T,) shared by
    the batch, hd a multiple of 16. Computed in tiles of tokens against tiles of keys with a running
    softmax (csrc/prefill_attention.cc), never holding a (T, S) score matrix; a token's result does not
    depend on the other tokens of the call. Slots after the last position and before the first key tile
    a token sees are never read (inside a tile, slots a token does not see are read and weighted by zero).
    Native only (RuntimeError without the library); its XLA form is ``ops.attention.blocked_attention``."""
    _use_native(True)
    q, cache_k, cache_v = jnp.asarray(q), jnp.asarray(cache_k), jnp.asarray(cache_v)
    if not prefill_attention_fits(q, cache_k, cache_v):
        raise ValueError(f"prefill_attention takes float32 q (B, T, H, hd) and caches (B, KV, S, hd), hd a multiple "
                         f"of 16 and H of KV; got q {q.dtype} {tuple(q.shape)}, caches {cache_k.dtype} "
                         f"{tuple(cache_k.shape)} and {cache_v.dtype} {tuple(cache_v.shape)}")
    return _attention_call("jpinfer_prefill_attention", q, cache_k, cache_v, positions, (q.shape[1:2],), window,
                           softcap)


def _attention_call(target: str, q, cache_k, cache_v, positions, position_shapes, window, softcap) -> jax.Array:
    positions = jnp.asarray(positions)
    if positions.shape not in position_shapes or not jnp.issubdtype(positions.dtype, jnp.integer):
        shapes = " or ".join(str(tuple(shape)) for shape in position_shapes)
        raise ValueError(f"positions must be integers {shapes}, got {positions.dtype} {tuple(positions.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of slots or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q, cache_k, cache_v, positions.astype(jnp.int32), scale=np.float32(q.shape[3] ** -0.5),
                softcap=np.float32(softcap or 0.0), window=np.int64(window or 0))


__all__ = [
    "MAX_TOKENS", "KINDS", "sparse_ffn", "xla_sparse_ffn_int8", "sparse_ffn_int8", "xla_sparse_ffn_q4", "sparse_ffn_q4",
    "sparse_activations", "listed_rows_sum", "threshold_rows_product", "threshold_rows_product_int8", "select_over",
    "float_matvec", "int8_matvec", "q4_matvec", "cached_attention_fits", "prefill_attention_fits", "cached_attention",
    "prefill_attention",
]
