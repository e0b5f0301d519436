"""jpinfer bench-kernels: the sparse FFN op against the dense FFN, side by side, at several sparsities.

For each layer shape, in one process and in alternating rounds (so machine noise hits
all alike): the decoder's dense FFN (``transformer.ffn_dense``: W @ x over the fused
(out, in) gate|up matrix and the down matrix, the fastest dense form measured on
XLA:CPU), the first sparse FFN measured here (chunked ``lax.scan`` of gathers from
separate neuron-major matrices), and ``sparse_ffn`` over random lists of (1 - s) * d_ff
neurons. Efficiency is speedup * (1 - s): 1.0 means the sparse op moves
its bytes as fast as the dense one. The byte columns show where the time goes: the rate
each op reached and the sparse op's share of the machine's measured read bandwidth.
``--primitives`` times the two halves of the sparse op separately.

On a GPU (or with ``--chain``) it prints the accelerator table instead (``chain_kernels``):
chains of ``--layers`` layers in one jit, dense against every Pallas kernel variant and XLA's
gather, in ``--dtype``; ``--chain`` on the CPU runs the kernels in interpret mode (a check of the
script, not a timing).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.bench.protocol import fastest, load_average, machine, machine_line
from jpinfer.config import UNGATED_KINDS, ModelConfig
from jpinfer.models import params, transformer
from jpinfer.ops.chunked import DEFAULT_CHUNK
from jpinfer.sparse import neurons
from jpinfer.sparse.cpu_backend import huge_page_array, huge_page_ffn
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
    "tiny": Shape("tiny", 256, 688, "swiglu"),
}
SPARSITIES = (0.5, 0.8, 0.9, 0.95)


CACHE_FLUSH_BYTES = 256 << 20  # cycle through this much weight memory: far above any L3
N_LISTS = 8


def _cycle(f, arg_sets):
    """A no-argument call that runs f on the next argument set each time (cold caches)."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return f(*arg_sets[state["i"] % len(arg_sets)])

    for _ in range(len(arg_sets)):  # compile and touch every set once
        jax.block_until_ready(call())
    return call


def _layer(shape: Shape, rng: np.random.Generator, place) -> params.Layer:
    """A random FFN in the decoder's layout (fused gate|up rows, down (d, d_ff)); no attention."""
    w = lambda *s: place(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[1]))
    n_in = 1 if shape.kind in UNGATED_KINDS else 2
    empty = jnp.zeros((1, 1), jnp.float32)
    return params.Layer(
        attn_norm=None, w_qkv=empty, wo=empty, ffn_norm=None,
        w_gate_up=w(n_in * shape.d_ff, shape.d_model), w_down=w(shape.d_model, shape.d_ff),
    )


def _separate_neuron_major(layer: params.Layer, kind: str, place) -> tuple:
    """(gate rows or None, up rows, down rows): three separate (d_ff, d) neuron-major matrices."""
    f = layer.w_down.shape[1]
    gate_up = np.asarray(layer.w_gate_up)
    gate, up = (None, gate_up) if kind in UNGATED_KINDS else (gate_up[:f], gate_up[f:])
    copy = lambda w: None if w is None else place(np.ascontiguousarray(w))
    return copy(gate), copy(up), copy(np.asarray(layer.w_down).T)


def _scan_before(kind: str, k: int, chunk: int = 64):
    """The first sparse FFN measured here: ``lax.scan`` over chunks of 64 ids, gathering
    gate, up and down rows of separate neuron-major matrices, then dots."""

    def f(w, x, ids):
        gate_t, up_t, down = w

        def body(acc, chunk_ids):
            up = jnp.take(up_t, chunk_ids, axis=0) @ x
            gate = None if gate_t is None else jnp.take(gate_t, chunk_ids, axis=0) @ x
            return acc + activate(kind, gate, up) @ jnp.take(down, chunk_ids, axis=0), None

        padded = jnp.resize(ids, -(-k // chunk) * chunk)  # wraps around: times ceil(k / 64) full chunks
        return jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), padded.reshape(-1, chunk))[0]

    return jax.jit(f)


def layer_bytes(shape: Shape) -> int:
    """Bytes of one float32 FFN layer of ``shape``: its gate (if any), up and down matrices."""
    return (2 if shape.kind in UNGATED_KINDS else 3) * shape.d_model * shape.d_ff * 4


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
    dense_bytes = layer_bytes(shape)
    copies = max(1, -(-CACHE_FLUSH_BYTES // dense_bytes))
    layers = [_layer(shape, rng, place) for _ in range(copies)]
    ffns = [neurons.from_layer(layer, shape.kind) for layer in layers]
    ffns = [huge_page_ffn(f) for f in ffns] if huge_pages else ffns
    x = jnp.asarray(rng.standard_normal(shape.d_model, dtype=np.float32))
    dense = _cycle(jax.jit(lambda layer, x: transformer.ffn_dense(layer, x, cfg)), [(layer, x) for layer in layers])
    separate = [_separate_neuron_major(layer, shape.kind, place) for layer in layers]
    row_bytes = ffns[0].rows.shape[1] * shape.d_model * 4
    rows = []
    for s in sparsities:
        k = int(round(shape.d_ff * (1 - s)))
        # random order, as top-k gives
        lists = [jnp.asarray(rng.permutation(shape.d_ff)[:k].astype(np.int32)) for _ in range(N_LISTS)]
        op = jax.jit(lambda ffn, x, ids: sparse_ffn(ffn, x, ids, k, backend=backend))
        n_sets = max(copies, N_LISTS)
        sparse = _cycle(op, [(ffns[i % copies], x, lists[i % N_LISTS]) for i in range(n_sets)])
        before = _cycle(
            _scan_before(shape.kind, k), [(separate[i % copies], x, lists[i % N_LISTS]) for i in range(n_sets)]
        )
        t_dense, t_before, t_sparse = fastest([dense, before, sparse], rounds)
        speedup = t_dense / t_sparse
        rows.append(dict(
            shape=shape.name, s=s, k=k, layers=1, dense_ms=t_dense * 1e3, sparse_ms=t_sparse * 1e3,
            before_ms=t_before * 1e3, efficiency_before=t_dense / t_before * (1 - s),
            speedup=speedup, efficiency=speedup * (1 - s),
            dense_gbs=dense_bytes / t_dense / 1e9,
            sparse_mb=k * row_bytes / 1e6, sparse_gbs=k * row_bytes / t_sparse / 1e9,
            sparse_bw_share=k * row_bytes / t_sparse / bandwidth,
        ))
    return rows


def chain_layers(shape: Shape, min_bytes: int = CACHE_FLUSH_BYTES) -> int:
    """Layers a chain of ``shape`` needs for its weights to exceed ``min_bytes`` (every call then reads them from
    memory): at least 2 (one would be ``bench_shape``'s lone call)."""
    return max(2, -(-min_bytes // layer_bytes(shape)))


def bench_chained(shape: Shape, sparsities, rounds: int, seed: int, huge_pages: bool,
                  min_bytes: int = CACHE_FLUSH_BYTES) -> list[dict]:
    """Dense vs ``sparse_ffn`` (backend auto) per sparsity, with ``chain_layers`` layers of their own random weights
    chained in one jit (``chain_kernels.chained``), as a decode step runs them: a lone call of a small op
    (``bench_shape``) carries the whole of a call's fixed costs, a chain spreads them over its layers. Rows like
    ``bench_shape``'s main columns, times per call of the whole chain, ``layers`` the chain's length."""
    from jpinfer.bench import chain_kernels

    n_layers = chain_layers(shape, min_bytes)
    chain = chain_kernels.random_chain(shape.d_model, shape.d_ff, shape.kind, n_layers, jnp.float32, seed)
    if huge_pages:
        chain.ffns = [huge_page_ffn(f) for f in chain.ffns]
        chain.dense = [dataclasses.replace(layer, w_gate_up=huge_page_array(layer.w_gate_up),
                                           w_down=huge_page_array(layer.w_down)) for layer in chain.dense]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape.d_model, dtype=np.float32))
    dense = chain_kernels.chained(lambda layer, y, ids: transformer.ffn_dense(layer, y, chain.cfg))
    rows = []
    for s in sparsities:
        k = int(round(shape.d_ff * (1 - s)))
        lists = [jnp.asarray(rng.permutation(shape.d_ff)[:k].astype(np.int32)) for _ in range(n_layers)]
        sparse = chain_kernels.chained(lambda ffn, y, ids, k=k: sparse_ffn(ffn, y, ids, k))
        t_dense, t_sparse = fastest([lambda: dense(chain.dense, x, [None] * n_layers),
                                     lambda: sparse(chain.ffns, x, lists)], rounds)
        rows.append(dict(shape=shape.name, s=s, k=k, layers=n_layers, dense_ms=t_dense * 1e3,
                         sparse_ms=t_sparse * 1e3, speedup=t_dense / t_sparse,
                         efficiency=t_dense / t_sparse * (1 - s)))
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
        (t,) = fastest([call], rounds)
        out.append((name, t * 1e3, k * n_rows * d * 4))
    op = jax.jit(lambda ffn, x, ids: sparse_ffn(ffn, x, ids, k, backend="xla"))
    (t,) = fastest([_cycle(op, [(ffn, x, ids) for ids in lists])], rounds)
    out.append(("whole sparse op", t * 1e3, k * 3 * d * 4))
    return out


def add_arguments(ap: argparse.ArgumentParser, command: str = "bench-kernels") -> None:
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["7b", "smollm2"])
    ap.add_argument("--sparsity", nargs="+", type=float, default=list(SPARSITIES))
    ap.add_argument("--backend", choices=BACKENDS, default="auto")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of 3 calls per op (fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--primitives", action="store_true", help="also time the op's halves (7B layer, s=0.9)")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="keep weights in XLA's own buffers (4 KiB pages) instead of huge pages")
    chain = ap.add_argument_group("accelerator table (the default on a GPU; shapes default to 7b)")
    chain.add_argument("--chain", action="store_true", help="the accelerator table on any device (CPU: interpret mode)")
    chain.add_argument("--layers", type=int, default=32, help="layers chained in one jit")
    chain.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    chain.add_argument("--tokens", type=int, nargs="+", default=[1], help="tokens sharing each list")
    chain.add_argument("--out", help="write the accelerator table (markdown) here, its data beside it (.json)")


def run_chain(args: argparse.Namespace) -> int:
    """The accelerator table: see ``chain_kernels``."""
    import sys

    from jpinfer.bench import chain_kernels
    from jpinfer.bench.results import command_line, publish

    load_before = load_average()
    device = jax.devices()[0]
    interpret = device.platform == "cpu"
    if args.layers < 1 or min(args.tokens) < 1:
        raise ValueError(f"--layers and --tokens must be >= 1, got {args.layers} and {args.tokens}")
    bandwidth = chain_kernels.copy_bandwidth(device)
    lines = [f"# Sparse FFN kernels on {device.device_kind} ({device.platform})", "",
             "- " + command_line(" ".join(["jpinfer bench-kernels", *sys.argv[2:]] if sys.argv[1:2] == ["bench-kernels"]
                                         else sys.argv)),
             f"- {args.layers} layers chained in one jit, {args.dtype}, random weights and random lists per layer; "
             f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write of 1 GiB, best of 5); fastest of "
             f"{args.rounds} x 3 calls" + ("; INTERPRET MODE (CPU): not a timing" if interpret else ""), ""]
    data = []
    for key in args.shapes:
        shape = SHAPES[key]
        chain = chain_kernels.random_chain(shape.d_model, shape.d_ff, shape.kind, args.layers, jnp.dtype(args.dtype),
                                           args.seed)
        for tokens in args.tokens:
            rows = chain_kernels.chain_rows(chain, args.sparsity, tokens, args.rounds, bandwidth, interpret, args.seed)
            lines += [f"## {shape.name}: d_model {shape.d_model}, d_ff {shape.d_ff}, {tokens} token(s)", "",
                      chain_kernels.table(rows), ""]
            data.append(dict(shape=shape.name, tokens=tokens, rows=rows))
        del chain
    lines.append("effic. = speedup over dense x (1 - s); GB/s = weight bytes the op must read / time; copy = that "
                 "rate / copy bandwidth; `pallas rows` is the first kernel, `pallas split` the one `sparse_ffn` runs.")
    lines[2:2] = [f"- {machine_line(machine(load_before))}"]  # after the run: the load average after it
    publish("\n".join(lines), args.out, dict(device=device.device_kind, jax=jax.__version__, layers=args.layers,
                                             dtype=args.dtype, copy_bandwidth=bandwidth, tables=data))
    return 0


def run(args: argparse.Namespace) -> int:
    bad = [s for s in args.sparsity if not 0 <= s < 1]
    if bad:
        raise ValueError(f"--sparsity values must lie in [0, 1), got {bad}")
    if args.chain or jax.devices()[0].platform == "gpu":
        return run_chain(args)

    pages = "huge pages" if args.huge_pages else "4 KiB pages"
    load_before = load_average()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; backend={args.backend}; weights in {pages}")
    from jpinfer.bench.machine import matvec_read_bandwidth

    bandwidth = matvec_read_bandwidth()
    print(f"measured read bandwidth (512 MiB float32 matvec, best of 5): {bandwidth / 1e9:.1f} GB/s")
    results = []
    for key in args.shapes:
        results += bench_shape(
            SHAPES[key], args.sparsity, args.backend, args.rounds, bandwidth, args.seed, args.huge_pages)
    head = f"{'layer':<16} {'s':>4} {'K':>5} {'dense ms':>8} {'before ms':>9} {'sparse ms':>9} " \
           f"{'speedup':>7} {'effic.':>6} {'before':>6} {'sparse MB':>9} " \
           f"{'GB/s: dense':>11} {'sparse':>6} {'sparse/BW':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['shape']:<16} {r['s']:>4.2f} {r['k']:>5} {r['dense_ms']:>8.2f} "
              f"{r['before_ms']:>9.2f} {r['sparse_ms']:>9.3f} {r['speedup']:>7.2f} {r['efficiency']:>6.2f} "
              f"{r['efficiency_before']:>6.2f} {r['sparse_mb']:>9.1f} "
              f"{r['dense_gbs']:>11.1f} {r['sparse_gbs']:>6.1f} {r['sparse_bw_share']:>9.0%}")
    print("dense: the decoder's ffn_dense (W @ x on fused (out, in) weights);\n"
          "before: chunked lax.scan of gathers from separate neuron-major matrices (64-neuron chunks);\n"
          "effic. = speedup over dense x (1 - s); before: the same for the before op")
    if args.primitives:
        print(f"\nwhere the sparse op's time goes (7B layer, s=0.9, chunks of {DEFAULT_CHUNK}, cold caches, fastest):")
        for name, ms, n_bytes in primitive_rates(SHAPES["7b"], 0.9, args.rounds, args.seed, args.huge_pages):
            print(f"  {name:<54} {ms:>7.2f} ms  {n_bytes / 1e6:>6.1f} MB  {n_bytes / ms / 1e6:>5.1f} GB/s")
    print(machine_line(machine(load_before)))
    return 0
