"""Where a dense decode step's time goes on XLA:CPU: the compiled step's operations, timed.

Runs the default model's jitted decode step (``transformer.decode_step`` with the engine's
attention length, then greedy argmax) under ``jax.profiler`` at decode positions after a
prompt, and sums the profiler's per-operation times over the steps:
matrix-vector products (``dot``) against everything else (norms, RoPE, cache update,
attention, softmax, residuals), with the count of each operation kind per step.

    python bench/decode_profile.py [--prompt-tokens 120] [--steps 24] [--weights int8]

With quantized weights the products are the native kernels' FFI calls (``custom-call``), not ``dot``.

The profiler charges every operation a cost of its own, so many small operations look costlier than they are:
replacing the norms' ~365 small operations a step with one native call each left the un-profiled step unchanged
(docs/architecture.md, "Tried for the norms and not kept"). Confirm a saving by timing the step without it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jpinfer
from jpinfer.bench.protocol import machine, machine_line
from jpinfer.config import WEIGHT_FORMATS
from jpinfer.models import transformer
from jpinfer.runtime.generation import attend_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=120)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--weights", choices=WEIGHT_FORMATS, default="float")
    args = ap.parse_args()
    model = jpinfer.load(weights=args.weights).model
    weights, cfg = model.weights, model.cfg
    prompt = np.array([[1000 + i for i in range(args.prompt_tokens)]], np.int32)
    capacity = 256 * -(-(args.prompt_tokens + args.steps + 8) // 256)
    cache = transformer.KVCache.create(cfg, 1, capacity)
    logits, cache = transformer.prefill(weights, jnp.asarray(prompt), jnp.int32(prompt.shape[1]), cache, cfg)
    position = prompt.shape[1]

    def step(logits, cache, position):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return transformer.decode_step(weights, token, cache, cfg, attend=attend_length(position + 1, capacity))

    # compile every attention length the timed steps reach, on a throwaway cache
    spare = transformer.KVCache.create(cfg, 1, capacity)
    for attend in sorted({attend_length(p + 1, capacity) for p in range(position, position + args.steps + 4)}):
        _, spare = transformer.decode_step(weights, jnp.zeros((1,), jnp.int32), spare, cfg, attend=attend)
    for _ in range(4):  # past the first steps' one-time work
        logits, cache = step(logits, cache, position)
        position += 1
    jax.block_until_ready(logits)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                logits, cache = step(logits, cache, position)
                position += 1
            jax.block_until_ready(logits)
            wall = (time.perf_counter() - t0) / args.steps
        trace = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))
    ms, count = collections.defaultdict(float), collections.Counter()
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or "dur" not in event or name.startswith(("end:", "$")) or "::" in name:
            continue
        if name[0].isupper():  # runtime spans (PjRt, executors), not compiled operations
            continue
        kind = re.sub(r"[.\d]+$", "", name)
        ms[kind] += event["dur"] / 1e3 / args.steps
        count[kind] += 1
    dots = ms.pop("dot", 0.0)
    print(machine_line(machine()))
    print(f"default model, {args.weights} weights (float32), decode positions {prompt.shape[1] + 4}-{position}")
    print(f"step (under the profiler): {wall * 1e3:.2f} ms")
    print(f"  matrix-vector products: {dots:6.2f} ms  ({count['dot'] // args.steps} per step)")
    others = sum(count.values()) // args.steps - count["dot"] // args.steps
    print(f"  other operations:       {sum(ms.values()):6.2f} ms  ({others} per step)")
    for kind, t in sorted(ms.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {kind:<40} {t:6.3f} ms  x{count[kind] // args.steps}")


if __name__ == "__main__":
    main()
