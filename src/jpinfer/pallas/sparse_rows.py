"""The first sparse-row FFN kernel (variant ``rows``), kept as the baseline the GPU bench compares with.

Measured on an H200 (32 Llama-2-7B layers, bf16, one token): 3.7-3.9 ms at every sparsity against
3.1 ms dense, too few programs and each walks d sequentially; ``listed_ffn.py`` replaces it in the op.

Grid (token, block of the id list). A program loads ``block_k`` neuron ids, streams
their gate/up rows over d_model in ``block_d`` tiles against the token's input to get
the activations, masks list padding, then streams their down rows and writes its
partial output (block_d tiles). Partials of all blocks are summed outside the kernel,
which keeps the result deterministic (no atomics). Blocks wholly past the valid count
write zeros without touching the weights.

Written for the Triton lowering: every loaded or stored tile has a power-of-two size,
the grid has two dimensions (a vmap adds a third at most), and the full weight array
stays in global memory (refs without block specs), read only through gathered tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jpinfer.activations import activate
from jpinfer.pallas.triton import compiler_params, is_pow2, tile

MAX_BLOCK_D = 128


def _kernel(count_ref, ids_ref, x_ref, rows_ref, *refs, kind: str, has_b_up: bool, bk: int, bd: int):
    b_up_ref = refs[0] if has_b_up else None
    out_ref = refs[-1]
    t, j = pl.program_id(0), pl.program_id(1)
    n_rows, d = rows_ref.shape[1], rows_ref.shape[2]
    n_tiles = d // bd
    start = j * bk
    count = count_ref[0]

    @pl.when(start >= count)
    def _skip():
        def zero(k, carry):
            out_ref[t, j, pl.ds(pl.multiple_of(k * bd, bd), bd)] = jnp.zeros((bd,), out_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n_tiles, zero, 0)

    @pl.when(start < count)
    def _compute():
        idx = ids_ref[pl.ds(start, bk)]
        up_row, down_row = n_rows - 2, n_rows - 1

        def project(k, acc):
            off = pl.multiple_of(k * bd, bd)
            xt = x_ref[t, pl.ds(off, bd)].astype(jnp.float32)[None, :]
            new = [jnp.sum(rows_ref[idx, r, pl.ds(off, bd)].astype(jnp.float32) * xt, axis=1)
                   for r in range(n_rows - 1)]
            return tuple(a + b for a, b in zip(acc, new))

        zeros = tuple(jnp.zeros((bk,), jnp.float32) for _ in range(n_rows - 1))
        h = jax.lax.fori_loop(0, n_tiles, project, zeros)
        up = h[up_row]
        if has_b_up:
            up = up + b_up_ref[idx].astype(jnp.float32)
        act = activate(kind, h[0] if n_rows == 3 else None, up)
        valid = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) < count
        act = jnp.where(valid, act, 0.0)[:, None]

        def accumulate(k, carry):
            off = pl.multiple_of(k * bd, bd)
            down = rows_ref[idx, down_row, pl.ds(off, bd)].astype(jnp.float32)
            out_ref[t, j, pl.ds(off, bd)] = jnp.sum(act * down, axis=0)
            return carry

        jax.lax.fori_loop(0, n_tiles, accumulate, 0)


@functools.partial(jax.jit, static_argnames=("kind", "block_k", "interpret"))
def sparse_rows_ffn(
    rows: jax.Array,
    b_up: jax.Array | None,
    x: jax.Array,
    ids: jax.Array,
    count: jax.Array,
    *,
    kind: str,
    block_k: int = 32,
    interpret: bool = False,
) -> jax.Array:
    """sum over the first ``count`` listed neurons of act_i(x) * down_i, float32 (T, d).

    rows: (n, R, d) neuron-major bundles; x: (T, d); ids: (K,) int32 row indices, of
    which entries at positions >= count are padding (any value). Valid ids must lie in
    [0, n): they are clamped, not checked, on the device.
    """
    n, n_rows, d = rows.shape
    if not is_pow2(block_k):
        raise ValueError(f"block_k must be a power of two (Triton), got {block_k}")
    k = ids.shape[0]
    n_blocks = -(-k // block_k)
    ids = jnp.clip(ids.astype(jnp.int32), 0, n - 1)
    ids = jnp.pad(ids, (0, n_blocks * block_k - k))
    count = jnp.clip(jnp.asarray(count, jnp.int32), 0, k).reshape(1)
    bd = tile(d, MAX_BLOCK_D)
    has_b_up = b_up is not None
    operands = (count, ids, x, rows) + ((b_up,) if has_b_up else ())
    kernel = functools.partial(_kernel, kind=kind, has_b_up=has_b_up, bk=block_k, bd=bd)
    partial = pl.pallas_call(
        kernel,
        grid=(x.shape[0], n_blocks),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n_blocks, d), jnp.float32),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(*operands)
    return partial.sum(axis=1)

