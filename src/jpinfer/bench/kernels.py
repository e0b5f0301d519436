"""Sparse FFN op against dense FFNs, side by side, at several sparsities.

For each layer shape, in one process and in alternating rounds (so machine noise hits
all alike): the decoder's dense FFN (``transformer.ffn_dense``, x @ W), the fastest dense
form found here (W^T @ x on transposed copies), the sparse FFN as measured before this
op existed (chunked ``lax.scan`` of gathers), and ``sparse_ffn`` over random lists of
(1 - s) * d_ff neurons. Efficiency is speedup * (1 - s): 1.0 means the sparse op moves
its bytes as fast as the dense one. The byte columns show where the time goes: the rate
each op reached and the sparse op's share of the machine's measured read bandwidth.
``--primitives`` times the two halves of the sparse op separately.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.sparse import neurons
from jpinfer.config import ModelConfig
from jpinfer.sparse.cpu_backend import huge_page_array, huge_page_ffn
from jpinfer.sparse.cpu_backend.chunked import DEFAULT_CHUNK
from jpinfer.models import params, transformer
from jpinfer.sparse.op import BACKENDS, sparse_ffn


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    d_ff: int
    kind: str


SHAPES = {
    "7b": Shape("7B (Llama-2)", 4096, 11008, "swiglu"),
    "smollm2": Shape("SmolLM2-135M", 576, 1536, "swiglu"),
}
SPARSITIES = (0.5, 0.8, 0.9, 0.95)


CACHE_FLUSH_BYTES = 256 << 20  # cycle through this much weight memory: far above any L3
N_LISTS = 8


def _times(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        out.append(time.perf_counter() - t0)
    return out


def _cycle(f, arg_sets):
    """A no-argument call that runs f on the next argument set each time (cold caches)."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return f(*arg_sets[state["i"] % len(arg_sets)])

    for _ in range(len(arg_sets)):  # compile and touch every set once
        jax.block_until_ready(call())
    return call


def _interleaved(calls, rounds: int) -> list[float]:
    """Fastest seconds of each call, measured in alternating rounds of 3 calls each.

    The minimum, not the median: on a machine shared with other jobs the median mostly
    measures their load, while the fastest of many cold-cache calls is the op's own speed.
    """
    times = [[] for _ in calls]
    for _ in range(rounds):
        for call, t in zip(calls, times):
            t += _times(call, 3)
    return [float(np.min(t)) for t in times]


def _layer(shape: Shape, rng: np.random.Generator, place) -> params.Layer:
    w = lambda *s: place(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[0]))
    empty = jnp.zeros((1, 1), jnp.float32)
    return params.Layer(
        attn_norm=None, wq=empty, wk=empty, wv=empty, wo=empty, ffn_norm=None,
        w_gate=w(shape.d_model, shape.d_ff), w_up=w(shape.d_model, shape.d_ff), w_down=w(shape.d_ff, shape.d_model),
    )


def _transposed(layer: params.Layer, place) -> tuple:
    """(w_gate^T, w_up^T, w_down^T): the dense FFN as three row-major matrix-vector products."""
    t = lambda w: None if w is None else place(np.ascontiguousarray(np.asarray(w).T))
    return t(layer.w_gate), t(layer.w_up), t(layer.w_down)


def _dense_transposed(kind: str):
    """The fastest dense FFN found on XLA:CPU: 1.5-1.8x faster than x @ W for a 7B layer."""

    def f(w, x):
        gate_t, up_t, down_t = w
        return down_t @ neurons.activate(kind, None if gate_t is None else gate_t @ x, up_t @ x)

    return jax.jit(f)


def _scan_before(kind: str, k: int, chunk: int = 64):
    """The sparse FFN as measured before this op existed (shared/tools/ffn_gather_probe.py):
    ``lax.scan`` over chunks of 64 ids, gathering gate, up and down rows of separate
    neuron-major matrices, then dots."""

    def f(w, x, ids):
        gate_t, up_t, down = w

        def body(acc, chunk_ids):
            up = jnp.take(up_t, chunk_ids, axis=0) @ x
            gate = None if gate_t is None else jnp.take(gate_t, chunk_ids, axis=0) @ x
            return acc + neurons.activate(kind, gate, up) @ jnp.take(down, chunk_ids, axis=0), None

        padded = jnp.resize(ids, -(-k // chunk) * chunk)  # wraps around: times ceil(k / 64) full chunks
        return jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), padded.reshape(-1, chunk))[0]

    return jax.jit(f)


def bench_shape(
    shape: Shape, sparsities, backend: str, rounds: int, bandwidth: float, seed: int, huge_pages: bool
) -> list[dict]:
    """Dense vs sparse per sparsity. Calls cycle through copies of the layer (and, for the
    sparse op, through different lists), so neither op is served from a warm cache,
    as in a real decoder where every layer's weights are evicted before the next token.
    With ``huge_pages`` every variant's weights live in huge pages, else in XLA's buffers."""
    place = huge_page_array if huge_pages else jnp.asarray
    cfg = ModelConfig(
        vocab_size=8, d_model=shape.d_model, n_layers=1, n_heads=1, n_kv_heads=1,
        head_dim=8, d_ff=shape.d_ff, ffn_kind=shape.kind,
    )
    rng = np.random.default_rng(seed)
    dense_bytes = (2 if shape.kind == "relu" else 3) * shape.d_model * shape.d_ff * 4
    copies = max(1, -(-CACHE_FLUSH_BYTES // dense_bytes))
    layers = [_layer(shape, rng, place) for _ in range(copies)]
    ffns = [neurons.from_layer(layer, shape.kind) for layer in layers]
    ffns = [huge_page_ffn(f) for f in ffns] if huge_pages else ffns
    x = jnp.asarray(rng.standard_normal(shape.d_model, dtype=np.float32))
    dense = _cycle(jax.jit(lambda layer, x: transformer.ffn_dense(layer, x, cfg)), [(layer, x) for layer in layers])
    transposed = [_transposed(layer, place) for layer in layers]
    best = _cycle(_dense_transposed(shape.kind), [(w, x) for w in transposed])
    row_bytes = ffns[0].rows.shape[1] * shape.d_model * 4
    rows = []
    for s in sparsities:
        k = int(round(shape.d_ff * (1 - s)))
        lists = [jnp.asarray(rng.permutation(shape.d_ff)[:k].astype(np.int32)) for _ in range(N_LISTS)]  # random order, as top-k gives
        op = jax.jit(lambda ffn, x, ids: sparse_ffn(ffn, x, ids, k, backend=backend))
        n_sets = max(copies, N_LISTS)
        sparse = _cycle(op, [(ffns[i % copies], x, lists[i % N_LISTS]) for i in range(n_sets)])
        before = _cycle(
            _scan_before(shape.kind, k),
            [((gate_t, up_t, layers[i % copies].w_down), x, lists[i % N_LISTS])
             for i, (gate_t, up_t, _) in ((i, transposed[i % copies]) for i in range(n_sets))],
        )
        t_dense, t_best, t_before, t_sparse = _interleaved([dense, best, before, sparse], rounds)
        speedup = t_dense / t_sparse
        rows.append(dict(
            shape=shape.name, s=s, k=k, dense_ms=t_dense * 1e3, best_ms=t_best * 1e3, sparse_ms=t_sparse * 1e3,
            before_ms=t_before * 1e3, efficiency_before=t_best / t_before * (1 - s),
            speedup=speedup, efficiency=speedup * (1 - s), efficiency_best=t_best / t_sparse * (1 - s),
            dense_gbs=dense_bytes / t_dense / 1e9, best_gbs=dense_bytes / t_best / 1e9,
            sparse_mb=k * row_bytes / 1e6, sparse_gbs=k * row_bytes / t_sparse / 1e9,
            sparse_bw_share=k * row_bytes / t_sparse / bandwidth,
        ))
    return rows


def _chunk_loop(piece, k: int, chunk: int, out_shape):
    """jit(f(rows, x, ids)): sum of piece(rows, x, chunk_ids) over the list's chunks."""

    def f(rows, x, ids):
        def body(i, acc):
            return acc + piece(rows, x, jax.lax.dynamic_slice(ids, (i * chunk,), (chunk,)))

        return jax.lax.fori_loop(0, k // chunk, body, jnp.zeros(out_shape, jnp.float32))

    return jax.jit(f)


def primitive_rates(shape: Shape, s: float, rounds: int, seed: int, huge_pages: bool) -> list[tuple[str, float, float]]:
    """Where the sparse op's time goes: its two halves, and the alternative for the first.

    Each primitive runs over the same chunks of a (1 - s) list on cold caches; returns
    (name, ms, bytes read).
    """
    rng = np.random.default_rng(seed)
    ffn = neurons.from_layer(_layer(shape, rng, jnp.asarray), shape.kind)
    ffn = huge_page_ffn(ffn) if huge_pages else ffn
    d, chunk = shape.d_model, DEFAULT_CHUNK
    k = int(round(shape.d_ff * (1 - s))) // chunk * chunk
    x = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
    lists = [jnp.asarray(rng.permutation(shape.d_ff)[:k].astype(np.int32)) for _ in range(N_LISTS)]
    ds = lambda rows, i, row, size: jax.lax.dynamic_slice(rows, (i, row, 0), (1, size, d))[0]
    pieces = {
        "gate/up: gather chunk + one matrix product (the op)": (
            lambda rows, x, ids: jnp.einsum("crd,d->cr", rows.at[ids, :2].get(mode="promise_in_bounds"), x),
            (chunk, 2), 2),
        "gate/up: dynamic_slice + dot per neuron (alternative)": (
            lambda rows, x, ids: jnp.stack([jnp.einsum("rd,d->r", ds(rows, ids[j], 0, 2), x) for j in range(chunk)]),
            (chunk, 2), 2),
        "down: one fused multiply-add loop per chunk (the op)": (
            lambda rows, x, ids: sum(x[j] * ds(rows, ids[j], 2, 1)[0] for j in range(chunk)), (d,), 1),
    }
    out = []
    for name, (piece, out_shape, n_rows) in pieces.items():
        call = _cycle(_chunk_loop(piece, k, chunk, out_shape), [(ffn.rows, x, ids) for ids in lists])
        t = float(np.min(_times(call, 3 * rounds)))
        out.append((name, t * 1e3, k * n_rows * d * 4))
    op = jax.jit(lambda ffn, x, ids: sparse_ffn(ffn, x, ids, k, backend="xla"))
    t = float(np.min(_times(_cycle(op, [(ffn, x, ids) for ids in lists]), 3 * rounds)))
    out.append(("whole sparse op", t * 1e3, k * 3 * d * 4))
    return out


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jpinfer.bench --kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["7b", "smollm2"])
    ap.add_argument("--sparsity", nargs="+", type=float, default=list(SPARSITIES))
    ap.add_argument("--backend", choices=BACKENDS, default="auto")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of 3 calls per op (fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--primitives", action="store_true", help="also time the op's halves (7B layer, s=0.9)")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="keep weights in XLA's own buffers (4 KiB pages) instead of huge pages")
    args = ap.parse_args(argv)
    bad = [s for s in args.sparsity if not 0 <= s < 1]
    if bad:
        ap.error(f"--sparsity values must lie in [0, 1), got {bad}")

    pages = "huge pages" if args.huge_pages else "4 KiB pages"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; backend={args.backend}; weights in {pages}; "
          f"before: {_load()}")
    from jpinfer.bench.machine import matvec_read_bandwidth

    bandwidth = matvec_read_bandwidth()
    print(f"measured read bandwidth (512 MiB float32 matvec, best of 5): {bandwidth / 1e9:.1f} GB/s")
    results = []
    for key in args.shapes:
        results += bench_shape(
            SHAPES[key], args.sparsity, args.backend, args.rounds, bandwidth, args.seed, args.huge_pages)
    head = f"{'layer':<16} {'s':>4} {'K':>5} {'dense ms':>8} {'best ms':>7} {'before ms':>9} {'sparse ms':>9} " \
           f"{'speedup':>7} {'effic.':>6} {'eff/best':>8} {'before':>6} {'sparse MB':>9} " \
           f"{'GB/s: dense':>11} {'best':>5} {'sparse':>6} {'sparse/BW':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['shape']:<16} {r['s']:>4.2f} {r['k']:>5} {r['dense_ms']:>8.2f} {r['best_ms']:>7.2f} "
              f"{r['before_ms']:>9.2f} {r['sparse_ms']:>9.3f} {r['speedup']:>7.2f} {r['efficiency']:>6.2f} "
              f"{r['efficiency_best']:>8.2f} {r['efficiency_before']:>6.2f} {r['sparse_mb']:>9.1f} "
              f"{r['dense_gbs']:>11.1f} {r['best_gbs']:>5.1f} {r['sparse_gbs']:>6.1f} {r['sparse_bw_share']:>9.0%}")
    print("dense: the decoder's ffn_dense (x @ W); best: the same FFN as W^T @ x on transposed copies;\n"
          "before: chunked lax.scan of gathers (the op measured before this issue, 64-neuron chunks);\n"
          "effic. = speedup over dense x (1 - s); eff/best and before: the same for sparse and before, against best")
    if args.primitives:
        print(f"\nwhere the sparse op's time goes (7B layer, s=0.9, chunks of {DEFAULT_CHUNK}, cold caches, fastest):")
        for name, ms, n_bytes in primitive_rates(SHAPES["7b"], 0.9, args.rounds, args.seed, args.huge_pages):
            print(f"  {name:<54} {ms:>7.2f} ms  {n_bytes / 1e6:>6.1f} MB  {n_bytes / ms / 1e6:>5.1f} GB/s")
    print(f"after: {_load()}")


if __name__ == "__main__":
    main()
