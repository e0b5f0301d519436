"""Chunked sparse FFN in plain XLA for the CPU: the listed-rows products' XLA form there (``ops.listed`` picks it
where the native kernels do not run, or for backend "xla" / "loop").

What XLA:CPU does fast and slow here (measured, see bench/results/kernels.md):
- one big gather of all listed rows spills the caches (10x worse than ideal); a gather
  of one chunk's gate/up rows (32 neurons, 1 MiB for a 7B layer) stays in L2, and one
  (rows, d) @ (d, T) product on it is cheap; as rows @ x, never x @ rows^T, which makes
  XLA transpose the gathered block first (5x slower);
- slicing and projecting each neuron separately costs the same for large rows and
  more for small ones (two ops per neuron);
- a loop fusion reads down rows straight from the weights with dynamic indices, many
  rows at once, at close to one core's streaming bandwidth, so the down rows are never
  copied;
- the loop runs on one core: splitting it into independent loops, or over two CPU
  devices with shard_map, gained nothing; sorting the ids gained nothing.
So a loop walks the list in chunks: gather the gate/up rows, project, activate, mask
padding, then one fused loop adds act_j * down_j of the chunk into the accumulator.
The loop stops after the chunk holding the last valid entry, so list padding costs
nothing. ``sparse_rows_product`` is the same loop without the gate/up part: a product
x @ M over listed rows of M only (input sparsity, where the list holds input dimensions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jpinfer.activations import activate

DEFAULT_CHUNK = 32  # neurons per loop trip
ROWS_CHUNK_BYTES = 128 * 1024  # what one trip of the row product reads, at most (``rows_chunk``)


def rows_chunk(row_bytes: int) -> int:
    """Rows per trip of ``sparse_rows_product``: the largest power of two up to 32 whose rows fit in
    ``ROWS_CHUNK_BYTES``, at least 8. Measured (30 chained layers, distinct weights, 2026-12-01):
    rows of 576 float32 (2.3 KB) ran fastest at 32 a trip (24: +5%, 16: +10-15%, 8: +25-30%);
    rows of 3072 (12 KB) at 8 (16: +5-10%, 32: +20-30%)."""
    chunk = 32
    while chunk > 8 and chunk * row_bytes > ROWS_CHUNK_BYTES:
        chunk //= 2
    return chunk


def _padded_chunks(ids: jax.Array, count, n: int, chunk: int) -> tuple[jax.Array, jax.Array, int, jax.Array]:
    """(ids clamped to [0, n) and padded to whole chunks, the count clamped to the list, chunk
    size, number of chunks holding valid entries: the loop's trip count)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    k = ids.shape[0]
    c = min(chunk, k)
    n_chunks = -(-k // c)
    ids = jnp.pad(jnp.clip(ids.astype(jnp.int32), 0, n - 1), (0, n_chunks * c - k))
    count = jnp.clip(jnp.asarray(count, jnp.int32), 0, k)
    return ids, count, c, (count + c - 1) // c


def _add_rows(acc: jax.Array, weights: jax.Array, rows: jax.Array, chunk_ids: jax.Array, slot: int | None
              ) -> jax.Array:
    """acc (T, m) + sum_j weights[:, j] * row j, in acc's dtype (float32, or int32 for int8 rows and
    weights: exact): one fused loop reading the rows straight from
    ``rows`` with dynamic indices, never copying them. Row j is ``rows[chunk_ids[j], slot]`` of
    (n, R, m) bundles, or ``rows[chunk_ids[j]]`` of an (n, m) matrix (slot None: reshaping it to
    (n, 1, m) made XLA copy the whole matrix into the loop, 4x the time of the dense product)."""
    m = rows.shape[-1]
    if slot is None:
        row = lambda j: jax.lax.dynamic_slice(rows, (chunk_ids[j], 0), (1, m))
    else:
        row = lambda j: jax.lax.dynamic_slice(rows, (chunk_ids[j], slot, 0), (1, 1, m))[0]
    return acc + sum(weights[:, j : j + 1] * row(j).astype(acc.dtype) for j in range(chunk_ids.shape[0]))


@functools.partial(jax.jit, static_argnames=("kind", "chunk"))
def sparse_ffn_chunked(
    rows: jax.Array,
    b_up: jax.Array | None,
    x: jax.Array,
    ids: jax.Array,
    count: jax.Array,
    *,
    kind: str,
    chunk: int = DEFAULT_CHUNK,
) -> jax.Array:
    """sum over the first ``count`` listed neurons of act_i(x) * down_i, float32 (T, d).

    rows: (n, R, d) neuron-major bundles; x: (T, d); ids: (K,) int32 row indices,
    entries at positions >= count are padding (any value). Valid ids must lie in
    [0, n): they are clamped, not checked, on the device.
    """
    n, n_rows, d = rows.shape
    ids, count, c, trips = _padded_chunks(ids, count, n, chunk)
    xw = x.astype(rows.dtype)
    n_proj = n_rows - 1  # gate and up rows (up only for kind relu)

    def body(i, acc):
        start = i * c
        chunk_ids = jax.lax.dynamic_slice(ids, (start,), (c,))
        # Gate/up rows of the chunk in one gather, projected by one (c*n_proj, d) @ (d, T)
        # matrix product: rows @ x, not x @ rows^T, the form XLA:CPU runs fastest.
        projected = rows.at[chunk_ids, :n_proj].get(mode="promise_in_bounds")
        h = jnp.einsum("crd,td->crt", projected, xw, preferred_element_type=jnp.float32).transpose(2, 0, 1)
        up = h[..., n_proj - 1]
        if b_up is not None:
            up = up + b_up[chunk_ids].astype(jnp.float32)
        act = activate(kind, h[..., 0] if n_proj == 2 else None, up)
        act = jnp.where(start + jnp.arange(c) < count, act, 0.0)  # (T, c)
        return _add_rows(acc, act, rows, chunk_ids, n_proj)  # the down rows

    return jax.lax.fori_loop(0, trips, body, jnp.zeros((x.shape[0], d), jnp.float32))


@functools.partial(jax.jit, static_argnames=("chunk",))
def sparse_rows_product(
    matrix: jax.Array, x: jax.Array, ids: jax.Array, count: jax.Array, *, chunk: int | None = None
) -> jax.Array:
    """x @ matrix over the first ``count`` listed rows only: sum_j x[:, ids[j]] * matrix[ids[j]],
    float32 (T, m), or the exact int32 sum when x and matrix are both integer (int8). matrix: (n, m),
    input-major (a row per input dimension); x: (T, n); ids and count as in ``sparse_ffn_chunked``;
    ``chunk`` rows per trip (default ``rows_chunk``)."""
    n, m = matrix.shape
    chunk = rows_chunk(m * matrix.dtype.itemsize) if chunk is None else chunk
    ids, count, c, trips = _padded_chunks(ids, count, n, chunk)
    integer = not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(matrix.dtype, jnp.floating))
    acc_dtype = jnp.int32 if integer else jnp.float32

    def body(i, acc):
        start = i * c
        chunk_ids = jax.lax.dynamic_slice(ids, (start,), (c,))
        weights = jnp.where(start + jnp.arange(c) < count, x[:, chunk_ids].astype(acc_dtype), 0)  # (T, c)
        return _add_rows(acc, weights, matrix, chunk_ids, None)

    return jax.lax.fori_loop(0, trips, body, jnp.zeros((x.shape[0], m), acc_dtype))
