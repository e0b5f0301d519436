"""Predictors in a quantized model's format: what it costs in accuracy, what it saves in time.

The sparse mode runs a quantized model's predictors in the model's weights format
(``PredictorWeights.in_format``: int8 per output row, or 4-bit blocks). Two measurements, one run:

- accuracy: the default model's pack predictors in float32, int8 and 4-bit, the sparse mode's FFN (the
  masked form ``ffn.PredictorMaskFFN`` at the pack's capacities, what a decode step computes) over
  WikiText-2 test windows: perplexity, and per token and layer the truly active neurons the predictor kept
  (hits) of those active;
- time: a Llama-2-7B-shaped predictor stack (32 layers, d_model 4096, d_ff 11008, rank ``--rank``, random
  weights), one token through all layers in one jitted call, the three formats alternated over rounds
  (medians; ratios are medians of same-round ratios): milliseconds, bytes read, GB/s.

    python bench/predictor_formats.py --out bench/results/predictor_formats.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jpinfer
from jpinfer.bench.accuracy import wikitext_windows
from jpinfer.bench.planted import random_predictor
from jpinfer.bench.protocol import TEST_WINDOWS, load_average, machine, machine_line
from jpinfer.bench.results import command_line, markdown_table, publish
from jpinfer.ffn import PredictorMaskFFN, evaluate, layer_capacities, mask_states
from jpinfer.models.params import nbytes
from jpinfer.pack.default import pack_for
from jpinfer.predictor import predict_logits

FORMATS = ("float", "int8", "int4")


def accuracy(windows: int) -> dict:
    """Dense perplexity and, per format, the sparse FFN's perplexity and its kept / active neurons."""
    dense = jpinfer.load()
    cfg, pack = dense.cfg, pack_for(dense)
    test = wikitext_windows(dense.tokenizer, windows)
    ks = layer_capacities(cfg, "predicted", pack.profile, pack.predictors)
    dense_ppl, _ = evaluate(dense, test, progress=True)
    rows = {}
    for fmt in FORMATS:
        layers = [p.in_format(fmt) for p in pack.predictors.layers]
        ppl, sums = evaluate(dense, test, PredictorMaskFFN(cfg, ks), mask_states(layers, pack.profile.thresholds),
                             progress=True)
        per_token = {k: sum(layer[k] for layer in sums) / (test.size * cfg.n_layers) for k in sums[0]}
        rows[fmt] = dict(ppl=ppl, ppl_ratio=ppl / dense_ppl, **per_token,
                         predictor_bytes=nbytes(layers))
    return dict(dense_ppl=dense_ppl, ranks=pack.predictors.ranks, rows=rows)


def timing(rank: int, rounds: int, calls: int) -> dict:
    """Per format: median ms for one token through 32 7B-shaped predictors, bytes read, and the same-round
    ratio to float32."""
    rng = np.random.default_rng(0)
    d_model, d_ff, layers = 4096, 11008, 32
    stacks = {fmt: [random_predictor(d_model, d_ff, rank, rng, fmt) for _ in range(layers)] for fmt in FORMATS}

    @jax.jit
    def chain(predictors, x):  # each layer's input depends on the last one's logits: nothing is hoisted or fused
        total = jnp.float32(0)
        for p in predictors:
            total = total + predict_logits(p, x)[0]
            x = x + total * 1e-9
        return total

    x = jnp.asarray(rng.standard_normal(d_model), jnp.float32)
    for stack in stacks.values():
        chain(stack, x).block_until_ready()
    ms = {fmt: [] for fmt in FORMATS}
    for r in range(rounds):
        for fmt in FORMATS[r % 3:] + FORMATS[:r % 3]:
            start = time.perf_counter()
            for _ in range(calls):
                chain(stacks[fmt], x).block_until_ready()
            ms[fmt].append((time.perf_counter() - start) / calls * 1e3)
    rows = {}
    for fmt, stack in stacks.items():
        read, median = nbytes(stack), statistics.median(ms[fmt])
        rows[fmt] = dict(ms=median, bytes=read, gb_s=read / median / 1e6,
                         x_float=statistics.median(a / b for a, b in zip(ms[fmt], ms["float"])))
    return dict(rank=rank, layers=layers, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--test-windows", type=int, default=TEST_WINDOWS, help="WikiText-2 test windows of 512 tokens")
    ap.add_argument("--rank", type=int, default=256, help="the 7B-shaped predictors' width")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10, help="timed calls a round")
    ap.add_argument("--out", default=None, help="markdown file (a .json beside it)")
    args = ap.parse_args()
    load_before = load_average()
    acc = accuracy(args.test_windows)
    times = timing(args.rank, args.rounds, args.calls)
    m = machine(load_before)
    lines = [
        "# Predictors in the model's format", "",
        f"{machine_line(m)}", "",
        command_line(f"python bench/predictor_formats.py --test-windows {args.test_windows} --rank {args.rank} "
                     f"--rounds {args.rounds} --calls {args.calls}"), "",
        f"## Accuracy: the default model's pack predictors (ranks {min(acc['ranks'])}-{max(acc['ranks'])}), "
        f"{args.test_windows} WikiText-2 test windows of 512 tokens", "",
        f"The sparse mode's FFN at the pack's capacities; dense perplexity {acc['dense_ppl']:.3f}. Hits: truly "
        "active neurons the predictor kept, a token and layer (of 'active'); predicted: neurons it kept.", "",
        *markdown_table(("predictor format", "perplexity", "x dense", "hits", "active", "recall", "predicted",
                         "predictor MB"),
                        ((f, f"{r['ppl']:.3f}", f"{r['ppl_ratio']:.4f}", f"{r['hits']:.2f}", f"{r['active']:.2f}",
                          f"{r['hits'] / r['active']:.4f}", f"{r['predicted']:.1f}",
                          f"{r['predictor_bytes'] / 1e6:.2f}")
                         for f, r in acc["rows"].items())), "",
        f"## Time: {times['layers']} Llama-2-7B-shaped predictors of rank {times['rank']}, one token", "",
        f"Random weights; medians of {args.rounds} rounds (formats rotating), {args.calls} calls each; 'x float32' "
        "the median of same-round ratios.", "",
        *markdown_table(("predictor format", "ms", "MB read", "GB/s", "x float32 time"),
                        ((f, f"{r['ms']:.2f}", f"{r['bytes'] / 1e6:.1f}", f"{r['gb_s']:.1f}", f"{r['x_float']:.3f}")
                         for f, r in times["rows"].items())),
    ]
    data = {"machine": m, "accuracy": acc, "timing": times, "args": vars(args)}
    publish("\n".join(lines) + "\n", args.out, data)


if __name__ == "__main__":
    main()
