"""Listed-neuron FFN kernels that read only the listed neurons' bytes, with every SM busy.

The first kernel (``sparse_rows.py``: one program per token and block of 32 ids, d walked in
128-wide tiles) ran at the same 3.7-3.9 ms for 32 Llama-2-7B layers at every sparsity on an
H200, slower than the dense FFN (3.1 ms): at 90% sparsity its grid has ~34 programs for 132 SMs,
and each program's work is sequential. A two-phase prototype with small neuron blocks and wide
tiles reached 3.5x over dense at 90% (efficiency 0.35) and floored at ~28 us per layer: launches
and glue, not bytes (docs/architecture.md, "GPU kernels"). The kernels here follow that shape and cut the glue:

- ``split``: phase 1, grid over blocks of ``block_neurons`` (4) listed neurons: a program streams
  its neurons' gate/up rows over d in ``block_d`` (1024-wide) tiles and writes the activations of
  every token (list padding -> 0). Phase 2, grid (d tiles of ``block_d_down``) x (blocks of
  ``block_neurons_down`` neurons): a program multiplies one tile of down rows by the activations
  and writes a partial; XLA sums the partials. Deterministic. Three launches per layer.
- ``split_atomic``: phase 2 adds its partial into the output with fp32 atomics (no reduction pass;
  Deja Vu measured atomics faster than a deterministic reduction), the output zeroed by XLA.
- ``fused``: one kernel: a program computes its block's activations, then streams the same
  neurons' down rows and atomically adds act * down into the output (one pass over the list).

Atomic variants sum in an order the hardware picks, so a GPU result may differ from run to run by
float32 rounding (fp32 accumulation of bf16 products: ~1e-7 relative).

All read ids and the valid count inside the kernel (ids clamped there, no XLA op before the
call); the list is padded only when its capacity is not a multiple of the blocks (static).
Tokens (a batch of up to ``MAX_TOKENS`` sharing one list, e.g. the union of their lists) are
looped inside each program, so weights are read once per call, not once per token; larger
batches run in groups of ``MAX_TOKENS``. Written for the Triton lowering (power-of-two tiles,
at most 2 grid dimensions, weights left in global memory and read as gathered tiles) and
tested in interpret mode on the CPU (tests/test_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jpinfer.activations import activate
from jpinfer.pallas.triton import atomic_add, compiler_params, is_pow2, tile

VARIANTS: tuple[str, ...] = ("split", "split_atomic", "fused")
MAX_TOKENS = 8  # tokens per call: unrolled in every program (registers and code size grow with it)
BLOCK_NEURONS, BLOCK_D = 4, 1024  # gate/up phase: the prototype's best on the H200 (bk=4, bd=1024)
BLOCK_NEURONS_DOWN, BLOCK_D_DOWN = 32, 256  # down phase (bk2=32, bd2=256)


def _block(ids_ref, count_ref, start: jax.Array, size: int, n: int, listed: int):
    """(clamped ids of the block, valid mask of the block, whether any is valid); ``listed`` is the
    list's length before padding (a count over it means the whole list)."""
    count = jnp.minimum(count_ref[0], listed)
    idx = jnp.clip(ids_ref[pl.ds(start, size)], 0, n - 1)
    valid = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0) < count
    return idx, valid, start < count


def _activations(x_ref, rows_ref, b_up_ref, idx, valid, *, kind: str, bd: int) -> list[jax.Array]:
    """Per token, the (bk,) activations of the neurons ``idx`` (0 where not ``valid``), float32."""
    n_tokens, (n_rows, d) = x_ref.shape[0], rows_ref.shape[1:]
    n_in = n_rows - 1  # gate and up, or up alone

    def body(k, acc):
        off = pl.multiple_of(k * bd, bd)
        w = [rows_ref[idx, r, pl.ds(off, bd)].astype(jnp.float32) for r in range(n_in)]
        out = []
        for t in range(n_tokens):
            xt = x_ref[t, pl.ds(off, bd)].astype(jnp.float32)[None, :]
            out += [acc[t * n_in + r] + jnp.sum(w[r] * xt, axis=1) for r in range(n_in)]
        return tuple(out)

    zeros = tuple(jnp.zeros(idx.shape, jnp.float32) for _ in range(n_tokens * n_in))
    h = jax.lax.fori_loop(0, d // bd, body, zeros)
    acts = []
    for t in range(n_tokens):
        up = h[t * n_in + n_in - 1]
        if b_up_ref is not None:
            up = up + b_up_ref[idx].astype(jnp.float32)
        acts.append(jnp.where(valid, activate(kind, h[t * n_in] if n_in == 2 else None, up), 0.0))
    return acts


def _activation_kernel(count_ref, ids_ref, x_ref, rows_ref, *refs, kind, has_b_up, bk, bd, listed):
    """Phase 1 of ``split``: act[t, block] for one block of listed neurons."""
    b_up_ref, act_ref = (refs[0] if has_b_up else None), refs[-1]
    start = pl.program_id(0) * bk
    idx, valid, any_valid = _block(ids_ref, count_ref, start, bk, rows_ref.shape[0], listed)

    @pl.when(jnp.logical_not(any_valid))
    def _skip():
        for t in range(x_ref.shape[0]):
            act_ref[t, pl.ds(start, bk)] = jnp.zeros((bk,), jnp.float32)

    @pl.when(any_valid)
    def _compute():
        for t, a in enumerate(_activations(x_ref, rows_ref, b_up_ref, idx, valid, kind=kind, bd=bd)):
            act_ref[t, pl.ds(start, bk)] = a


def _down_kernel(count_ref, ids_ref, act_ref, rows_ref, *refs, bk, bd, listed, atomic):
    """Phase 2 of ``split``: one (bk, bd) tile of down rows times the activations."""
    out_ref = refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)
    start, off = j * bk, pl.multiple_of(i * bd, bd)
    idx, _, any_valid = _block(ids_ref, count_ref, start, bk, rows_ref.shape[0], listed)
    n_tokens = act_ref.shape[0]

    if not atomic:  # every partial is summed: blocks past the list write zeros

        @pl.when(jnp.logical_not(any_valid))
        def _skip():
            for t in range(n_tokens):
                out_ref[j, t, pl.ds(off, bd)] = jnp.zeros((bd,), jnp.float32)

    @pl.when(any_valid)
    def _compute():
        down = rows_ref[idx, rows_ref.shape[1] - 1, pl.ds(off, bd)].astype(jnp.float32)
        for t in range(n_tokens):
            part = jnp.sum(act_ref[t, pl.ds(start, bk)][:, None] * down, axis=0)  # padding: act 0
            if atomic:
                atomic_add(out_ref, (jnp.int32(t), pl.ds(off, bd)), part)
            else:
                out_ref[j, t, pl.ds(off, bd)] = part


def _fused_kernel(count_ref, ids_ref, x_ref, rows_ref, *refs, kind, has_b_up, bk, bd, listed):
    """``fused``: activations of one block, then act * down added atomically into the output."""
    b_up_ref, out_ref = (refs[0] if has_b_up else None), refs[-1]
    start = pl.program_id(0) * bk
    idx, valid, any_valid = _block(ids_ref, count_ref, start, bk, rows_ref.shape[0], listed)
    down_row, d = rows_ref.shape[1] - 1, rows_ref.shape[2]

    @pl.when(any_valid)
    def _compute():
        acts = [a[:, None] for a in _activations(x_ref, rows_ref, b_up_ref, idx, valid, kind=kind, bd=bd)]

        def body(k, carry):
            off = pl.multiple_of(k * bd, bd)
            down = rows_ref[idx, down_row, pl.ds(off, bd)].astype(jnp.float32)
            for t, a in enumerate(acts):
                atomic_add(out_ref, (jnp.int32(t), pl.ds(off, bd)), jnp.sum(a * down, axis=0))
            return carry

        jax.lax.fori_loop(0, d // bd, body, 0)


def _group(rows, b_up, x, ids, count, *, kind, variant, interpret, blocks, listed):
    """One call for up to MAX_TOKENS tokens; ids already padded to a multiple of every block."""
    (bk, bd, bk2, bd2), capacity = blocks, ids.shape[0]
    n_tokens, d = x.shape
    has_b_up = b_up is not None
    head = (count, ids)
    weights = (rows,) + ((b_up,) if has_b_up else ())
    call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=compiler_params(interpret))
    if variant == "fused":
        kernel = functools.partial(_fused_kernel, kind=kind, has_b_up=has_b_up, bk=bk, bd=bd, listed=listed)
        zeros = jnp.zeros((n_tokens, d), jnp.float32)
        operands = head + (x,) + weights + (zeros,)
        return call(kernel, grid=(capacity // bk,), out_shape=jax.ShapeDtypeStruct((n_tokens, d), jnp.float32),
                    input_output_aliases={len(operands) - 1: 0})(*operands)
    kernel = functools.partial(_activation_kernel, kind=kind, has_b_up=has_b_up, bk=bk, bd=bd, listed=listed)
    act = call(kernel, grid=(capacity // bk,),
               out_shape=jax.ShapeDtypeStruct((n_tokens, capacity), jnp.float32))(*head, x, *weights)
    grid = (d // bd2, capacity // bk2)
    atomic = variant == "split_atomic"
    kernel = functools.partial(_down_kernel, bk=bk2, bd=bd2, listed=listed, atomic=atomic)
    if atomic:
        zeros = jnp.zeros((n_tokens, d), jnp.float32)
        return call(kernel, grid=grid, out_shape=jax.ShapeDtypeStruct((n_tokens, d), jnp.float32),
                    input_output_aliases={4: 0})(*head, act, rows, zeros)
    partial = call(kernel, grid=grid,
                   out_shape=jax.ShapeDtypeStruct((grid[1], n_tokens, d), jnp.float32))(*head, act, rows)
    return partial.sum(axis=0)


@functools.partial(
    jax.jit,
    static_argnames=("kind", "variant", "interpret", "block_neurons", "block_d", "block_neurons_down", "block_d_down"),
)
def listed_ffn(
    rows: jax.Array,
    b_up: jax.Array | None,
    x: jax.Array,
    ids: jax.Array,
    count: jax.Array,
    *,
    kind: str,
    variant: str = "split",
    interpret: bool = False,
    block_neurons: int = BLOCK_NEURONS,
    block_d: int = BLOCK_D,
    block_neurons_down: int = BLOCK_NEURONS_DOWN,
    block_d_down: int = BLOCK_D_DOWN,
) -> jax.Array:
    """sum over the first ``count`` listed neurons of act_i(x) * down_i, float32 (T, d).

    rows: (n, R, d) neuron-major bundles; b_up: (n,) or None; x: (T, d); ids: (K,) int32 row
    indices, entries at positions >= count are padding (any value); valid ids must lie in [0, n)
    (clamped, not checked). Block sizes are powers of two; the d tiles are capped at the largest
    power of two dividing d.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    sizes = (block_neurons, block_d, block_neurons_down, block_d_down)
    if not all(is_pow2(s) for s in sizes):
        raise ValueError(f"block sizes must be powers of two (Triton), got {sizes}")
    n, _, d = rows.shape
    blocks = (block_neurons, tile(d, block_d), block_neurons_down, tile(d, block_d_down))
    multiple = block_neurons if variant == "fused" else max(block_neurons, block_neurons_down)
    k = ids.shape[0]
    ids = ids.astype(jnp.int32)
    if k % multiple:
        ids = jnp.pad(ids, (0, -k % multiple))
    count = jnp.asarray(count, jnp.int32).reshape(1)
    groups = [
        _group(rows, b_up, x[i : i + MAX_TOKENS], ids, count, kind=kind, variant=variant, interpret=interpret,
               blocks=blocks, listed=k)
        for i in range(0, x.shape[0], MAX_TOKENS)
    ]
    return groups[0] if len(groups) == 1 else jnp.concatenate(groups)
