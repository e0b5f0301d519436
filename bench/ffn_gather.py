"""Gathering neuron rows with XLA on the CPU: why the sparse FFN works in chunks.

One FFN layer (default 7B-shaped: d_model 4096, d_ff 11008, SwiGLU, float32) in the
decoder's layout (fused (out, in) gate|up and down, ``transformer.ffn_dense``) and the
same layer neuron-major (``jpinfer.sparse.neurons``). At each sparsity s a random list of
(1 - s) * d_ff neurons is computed three ways:

- ``one gather``: one ``jnp.take`` of all listed bundles, then the products: the
  gathered (K, 3, d) block is materialised before any arithmetic;
- ``scan 64``: ``lax.scan`` over chunks of 64 listed neurons (gather a chunk, project,
  accumulate), so each gathered block stays cache-sized;
- ``sparse_ffn``: the project's op (``backend="auto"``: the chunked XLA loop on the CPU).

Efficiency = speedup over dense x (1 - s): 1.0 means the sparse version reads its bytes
as fast as the dense FFN does. The four variants alternate in rounds and the fastest call
of each counts (the layer is far larger than the caches, so every call reads from memory).

    python bench/ffn_gather.py                       # 7B layer, s = 0.5 0.8 0.9
    python bench/ffn_gather.py --d-model 512 --d-ff 1536 --rounds 2   # a quick check
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.activations import activate
from jpinfer.bench.protocol import fastest, machine, machine_line
from jpinfer.config import ModelConfig
from jpinfer.models import params, transformer
from jpinfer.sparse import neurons, sparse_ffn


def one_gather(kind: str):
    """All listed bundles in one gather, then gate/up products and the down sum."""

    def f(ffn, x, ids):
        rows = jnp.take(ffn.rows, ids, axis=0)  # (K, 3, d): materialised
        h = jnp.einsum("krd,d->kr", rows[:, :2], x)
        return activate(kind, h[:, 0], h[:, 1]) @ rows[:, 2]

    return jax.jit(f)


def scan_chunks(kind: str, chunk: int):
    """lax.scan over chunks of ``chunk`` ids: gather the chunk's bundles, project, accumulate."""

    def f(ffn, x, ids):
        def body(acc, chunk_ids):
            rows = jnp.take(ffn.rows, chunk_ids, axis=0)
            h = jnp.einsum("krd,d->kr", rows[:, :2], x)
            return acc + activate(kind, h[:, 0], h[:, 1]) @ rows[:, 2], None

        return jax.lax.scan(body, jnp.zeros_like(x), ids.reshape(-1, chunk))[0]

    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=11008)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of 3 calls per variant (fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d, f, kind, chunk = args.d_model, args.d_ff, "swiglu", 64

    cfg = ModelConfig(vocab_size=8, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=f)
    rng = np.random.default_rng(args.seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[1]))
    empty = jnp.zeros((1, 1), jnp.float32)
    layer = params.Layer(attn_norm=None, w_qkv=empty, wo=empty, ffn_norm=None,
                         w_gate_up=w(2 * f, d), w_down=w(d, f))
    ffn = neurons.from_layer(layer, kind)
    x = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
    layer_bytes = 3 * d * f * 4

    print(machine_line(machine()))
    print(f"FFN layer d_model={d} d_ff={f}, float32 ({layer_bytes / 1e6:.0f} MB); "
          f"dense = transformer.ffn_dense (W @ x, fused gate|up)")
    print(f"{'s':>4} {'K':>6} | {'dense ms':>8} {'GB/s':>5} | {'one gather ms':>13} {'effic.':>6} | "
          f"{'scan 64 ms':>10} {'effic.':>6} | {'sparse_ffn ms':>13} {'effic.':>6}")
    dense = jax.jit(lambda layer, x: transformer.ffn_dense(layer, x, cfg))
    gather, scan = one_gather(kind), scan_chunks(kind, chunk)
    for s in args.sparsity:
        k = max(chunk, int(round(f * (1 - s) / chunk)) * chunk)  # a whole number of chunks for the scan
        ids = jnp.asarray(rng.permutation(f)[:k].astype(np.int32))  # random order, as top-k gives
        op = jax.jit(lambda ffn, x, ids: sparse_ffn(ffn, x, ids, k))
        want = np.asarray(op(ffn, x, ids))
        for variant in (gather, scan):  # the three compute the same sum
            np.testing.assert_allclose(np.asarray(variant(ffn, x, ids)), want, rtol=1e-3, atol=1e-3)
        t_dense, *times = fastest([
            lambda: dense(layer, x), lambda: gather(ffn, x, ids), lambda: scan(ffn, x, ids), lambda: op(ffn, x, ids),
        ], args.rounds)
        cells = " | ".join(f"{t * 1e3:>{width}.2f} {t_dense / t * (1 - s):>6.2f}"
                           for t, width in zip(times, (13, 10, 13)))
        print(f"{s:>4.2f} {k:>6} | {t_dense * 1e3:>8.2f} {layer_bytes / t_dense / 1e9:>5.1f} | {cells}")
    print("effic. = speedup over dense x (1 - s); 1.0 = the sparse version reads its bytes as fast as dense")


if __name__ == "__main__":
    main()
