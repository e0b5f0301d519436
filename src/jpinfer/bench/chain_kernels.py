"""The sparse FFN kernels on an accelerator: chains of layers inside one jit, so launch costs show.

For one layer shape, ``n_layers`` layers with their own random weights run back to back in one
compiled function (each layer's input is the previous layer's output, scaled to stay O(1)), as a
decoder runs them. Per sparsity: the decoder's dense FFN (``transformer.ffn_dense``), every Pallas
kernel variant (``pallas.KERNELS``: ``rows`` is the first kernel, the baseline) and XLA's
gather (``sparse_ffn(backend="gather")``), over random lists of (1 - s) * d_ff neurons per layer
(random order, as top-k gives). Efficiency = speedup over dense x (1 - s): 1.0 reads the listed
bytes as fast as dense reads all of them. GB/s counts the weight bytes each op must read; "copy"
is that rate's share of the device's measured copy bandwidth. A variant that fails to compile is
reported and the others still run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench.protocol import fastest
from jpinfer.config import UNGATED_KINDS, ModelConfig
from jpinfer.models import params, transformer
from jpinfer.pallas import KERNELS
from jpinfer.sparse import NeuronFFN, sparse_ffn

SCALE = 1e-3  # each layer adds SCALE * FFN(y) to the input: the chain stays O(1) and every layer depends on the last


def copy_bandwidth(device: Any, n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s read plus written by an elementwise op over a large float32 array on ``device``."""
    a = jax.device_put(jnp.zeros((n_bytes // 4,), jnp.float32), device)
    f = jax.jit(lambda a: a + 1.0)
    (best,) = fastest([lambda: f(a)], rounds=repeats, per_round=1)
    return 2 * n_bytes / best


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _rows(key: jax.Array, *, shape: tuple[int, int, int], dtype: Any) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * shape[2] ** -0.5).astype(dtype)


@dataclasses.dataclass
class Chain:
    """Per layer the same random FFN in both layouts: neuron-major and the decoder's dense one."""

    cfg: ModelConfig
    ffns: list[NeuronFFN]
    dense: list[params.Layer]

    @property
    def dense_bytes(self) -> int:
        return sum(a.nbytes for layer in self.dense for a in (layer.w_gate_up, layer.w_down))


def random_chain(d_model: int, d_ff: int, kind: str, n_layers: int, dtype: Any, seed: int = 0) -> Chain:
    """Weights drawn on the default device (numpy would take minutes for a 7B model's FFNs)."""
    cfg = ModelConfig(vocab_size=8, d_model=d_model, n_layers=n_layers, n_heads=1, n_kv_heads=1, head_dim=8,
                      d_ff=d_ff, ffn_kind=kind)
    n_rows = 2 if kind in UNGATED_KINDS else 3
    empty = jnp.zeros((1, 1), dtype)
    ffns, dense = [], []
    for key in jax.random.split(jax.random.key(seed), n_layers):
        rows = _rows(key, shape=(d_ff, n_rows, d_model), dtype=jnp.dtype(dtype))
        ffns.append(NeuronFFN(rows=rows, ids=jnp.arange(d_ff, dtype=jnp.int32), b_up=None, b_down=None, kind=kind))
        dense.append(params.Layer(attn_norm=None, w_qkv=empty, wo=empty, ffn_norm=None,
                                  w_gate_up=rows[:, : n_rows - 1].transpose(1, 0, 2).reshape(-1, d_model),
                                  w_down=rows[:, n_rows - 1].T))
    return Chain(cfg, ffns, dense)


def chained(layer_ffn: Callable[[Any, jax.Array, jax.Array], jax.Array]):
    """jit(f(layers, x, lists)): every layer in turn, y <- x + SCALE * layer_ffn(layer, y, ids)."""

    def f(layers, x, lists):
        y = x
        for layer, ids in zip(layers, lists):
            y = x + (SCALE * layer_ffn(layer, y, ids).astype(jnp.float32)).astype(x.dtype)
        return y

    return jax.jit(f)


def sparse_ops(kind: str, k: int, interpret: bool) -> dict[str, Callable]:
    """name -> layer_ffn(NeuronFFN, y, ids) for every kernel variant and XLA's gather."""
    ops = {f"pallas {name}": (lambda f, y, ids, kernel=kernel: kernel(f.rows, f.b_up, y, ids, jnp.int32(k), kind=kind,
                                                                      interpret=interpret))
           for name, kernel in KERNELS.items()}
    ops["xla gather"] = lambda f, y, ids: sparse_ffn(f, y, ids, k, backend="gather")
    return ops


def chain_rows(chain: Chain, sparsities, tokens: int, rounds: int, bandwidth: float, interpret: bool = False,
               seed: int = 0, log: Callable[[str], None] = print,
               stop: Callable[[], bool] = lambda: False) -> list[dict]:
    """Dense vs every sparse op over the chain, per sparsity; one dict per (sparsity, op). ``stop()`` true
    before a sparsity leaves it and the later ones out (a time bound)."""
    cfg = chain.cfg
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.d_model)), chain.ffns[0].rows.dtype)
    dense = chained(lambda layer, y, ids: transformer.ffn_dense(layer, y, cfg))
    (t_dense,) = fastest([lambda: dense(chain.dense, x, [None] * cfg.n_layers)], rounds)
    itemsize = chain.ffns[0].rows.dtype.itemsize
    n_rows = chain.ffns[0].rows.shape[1]
    out = [dict(s=0.0, k=cfg.d_ff, tokens=tokens, op="dense", ms=t_dense * 1e3, speedup=1.0, efficiency=1.0,
                gbs=chain.dense_bytes / t_dense / 1e9, copy_share=chain.dense_bytes / t_dense / bandwidth)]
    log(f"dense: {t_dense * 1e3:.3f} ms")
    for s in sparsities:
        if stop():
            log(f"s={s} and later: skipped (time)")
            break
        k = max(1, int(round(cfg.d_ff * (1 - s))))
        lists = [jnp.asarray(rng.permutation(cfg.d_ff)[:k].astype(np.int32)) for _ in range(cfg.n_layers)]
        listed_bytes = cfg.n_layers * k * n_rows * cfg.d_model * itemsize
        for name, op in sparse_ops(cfg.ffn_kind, k, interpret).items():
            row = dict(s=s, k=k, tokens=tokens, op=name)
            try:
                f = chained(op)
                (t,) = fastest([lambda: f(chain.ffns, x, lists)], rounds)
            except Exception as err:  # a variant that does not compile here must not stop the others
                row.update(error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                log(f"s={s} {name}: FAILED {row['error']}")
            else:
                row.update(ms=t * 1e3, speedup=t_dense / t, efficiency=t_dense / t * (1 - s),
                           gbs=listed_bytes / t / 1e9, copy_share=listed_bytes / t / bandwidth)
                log(f"s={s} {name}: {t * 1e3:.3f} ms, efficiency {row['efficiency']:.2f}")
            out.append(row)
    return out


COLUMNS = ("s", "K", "T", "op", "ms", "speedup", "effic.", "GB/s", "copy")


def table(rows: list[dict]) -> str:
    """Markdown, one line per (sparsity, op); a failed op shows its error."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        head = f"| {r['s']:.2f} | {r['k']} | {r['tokens']} | {r['op']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | |")
        else:
            lines.append(f"{head} {r['ms']:.3f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | {r['gbs']:.1f} | "
                         f"{r['copy_share']:.0%} |")
    return "\n".join(lines)
