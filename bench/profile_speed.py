"""Profiling throughput next to a plain dense prefill over the same windows (default model).

The dense reference is ``transformer.forward`` over the same (batch, window) shapes,
jitted, without the LM head (the profiler does not need logits); ``transformer.score``
(with logits, what perplexity costs) is shown too. The profiling pass is ``profile()``
with fixed thresholds (calibration excluded), with and without predictor samples. Runs
alternate, ``--reps`` times, and the best time of each is kept, to damp the noise of a
shared machine.

    python bench/profile_speed.py --out bench/results/profile_speed.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jpinfer
from jpinfer.bench.protocol import interleaved_rounds, load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.models import transformer
from jpinfer.profiler import ProfileSettings, profile, score_histogram, token_windows, uniform
from jpinfer.profiler.passes import batches


@functools.partial(jax.jit, static_argnames=("cfg",))
def _hidden(weights, chunk, cfg):
    cache = transformer.KVCache.create(cfg, chunk.shape[0], chunk.shape[1], weights.dtype)
    return transformer.forward(weights, chunk, cache, cfg)[0]


def dense_seconds(engine, tokens: np.ndarray, batch_size: int, with_logits: bool) -> float:
    """Seconds for the dense model over all windows (compiled beforehand by a warm-up call)."""
    step = transformer.score if with_logits else _hidden
    t = time.perf_counter()
    out = None
    for _, chunk, _ in batches(tokens, batch_size):
        out = step(engine.weights, jnp.asarray(chunk), engine.cfg)
    jax.block_until_ready(out)
    return time.perf_counter() - t


def timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    load_before = load_average()

    engine = jpinfer.load()
    tokens = token_windows("wikitext2-valid", engine.tokenizer, window=args.window,
                           n_tokens=args.windows * args.window, seed=0).tokens
    cal = uniform(score_histogram(engine, tokens[: args.batch_size]), 0.5)
    kw = dict(thresholds=cal, progress=False)
    plain = ProfileSettings(batch_size=args.batch_size)
    sampled = dataclasses.replace(plain, n_samples=8)
    profile(engine, tokens[: args.batch_size], plain, **kw)  # compile everything once
    dense_seconds(engine, tokens[: args.batch_size], args.batch_size, False)
    dense_seconds(engine, tokens[: args.batch_size], args.batch_size, True)
    profile(engine, tokens[: args.batch_size], sampled, **kw)
    score_histogram(engine, tokens[: args.batch_size], batch_size=args.batch_size)
    b = args.batch_size
    runs = {
        "dense prefill (transformer.forward, no LM head)": lambda: dense_seconds(engine, tokens, b, False),
        "dense prefill + logits (transformer.score)": lambda: dense_seconds(engine, tokens, b, True),
        "profile pass (counts + histogram)": lambda: profile(engine, tokens, plain, **kw).meta["seconds"]["pass"],
        f"profile pass + {args.n_samples} predictor samples": lambda: profile(
            engine, tokens, dataclasses.replace(plain, n_samples=args.n_samples), **kw).meta["seconds"]["pass"],
        "calibration pass (score histogram)": lambda: timed(score_histogram, engine, tokens, batch_size=b),
    }
    measured = interleaved_rounds({name: (lambda r, run=run: run()) for name, run in runs.items()}, args.reps,
                                  warm={name: (lambda: None) for name in runs},  # compiled above
                                  after_run=lambda r, name, run: print(f"{name}: {tokens.size / run.result:.1f} tok/s",
                                                                       flush=True))
    best = {name: min(measured.results(name)) for name in runs}  # each run's own seconds (its pass alone)

    base = best[next(iter(runs))]
    lines = [
        "# Profiling throughput vs dense prefill (SmolLM2-135M-Instruct, float32, CPU)",
        "",
        command_line(f"python bench/profile_speed.py {' '.join(sys.argv[1:])}"),
        "",
        f"{args.windows} windows x {args.window} tokens of WikiText-2 valid, batch {args.batch_size}; best of "
        f"{args.reps} interleaved rounds (jpinfer.bench.protocol). {machine_line(machine(load_before))} The machine "
        "is shared with other jobs: absolute numbers are noisy, the ratios less so.",
        "",
        "| run | tokens/s | cost vs dense prefill |",
        "|---|---|---|",
    ]
    for name, seconds in best.items():
        lines.append(f"| {name} | {tokens.size / seconds:.1f} | {seconds / base:.2f}x |")
    calib, n = ProfileSettings().calibration_tokens, ProfileSettings().n_tokens
    names = list(best)
    whole = (best[names[2]] + best[names[4]] * calib / n) / base
    lines += ["", f"A default profile() of {n} tokens first calibrates on {calib} of them: end to end it costs "
              f"(profile pass + {calib / n:.3f} x calibration pass) = {whole:.2f}x the dense prefill."]
    publish("\n".join(lines) + "\n", args.out, {"tok_s": {name: tokens.size / s for name, s in best.items()},
                                                 "seconds": best, "machine": machine(load_before)})


if __name__ == "__main__":
    main()
