"""Native CPU kernels (jpinfer.native) against XLA:CPU, medians of interleaved rounds in one run.

    .venv/bin/python bench/native_kernels.py [--rounds 7] [--layers 3] [--out bench/results/native_kernels]

Sections (every variant of a section runs once per round, in rotating order, so that a slow phase of the
machine hits all of them; the table shows medians over rounds):
  1. fused sparse FFN at the Llama-2-7B FFN shape (d 4096, n 11008, swiglu, float32, one token, several
     distinct layers chained so no cache holds them) at 50/80/90/95% sparsity, against XLA's dense FFN
     (efficiency = speedup / (1 / (1 - s)): 1.0 means reading the listed rows as fast as XLA reads the
     whole layer) and in GB/s against XLA's float32 W @ x in the same rounds; the native kernel also on one
     thread, and the project's XLA chunk loop (jpinfer.ops.chunked) where it imports;
  2. the same at the default model's shape (d 576, n 1536, 30 layers);
  3. dense int8 (W8A8) and 4-bit (Q4_0, Q4_1) matrix-vector products at 11008 x 4096, 1 and 8 tokens:
     GB/s of weight bytes against XLA's float32 W @ x and XLA's int8 product (int8 x int8 -> int32
     dot_general, one token padded to two columns: the form jpinfer.models.int8 runs);
  4. threshold products at 50% kept (input sparsity over the input-major gate/up matrix (4096, 22016),
     activation sparsity over the neuron-major down matrix (11008, 4096)) against XLA's dense x @ M, in
     float32 and int8 (one scale per column; XLA's int8 variant is the masked W8A8 product);
  5. attention over a KV cache at the default model's attention shape (9 query heads on 3 kv heads, head
     dim 64, one token, 30 layers chained, each reading a 3.5 MB weight matrix first as a decode step
     does, so the caches come from memory): the native kernel (jpinfer.ops.attention.cached_attention
     on the CPU) against the model's XLA form (xla_cached_attention, over the engine's attention length),
     at 128, 1024 and 4096 positions; per layer, the chain without attention subtracted;
  6. the attention of a prompt (prefill) at the same shape, 600, 1024 and 4096 tokens from position 0: the
     native tiled kernel (attention.cached_attention on the CPU past ONE_SOFTMAX_TOKENS) against
     attention.blocked_attention, one layer's call, GFLOP/s of the causal products (4 hd flops per
     visible query-key pair and query head).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.bench import protocol
from jpinfer.bench.results import command_line
from jpinfer.config import ModelConfig
from jpinfer.native import kernels as K
from jpinfer.native import library
from jpinfer.ops import attention
from jpinfer.quant import int8, q4
from jpinfer.runtime.generation import attend_length

SECTIONS = ["ffn_7b", "ffn_default", "quantized", "threshold", "attention", "prefill_attention"]


def interleaved_medians(calls: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each call (``protocol.interleaved_rounds``: untimed warm-up, order rotating);
    each call returns something to block on."""
    blocking = {name: (lambda _r, f=f: jax.block_until_ready(f())) for name, f in calls.items()}
    timed = protocol.interleaved_rounds(blocking, rounds)
    return {name: timed.median(name) for name in calls}


def with_threads(n: int, f):
    def run():
        library.set_max_threads(n)
        try:
            return jax.block_until_ready(f())
        finally:
            library.set_max_threads(0)
    return run


def normal(key, shape, scale):
    return jax.random.normal(key, shape, jnp.float32) * scale


def ffn_section(name: str, d: int, n: int, layers: int, rounds: int, sparsities, seed: int) -> dict:
    """Native fused sparse FFN vs XLA dense FFN at one shape, one token, ``layers`` distinct layers chained."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3 * layers + 2)
    rows = [jax.block_until_ready(normal(keys[3 * i], (n, 3, d), d ** -0.5)) for i in range(layers)]
    # XLA's dense FFN in its fastest forms: gate/up (2n, d) @ x, down (d, n) @ a
    gate_up = [jax.block_until_ready(jnp.concatenate([r[:, 0], r[:, 1]], 0)) for r in rows]
    down = [jax.block_until_ready(r[:, 2].T) for r in rows]
    x = normal(keys[-1], (1, d), 1.0)

    @jax.jit
    def dense(x, gate_up, down):
        v = x[0]
        for gu, dn in zip(gate_up, down):
            h = gu @ v
            v = dn @ (jax.nn.silu(h[:n]) * h[n:])
        return v

    @jax.jit
    def w_x(x, gate_up):  # XLA's float32 W @ x read rate over the same bytes' kind of matrices
        return [gu @ x[0] for gu in gate_up]

    calls = {"xla dense FFN": lambda: dense(x, gate_up, down), "xla W@x": lambda: w_x(x, gate_up)}
    try:
        from jpinfer.ops.chunked import sparse_ffn_chunked
    except ImportError:
        sparse_ffn_chunked = None
    rng = np.random.default_rng(seed)
    lists = {}
    for s in sparsities:
        k = int(round(n * (1 - s)))
        ids = [jnp.asarray(np.sort(rng.choice(n, k, replace=False)).astype(np.int32)) for _ in range(layers)]
        count = jnp.int32(k)
        lists[s] = (k, ids)

        @jax.jit
        def native(x, rows, ids, count=count):
            for r, i in zip(rows, ids):
                x = K.sparse_ffn(r, x, i, count, kind="swiglu", native=True)
            return x

        calls[f"native s={s:.2f}"] = (lambda f=native, ids=ids: f(x, rows, ids))
        calls[f"native 1 thread s={s:.2f}"] = with_threads(1, lambda f=native, ids=ids: f(x, rows, ids))
        if sparse_ffn_chunked is not None and s >= 0.8:
            @jax.jit
            def chunked(x, rows, ids, count=count):
                for r, i in zip(rows, ids):
                    x = sparse_ffn_chunked(r, None, x, i, count, kind="swiglu")
                return x
            calls[f"xla chunk loop s={s:.2f}"] = (lambda f=chunked, ids=ids: f(x, rows, ids))
    # correctness spot check against XLA on layer 0 at the first sparsity
    k, ids = lists[sparsities[0]]
    got = np.asarray(K.sparse_ffn(rows[0], x, ids[0], k, kind="swiglu", native=True), np.float64)
    ref = np.asarray(K.sparse_ffn(rows[0], x, ids[0], k, kind="swiglu", native=False), np.float64)
    rel_err = float(np.abs(got - ref).max() / np.abs(ref).max())

    t = interleaved_medians(calls, rounds)
    layer_bytes = 3 * n * d * 4
    out = {"shape": {"d": d, "n": n, "layers": layers, "kind": "swiglu", "tokens": 1}, "rel_err_vs_xla": rel_err,
           "xla_dense_ms": t["xla dense FFN"] * 1e3, "xla_dense_gbs": layers * layer_bytes / t["xla dense FFN"] / 1e9,
           "xla_wx_gbs": layers * 2 * n * d * 4 / t["xla W@x"] / 1e9, "rows": []}
    for s in sparsities:
        k, _ = lists[s]
        row = {"sparsity": s, "neurons": k}
        for label, key in (("native", f"native s={s:.2f}"), ("native_1thread", f"native 1 thread s={s:.2f}"),
                           ("xla_chunk_loop", f"xla chunk loop s={s:.2f}")):
            if key not in t:
                continue
            speedup = t["xla dense FFN"] / t[key]
            row[label] = {"ms": t[key] * 1e3, "speedup": speedup, "efficiency": speedup * (1 - s),
                          "gbs": layers * 3 * k * d * 4 / t[key] / 1e9}
        out["rows"].append(row)
    return out


def quant_section(out_dim: int, in_dim: int, mats: int, rounds: int, seed: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), mats)
    floats = [np.asarray(normal(keys[i], (out_dim, in_dim), in_dim ** -0.5)) for i in range(mats)]
    f32 = [jnp.asarray(w) for w in floats]
    i8 = [(m.values, m.scales) for m in map(int8.quantize, floats)]
    q40 = [q4.quantize_q4_0(w) for w in floats]
    q41 = [q4.quantize_q4_1(w) for w in floats]
    del floats
    res = {"shape": {"out": out_dim, "in": in_dim, "matrices": mats}, "rows": []}
    for T in (1, 8):
        x = normal(jax.random.PRNGKey(seed + T), (T, in_dim), 1.0)

        @jax.jit
        def xla_f32(x, ws):
            return [w @ x.T for w in ws]

        @jax.jit
        def xla_int8(x, ms):
            q, s = int8.quantize_tokens(x)
            qp = jnp.pad(q, ((0, max(0, 2 - q.shape[0])), (0, 0)))
            outs = []
            for v, sc in ms:
                acc = jax.lax.dot_general(v, qp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32).T
                outs.append(acc[: q.shape[0]].astype(jnp.float32) * (s[:, None] * sc[None, :]))
            return outs

        native_i8 = jax.jit(lambda x, ms: [K.int8_matvec(v, s, x, native=True) for v, s in ms])
        native_q4 = jax.jit(lambda x, ms: [K.q4_matvec(m, x, native=True) for m in ms])
        calls = {"xla f32": lambda: xla_f32(x, f32), "xla int8": lambda: xla_int8(x, i8),
                 "native int8": lambda: native_i8(x, i8), "native q4_0": lambda: native_q4(x, q40),
                 "native q4_1": lambda: native_q4(x, q41)}
        t = interleaved_medians(calls, rounds)
        nbytes = {"xla f32": sum(int(w.nbytes) for w in f32),
                  "xla int8": sum(int(v.nbytes + s.nbytes) for v, s in i8),
                  "native int8": sum(int(v.nbytes + s.nbytes) for v, s in i8),
                  "native q4_0": sum(m.nbytes for m in q40), "native q4_1": sum(m.nbytes for m in q41)}
        for name in calls:
            res["rows"].append({"tokens": T, "variant": name, "ms_per_matrix": t[name] / mats * 1e3,
                                "gbs": nbytes[name] / t[name] / 1e9, "speedup_vs_xla_f32": t["xla f32"] / t[name],
                                "speedup_vs_xla_int8": t["xla int8"] / t[name]})
    return res


def threshold_section(d: int, n: int, rounds: int, seed: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    res = {"rows": []}
    for label, (rows_dim, cols_dim) in (("input sparsity: gate/up (d, 2n)", (d, 2 * n)),
                                        ("activation sparsity: down (n, d)", (n, d))):
        m = jax.block_until_ready(normal(keys[0], (rows_dim, cols_dim), rows_dim ** -0.5))
        x = normal(keys[1], (1, rows_dim), 1.0)
        thr = jnp.float32(0.6745)  # the median of |N(0, 1)|: about half the entries kept
        native = jax.jit(lambda m, x, t: K.threshold_rows_product(m, x, t, native=True))
        xla_masked = jax.jit(lambda m, x, t: K.threshold_rows_product(m, x, t, native=False))
        xla_dense = jax.jit(lambda m, x: x @ m)
        # the int8 copy (one scale per column, as jpinfer.models.int8 stores the transposed layouts)
        transposed = int8.quantize(np.asarray(m).T)
        v8 = jnp.asarray(np.ascontiguousarray(np.asarray(transposed.values).T))
        s8 = transposed.scales
        native8 = jax.jit(lambda v, s, x, t: K.threshold_rows_product_int8(v, s, x, t, native=True))
        xla8 = jax.jit(lambda v, s, x, t: K.threshold_rows_product_int8(v, s, x, t, native=False))
        calls = {"native": lambda: native(m, x, thr),
                 "native 1 thread": with_threads(1, lambda: native(m, x, thr)),
                 "xla masked x @ M": lambda: xla_masked(m, x, thr),
                 "xla dense x @ M": lambda: xla_dense(m, x),
                 "native int8": lambda: native8(v8, s8, x, thr),
                 "xla int8 masked (W8A8)": lambda: xla8(v8, s8, x, thr)}
        t = interleaved_medians(calls, rounds)
        kept = int(np.asarray(native(m, x, thr)[1])[0])
        for name in calls:
            width = 1 if "int8" in name else 4
            read = (kept if name.startswith("native") else rows_dim) * cols_dim * width
            res["rows"].append({"matrix": label, "shape": [rows_dim, cols_dim], "kept": kept, "variant": name,
                                "ms": t[name] * 1e3, "gbs_of_rows_read": read / t[name] / 1e9,
                                "speedup_vs_xla_dense": t["xla dense x @ M"] / t[name]})
    return res


def attention_section(positions_list, layers: int, rounds: int, seed: int) -> dict:
    cfg = ModelConfig(vocab_size=64, d_model=576, n_layers=layers, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
                      max_position=8192, eos_token_ids=())
    d, n, heads, kv_heads, hd = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    weights = [jax.block_until_ready(normal(jax.random.fold_in(keys[0], i), (d, n), 0.03)) for i in range(layers)]
    q = normal(keys[1], (1, 1, heads, hd), 1.0)
    res = {"shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": hd, "layers": layers}, "rows": []}
    for pos in positions_list:
        capacity = 256 * -(-(pos + 1) // 256)
        caches = [tuple(jax.block_until_ready(normal(jax.random.fold_in(keys[2], 2 * i + j),
                                                     (1, kv_heads, capacity, hd), 1.0))
                        for j in (0, 1)) for i in range(layers)]  # separate buffers, as KVCache holds them
        positions = jnp.array([pos], jnp.int32)
        attend = attend_length(pos + 1, capacity)

        def chain(attention):
            def run(q, weights, caches):
                x = jnp.zeros((n,), jnp.float32)
                for w, (k, v) in zip(weights, caches):
                    y = w @ x  # a layer's weights stream through the caches first, as in a decode step
                    if attention is not None:
                        y = y + attention(q + y[0] * 1e-9, k, v, positions).reshape(-1)[:d]
                    x = x.at[:d].add(y * 1e-9)
                return x
            return jax.jit(run)

        runs = {"native": chain(lambda *a: attention.cached_attention(*a, cfg, attend, window=None)),
                "xla": chain(lambda *a: attention.xla_cached_attention(*a, cfg=cfg, attend=attend, window=None)),
                "no attention": chain(None)}
        t = interleaved_medians({name: (lambda f=f: f(q, weights, caches)) for name, f in runs.items()}, rounds)
        per_layer = {name: (t[name] - t["no attention"]) / layers * 1e6 for name in ("native", "xla")}
        cache_bytes = 2 * kv_heads * (pos + 1) * hd * 4
        res["rows"].append({"positions": pos + 1, "attend": attend, "native_us": per_layer["native"],
                            "xla_us": per_layer["xla"], "speedup": per_layer["xla"] / per_layer["native"],
                            "native_gbs": cache_bytes / per_layer["native"] / 1e3})
    return res


def prefill_attention_section(tokens_list, rounds: int, seed: int) -> dict:
    cfg = ModelConfig(vocab_size=64, d_model=576, n_layers=1, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
                      max_position=8192, eos_token_ids=())
    heads, kv_heads, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    res = {"shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": hd}, "rows": []}
    for t in tokens_list:
        q = normal(keys[0], (1, t, heads, hd), 1.0)
        k, v = (normal(keys[i], (1, kv_heads, t, hd), 1.0) for i in (1, 2))
        positions = jnp.arange(t, dtype=jnp.int32)
        native = jax.jit(lambda q, k, v: attention.cached_attention(q, k, v, positions, cfg, window=None))
        assert "jpinfer_prefill_attention" in native.lower(q, k, v).as_text()
        xla = jax.jit(lambda q, k, v: attention.blocked_attention(q, k, v, positions, cfg, window=None))
        times = interleaved_medians({"native": lambda: native(q, k, v), "xla": lambda: xla(q, k, v)}, rounds)
        flops = 4 * hd * heads * t * (t + 1) / 2
        err = float(jnp.abs(native(q, k, v) - xla(q, k, v)).max())
        res["rows"].append({"tokens": t, "native_ms": times["native"] * 1e3, "xla_ms": times["xla"] * 1e3,
                            "speedup": times["xla"] / times["native"], "native_gflops": flops / times["native"] / 1e9,
                            "xla_gflops": flops / times["xla"] / 1e9, "max_abs_diff": err})
    return res


def markdown(meta: dict, sections: dict) -> str:
    lines = ["# Native CPU kernels vs XLA:CPU", "",
             f"{protocol.machine_line(meta['machine'])} Library features {', '.join(meta['native_features'])}; "
             f"{meta['rounds']} interleaved rounds, medians; {meta['seconds']:.0f} s.", "",
             command_line(meta["command"]), ""]
    for key, title in (("ffn_7b", "Fused sparse FFN, Llama-2-7B FFN shape"),
                       ("ffn_default", "Fused sparse FFN, default model shape")):
        sec = sections.get(key)
        if not sec:
            continue
        sh = sec["shape"]
        lines += [f"## {title} (d {sh['d']}, n {sh['n']}, {sh['layers']} layers chained, swiglu, float32, 1 token)",
                  "", f"XLA dense FFN {sec['xla_dense_ms']:.2f} ms = {sec['xla_dense_gbs']:.1f} GB/s; "
                  "XLA float32 W @ x "
                  f"{sec['xla_wx_gbs']:.1f} GB/s (same rounds); native vs XLA max rel. error "
                  f"{sec['rel_err_vs_xla']:.1e}", "",
                  "| sparsity | neurons | native ms | speedup | efficiency | GB/s | GB/s / XLA W@x "
                  "| 1 thread: efficiency | GB/s | XLA chunk loop: efficiency |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            nat, one, ch = r["native"], r["native_1thread"], r.get("xla_chunk_loop")
            lines.append(f"| {r['sparsity']:.0%} | {r['neurons']} | {nat['ms']:.2f} | {nat['speedup']:.2f}x | "
                         f"{nat['efficiency']:.2f} | {nat['gbs']:.1f} | {nat['gbs'] / sec['xla_wx_gbs']:.2f} | "
                         f"{one['efficiency']:.2f} | {one['gbs']:.1f} | "
                         f"{'' if ch is None else format(ch['efficiency'], '.2f')} |")
        lines.append("")
    sec = sections.get("quantized")
    if sec:
        sh = sec["shape"]
        lines += [f"## Dense quantized matrix-vector products ({sh['out']} x {sh['in']}, {sh['matrices']} distinct "
                  "matrices)", "",
                  "GB/s of weight bytes read (int8: values + scales; q4: nibbles + float16 scales [+ mins]).", "",
                  "| tokens | variant | ms / matrix | GB/s | speedup vs XLA f32 | speedup vs XLA int8 |",
                  "|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            lines.append(f"| {r['tokens']} | {r['variant']} | {r['ms_per_matrix']:.3f} | {r['gbs']:.1f} | "
                         f"{r['speedup_vs_xla_f32']:.2f}x | {r['speedup_vs_xla_int8']:.2f}x |")
        lines.append("")
    sec = sections.get("threshold")
    if sec:
        lines += ["## Threshold products, about 50% kept (1 token)", "",
                  "GB/s counts the bytes of the rows each variant reads (native: the kept rows; XLA: all of them; "
                  "int8: one byte a weight).", "",
                  "| matrix | kept | variant | ms | GB/s | speedup vs XLA dense |", "|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            lines.append(f"| {r['matrix']} {tuple(r['shape'])} | {r['kept']} | {r['variant']} | {r['ms']:.2f} | "
                         f"{r['gbs_of_rows_read']:.1f} | {r['speedup_vs_xla_dense']:.2f}x |")
        lines.append("")
    sec = sections.get("attention")
    if sec:
        sh = sec["shape"]
        lines += [f"## Attention over a KV cache ({sh['heads']} query heads on {sh['kv_heads']} kv heads, head dim "
                  f"{sh['head_dim']}, 1 token, {sh['layers']} layers chained behind weight reads)", "",
                  "Per layer: the chain's time minus the same chain without attention. GB/s: the used cache's "
                  "keys and values over the native kernel's time.", "",
                  "| positions | XLA attention length | native us | XLA us | speedup | native GB/s |",
                  "|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            lines.append(f"| {r['positions']} | {r['attend']} | {r['native_us']:.1f} | {r['xla_us']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['native_gbs']:.1f} |")
        lines.append("")
    sec = sections.get("prefill_attention")
    if sec:
        sh = sec["shape"]
        lines += [f"## Attention of a prompt ({sh['heads']} query heads on {sh['kv_heads']} kv heads, head dim "
                  f"{sh['head_dim']}, positions from 0, one layer)", "",
                  "GFLOP/s: 4 x head dim flops per visible (query, key) pair and query head. Max abs diff: native "
                  "against XLA's blocked attention (outputs of size ~0.1-1).", "",
                  "| tokens | native ms | XLA blocked ms | speedup | native GFLOP/s | XLA GFLOP/s | max abs diff |",
                  "|---|---|---|---|---|---|---|"]
        for r in sec["rows"]:
            lines.append(f"| {r['tokens']} | {r['native_ms']:.2f} | {r['xla_ms']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['native_gflops']:.0f} | {r['xla_gflops']:.0f} | {r['max_abs_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=3, help="distinct 7B layers chained (each 541 MB of rows)")
    p.add_argument("--out", default="bench/results/native_kernels")
    p.add_argument("--only", nargs="*", choices=SECTIONS)
    args = p.parse_args(argv)
    if not library.native_available():
        sys.exit(f"native kernels unavailable: {library.unavailable_reason()}")
    only = set(args.only or SECTIONS)
    load_before = protocol.load_average()
    meta = {"command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
            "native_features": library.features()["compiled"], "rounds": args.rounds}
    sections = {}
    start = time.perf_counter()
    if "ffn_7b" in only:
        sections["ffn_7b"] = ffn_section("7b", 4096, 11008, args.layers, args.rounds, (0.5, 0.8, 0.9, 0.95), 0)
        print(f"ffn_7b done {time.perf_counter() - start:.0f} s", flush=True)
    if "ffn_default" in only:
        sections["ffn_default"] = ffn_section("default", 576, 1536, 30, args.rounds * 3, (0.5, 0.8, 0.9, 0.95), 1)
        print(f"ffn_default done {time.perf_counter() - start:.0f} s", flush=True)
    if "quantized" in only:
        sections["quantized"] = quant_section(11008, 4096, 6, args.rounds, 2)
        print(f"quantized done {time.perf_counter() - start:.0f} s", flush=True)
    if "threshold" in only:
        sections["threshold"] = threshold_section(4096, 11008, args.rounds, 3)
    if "attention" in only:
        sections["attention"] = attention_section((127, 1023, 4095), 30, args.rounds * 3, 4)
    if "prefill_attention" in only:
        sections["prefill_attention"] = prefill_attention_section((600, 1024, 4096), args.rounds, 5)
    meta["machine"] = protocol.machine(load_before)
    meta["seconds"] = round(time.perf_counter() - start, 1)
    text = markdown(meta, sections)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "sections": sections}, indent=1) + "\n")


if __name__ == "__main__":
    main()
