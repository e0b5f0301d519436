"""Dense weight layout on XLA:CPU: the measurements behind storing projections (out, in), fused.

A decode step is a chain of matrix-vector products, so how the weights are laid out and
how many separate products a layer issues decide its speed on the CPU. Three parts, each
one process, variants alternating in rounds (fastest call counts):

- ``ffn``: one FFN layer (default 7B: d_model 4096, d_ff 11008, SwiGLU, float32, one
  token) as ``x @ W`` over (in, out) matrices against ``W @ x`` over (out, in) matrices
  (``transformer.linear``, the decoder's form);
- ``fuse``: a stack of layers at the default model's shapes (SmolLM2-135M: 30 layers,
  d_model 576, q 576, k/v 192, d_ff 1536; attention replaced by a cheap mix of q, k and
  v) issuing q, k, v, gate and up as five products against two fused ones
  (``w_qkv``, ``w_gate_up``), all (out, in), one jit for the whole stack;
- ``matvec``: the read rate XLA reaches on each matrix shape of the default model (30
  matrices in one jit, the tied LM head alone), and on a 7B FFN matrix for scale;
- ``head``: the default model's LM head (vocab 49152, d_model 576) with greedy argmax, as
  (vocab, d) rows contracted against h against a (d, vocab) matrix applied as h @ head
  (``transformer.logits``, the decoder's form).

    python bench/weight_layout.py
    python bench/weight_layout.py --parts fuse matvec --rounds 3    # a quick check
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.protocol import fastest, machine, machine_line
from jpinfer.models.transformer import linear

PARTS = ("ffn", "fuse", "matvec", "head")


def _randn(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1]))


def ffn_part(d: int, f: int, rounds: int, rng) -> None:
    """x @ W on (in, out) matrices against W @ x on (out, in) matrices: the same FFN."""
    gate, up, down = _randn(rng, f, d), _randn(rng, f, d), _randn(rng, d, f)  # (out, in)
    gate_t, up_t, down_t = (jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in (gate, up, down))
    x = _randn(rng, 1, d)
    in_out = jax.jit(lambda g, u, dn, x: (jax.nn.silu(x @ g) * (x @ u)) @ dn)
    out_in = jax.jit(lambda g, u, dn, x: linear(jax.nn.silu(linear(x, g)) * linear(x, u), dn))
    np.testing.assert_allclose(np.asarray(in_out(gate_t, up_t, down_t, x)), np.asarray(out_in(gate, up, down, x)),
                               rtol=1e-3, atol=1e-3)
    t_io, t_oi = fastest([lambda: in_out(gate_t, up_t, down_t, x), lambda: out_in(gate, up, down, x)], rounds)
    n_bytes = 3 * d * f * 4
    print(f"\nffn: one FFN layer d_model={d} d_ff={f}, float32, one token ({n_bytes / 1e6:.0f} MB)")
    print(f"  x @ W, (in, out) matrices   {t_io * 1e3:8.2f} ms  {n_bytes / t_io / 1e9:5.1f} GB/s")
    print(f"  W @ x, (out, in) matrices   {t_oi * 1e3:8.2f} ms  {n_bytes / t_oi / 1e9:5.1f} GB/s"
          f"  (x @ W takes {t_io / t_oi:.2f}x as long)")


def fuse_part(n_layers: int, rounds: int, rng) -> None:
    """A layer stack issuing five separate projections against two fused ones."""
    d, q_dim, kv, f = 576, 576, 192, 1536
    layers = []
    for _ in range(n_layers):
        wq, wk, wv, wo = _randn(rng, q_dim, d), _randn(rng, kv, d), _randn(rng, kv, d), _randn(rng, d, q_dim)
        wg, wu, wd = _randn(rng, f, d), _randn(rng, f, d), _randn(rng, d, f)
        layers.append(dict(wq=wq, wk=wk, wv=wv, wo=wo, wg=wg, wu=wu, wd=wd,
                           w_qkv=jnp.concatenate([wq, wk, wv]), w_gate_up=jnp.concatenate([wg, wu])))
    rep = q_dim // kv

    def stack(fused: bool):
        def f_(layers, x):
            h = x
            for p in layers:
                if fused:
                    qkv = linear(h, p["w_qkv"])
                    q, k, v = qkv[..., :q_dim], qkv[..., q_dim : q_dim + kv], qkv[..., q_dim + kv :]
                else:
                    q, k, v = linear(h, p["wq"]), linear(h, p["wk"]), linear(h, p["wv"])
                h = h + 1e-3 * linear(q * jnp.tile(k + v, rep), p["wo"])  # stands in for attention
                if fused:
                    gu = linear(h, p["w_gate_up"])
                    g, u = gu[..., :f], gu[..., f:]
                else:
                    g, u = linear(h, p["wg"]), linear(h, p["wu"])
                h = h + 1e-3 * linear(jax.nn.silu(g) * u, p["wd"])
            return h

        return jax.jit(f_)

    x = _randn(rng, 1, d)
    separate, fused = stack(False), stack(True)
    np.testing.assert_allclose(np.asarray(separate(layers, x)), np.asarray(fused(layers, x)), rtol=1e-4, atol=1e-4)
    t_sep, t_fused = fastest([lambda: separate(layers, x), lambda: fused(layers, x)], rounds)
    print(f"\nfuse: {n_layers} layers at SmolLM2-135M shapes, (out, in) weights, one jit, one token")
    print(f"  q, k, v, gate, up as 5 products   {t_sep * 1e3:7.2f} ms")
    print(f"  w_qkv, w_gate_up as 2 products    {t_fused * 1e3:7.2f} ms  (fused takes {t_fused / t_sep:.2f}x as long)")


def matvec_part(rounds: int, rng) -> None:
    """Read rate of W @ x per matrix shape: n matrices chained in one jit."""
    shapes = [  # (name, (out, in), how many in one jit)
        ("w_gate_up (3072, 576)", (3072, 576), 30),
        ("w_down (576, 1536)", (576, 1536), 30),
        ("w_qkv (960, 576)", (960, 576), 30),
        ("wo (576, 576)", (576, 576), 30),
        ("tied head (49152, 576)", (49152, 576), 1),
        ("7B gate (11008, 4096)", (11008, 4096), 4),
    ]
    print("\nmatvec: W @ x chained in one jit, float32 (the default model's matrices, then a 7B one)")
    for name, (rows, cols), n in shapes:
        ws = [_randn(rng, rows, cols) for _ in range(n)]
        x = _randn(rng, cols)

        @jax.jit
        def chain(ws, x):
            y = x
            for w in ws:
                out = w @ y
                y = x + 1e-3 * (out[:cols] if rows >= cols else jnp.pad(out, (0, cols - rows)))
            return y

        (t,) = fastest([lambda: chain(ws, x)], rounds)
        n_bytes = n * rows * cols * 4
        print(f"  {n:>2} x {name:<24} {t * 1e3:7.2f} ms  {n_bytes / t / 1e9:5.1f} GB/s  ({n_bytes / 1e6:.0f} MB)")


def head_part(vocab: int, d: int, rounds: int, rng) -> None:
    """Greedy logits through the LM head: (vocab, d) rows against a (d, vocab) matrix."""
    rows = _randn(rng, vocab, d)
    cols = jnp.asarray(np.ascontiguousarray(np.asarray(rows).T))
    h = _randn(rng, d)
    by_rows = jax.jit(lambda w, h: jnp.argmax(jnp.einsum("d,vd->v", h, w)))
    by_cols = jax.jit(lambda w, h: jnp.argmax(h @ w))
    assert int(by_rows(rows, h)) == int(by_cols(cols, h))
    t_rows, t_cols = fastest([lambda: by_rows(rows, h), lambda: by_cols(cols, h)], rounds)
    n_bytes = vocab * d * 4
    print(f"\nhead: LM head vocab={vocab} d_model={d}, float32, greedy argmax ({n_bytes / 1e6:.0f} MB)")
    print(f"  (vocab, d) rows, einsum      {t_rows * 1e3:7.2f} ms  {n_bytes / t_rows / 1e9:5.1f} GB/s")
    print(f"  (d, vocab), h @ head         {t_cols * 1e3:7.2f} ms  {n_bytes / t_cols / 1e9:5.1f} GB/s"
          f"  (rows take {t_rows / t_cols:.2f}x as long)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--d-model", type=int, default=4096, help="ffn part: layer width")
    ap.add_argument("--d-ff", type=int, default=11008, help="ffn part: neurons")
    ap.add_argument("--layers", type=int, default=30, help="fuse part: stack depth")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of 3 calls (fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(machine_line(machine()))
    if "ffn" in args.parts:
        ffn_part(args.d_model, args.d_ff, args.rounds, rng)
    if "fuse" in args.parts:
        fuse_part(args.layers, args.rounds, rng)
    if "matvec" in args.parts:
        matvec_part(args.rounds, rng)
    if "head" in args.parts:
        head_part(49152, 576, args.rounds, rng)


if __name__ == "__main__":
    main()
