"""jpinfer bench (python -m jpinfer.bench): engines side by side on real prompts, with ratios.

Prints one table: prefill and decode speed, per-token latency percentiles, the share of
the machine's measured read bandwidth the decode reaches, host overhead per step, and
speed relative to the first engine (dense float32).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

import jax
import numpy as np

from jpinfer.bench.machine import matvec_read_bandwidth


def _prompts(engine, n: int, max_tokens: int) -> list[list[int]]:
    from jpinfer.data import chatgpt_prompts

    texts = chatgpt_prompts()[:n]
    return [engine.encode_prompt(t, chat=True)[:max_tokens] for t in texts]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_engines(args: argparse.Namespace) -> list[dict]:
    import jpinfer
    from jpinfer.bench.engines import JaxEngine, TransformersEager

    print("measuring XLA matvec read bandwidth ...", file=sys.stderr)
    bandwidth = matvec_read_bandwidth()
    engines = []
    for dtype in args.dtypes:
        engines.append(JaxEngine(f"jpinfer dense {dtype}", jpinfer.load(args.model, dtype=dtype)))
    prompts = _prompts(engines[0].engine, args.prompts, args.max_prompt_tokens)
    if args.peers and TransformersEager.available():
        engines.append(TransformersEager(engines[0].engine.source))

    rows = []
    reference_tokens = None
    for bench_engine in engines:
        print(f"running {bench_engine.name} on {len(prompts)} prompts ...", file=sys.stderr)
        runs = [bench_engine.run(p, args.max_new_tokens) for p in prompts]
        steps = np.concatenate([r.step_s for r in runs])
        prefill_tokens = sum(r.n_prompt for r in runs)
        prefill_s = sum(r.prefill_s for r in runs)
        decode_tps = len(steps) / steps.sum()
        tokens = [r.tokens for r in runs]
        if reference_tokens is None:
            reference_tokens = tokens
        agree = np.mean([_prefix_agreement(a, b) for a, b in zip(tokens, reference_tokens)])
        overhead = bench_engine.host_overhead(prompts[0], args.max_new_tokens)
        rows.append(
            dict(
                engine=bench_engine.name,
                prefill_tok_s=prefill_tokens / prefill_s,
                ttft_ms=1e3 * prefill_s / len(runs),
                decode_tok_s=decode_tps,
                p50_ms=1e3 * float(np.percentile(steps, 50)),
                p99_ms=1e3 * float(np.percentile(steps, 99)),
                bandwidth_fraction=(bench_engine.weight_bytes_per_token * decode_tps / bandwidth)
                if bench_engine.weight_bytes_per_token else None,
                host_overhead=overhead,
                greedy_agreement=agree,
                peak_rss_mb=_peak_rss_mb(),
            )
        )
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["decode_vs_first"] = row["decode_tok_s"] / base
    print(_table(rows, bandwidth, args))
    return rows


def _prefix_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of greedy tokens equal to the reference before the first divergence."""
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same / max(n, 1)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(rows: list[dict], bandwidth: float, args: argparse.Namespace) -> str:
    header = (
        f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}; {args.prompts} ChatGPT prompts "
        f"(chat template, <= {args.max_prompt_tokens} tokens), {args.max_new_tokens} new tokens, greedy; "
        f"XLA matvec read bandwidth {bandwidth / 1e9:.1f} GB/s; jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    cols = [
        ("engine", "engine", "<36"), ("prefill tok/s", "prefill_tok_s", ">13.1f"), ("TTFT ms", "ttft_ms", ">8.1f"),
        ("decode tok/s", "decode_tok_s", ">12.1f"), ("p50 ms", "p50_ms", ">7.2f"), ("p99 ms", "p99_ms", ">7.2f"),
        ("BW frac", "bandwidth_fraction", ">7.2f"), ("host ovh", "host_overhead", ">8.1%"),
        ("x decode", "decode_vs_first", ">8.2f"), ("greedy agree", "greedy_agreement", ">12.2f"),
        ("peak RSS MB", "peak_rss_mb", ">11.0f"),
    ]
    lines = [header, "  ".join(format(title, spec.split(".")[0].rstrip("f%")) for title, _, spec in cols)]
    for row in rows:
        lines.append("  ".join(_fmt(row[key], spec) for _, key, spec in cols))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, command: str = "bench") -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    parser.add_argument(
        "--dtypes", nargs="+", default=None,
        help="dense engines to run (default: float32 on a CPU, where bfloat16 decodes ~5x slower; float32 and "
             "bfloat16 on an accelerator)",
    )
    parser.add_argument("--prompts", type=int, default=5, help="number of ChatGPT prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip transformers eager")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def run(args: argparse.Namespace) -> int:
    if args.dtypes is None:
        args.dtypes = ["float32"] if jax.devices()[0].platform == "cpu" else ["float32", "bfloat16"]
    for name in ("prompts", "max_prompt_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rows = bench_engines(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
