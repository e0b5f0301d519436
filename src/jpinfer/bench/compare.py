"""jpinfer bench (python -m jpinfer.bench): engines side by side on real prompts, with ratios.

Prints one table: prefill and decode speed, per-token latency percentiles, the share of
the machine's measured read bandwidth the decode reaches, host overhead per step, speed
relative to the first engine (dense float32) and greedy agreement with it. Peers, when
installed: llama.cpp (extra ``peers``) on a float32 GGUF of the same weights and on the
original file, and transformers' PyTorch eager model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys

import jax
import numpy as np

from jpinfer.bench.machine import matvec_read_bandwidth
from jpinfer.cli_args import add_mode_arguments, mode_options, prepare_devices
from jpinfer.config import WEIGHT_FORMATS

PEERS = ("llama.cpp", "transformers")


def _prompts(engine, n: int, max_tokens: int) -> list[list[int]]:
    from jpinfer.data import chatgpt_prompts

    texts = chatgpt_prompts()[:n]
    return [engine.encode_prompt(t, chat=True)[:max_tokens] for t in texts]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} cores"


def _engines(args: argparse.Namespace) -> list:
    """The jpinfer engines, then the peers that are asked for and installed."""
    import jpinfer
    from jpinfer.bench.engines import JaxEngine, TransformersEager
    from jpinfer.bench.llama_cpp import INSTALL_MESSAGE, LlamaCppEngine, float32_gguf

    engines = [JaxEngine(f"jpinfer {mode} {dtype}" + (" int8 weights" if weights == "int8" else ""),
                         jpinfer.load(args.model, dtype=dtype, mode=mode, weights=weights, **mode_options(args)))
               for mode in args.modes for dtype in args.dtypes for weights in args.weights]
    source = pathlib.Path(engines[0].engine.source)
    if "llama.cpp" in args.peers:
        if not LlamaCppEngine.available():
            print(f"skipping llama.cpp: {INSTALL_MESSAGE}", file=sys.stderr)
        elif source.is_dir():
            print("skipping llama.cpp: it reads GGUF files and the model is a Hugging Face directory", file=sys.stderr)
        else:
            print("writing (once, cached) a float32 GGUF of the same weights for llama.cpp ...", file=sys.stderr)
            engines.append(LlamaCppEngine(float32_gguf(source), n_threads=args.threads))
            original = LlamaCppEngine(source, n_threads=args.threads)
            if original.name != engines[-1].name:  # the file itself, unless it is float32 already
                engines.append(original)
    if "transformers" in args.peers:
        if TransformersEager.available():
            engines.append(TransformersEager(str(source)))
        else:
            print("skipping transformers eager: PyTorch is not installed (pip install 'jpinfer[bench]')", file=sys.stderr)
    return engines


def bench_engines(args: argparse.Namespace) -> list[dict]:
    """Every engine on every prompt, interleaved (round r: prompt p: each engine in turn), so
    that machine load hits all engines alike; ratios are taken within each round."""
    print("measuring XLA matvec read bandwidth ...", file=sys.stderr)
    bandwidth = matvec_read_bandwidth()
    engines = _engines(args)
    prompts = _prompts(engines[0].engine, args.prompts, args.max_prompt_tokens)
    load_before = _load_average()
    for bench_engine in engines:  # compile and warm caches outside the timed rounds
        print(f"warming up {bench_engine.name} ...", file=sys.stderr)
        for p in prompts:
            bench_engine.run(p, 2)
    runs = [[[] for _ in prompts] for _ in engines]  # engine -> prompt -> one RunStats per round
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr)
        for i, p in enumerate(prompts):
            for e, bench_engine in enumerate(engines):
                runs[e][i].append(bench_engine.run(p, args.max_new_tokens))

    def decode_tps(e: int, r: int) -> float:
        steps = np.concatenate([runs[e][i][r].step_s for i in range(len(prompts))])
        return len(steps) / steps.sum()

    rows = []
    reference_tokens = [runs[0][i][0].tokens for i in range(len(prompts))]
    for e, bench_engine in enumerate(engines):
        all_runs = [run for per_prompt in runs[e] for run in per_prompt]
        steps = np.concatenate([run.step_s for run in all_runs])
        tps = float(np.median([decode_tps(e, r) for r in range(args.rounds)]))
        tokens = [runs[e][i][0].tokens for i in range(len(prompts))]
        rows.append(
            dict(
                engine=bench_engine.name,
                prefill_tok_s=sum(run.n_prompt for run in all_runs) / sum(run.prefill_s for run in all_runs),
                ttft_ms=1e3 * float(np.median([run.prefill_s for run in all_runs])),
                decode_tok_s=tps,
                p50_ms=1e3 * float(np.percentile(steps, 50)),
                p99_ms=1e3 * float(np.percentile(steps, 99)),
                bandwidth_fraction=(bench_engine.weight_bytes_per_token * tps / bandwidth)
                if bench_engine.weight_bytes_per_token else None,
                host_overhead=bench_engine.host_overhead(prompts[0], args.max_new_tokens),
                decode_vs_first=float(np.median([decode_tps(e, r) / decode_tps(0, r) for r in range(args.rounds)])),
                greedy_agreement=float(np.mean([_prefix_agreement(a, b) for a, b in zip(tokens, reference_tokens)])),
                peak_rss_mb=_peak_rss_mb(),
            )
        )
    print(_table(rows, bandwidth, args, load_before))
    return rows


def _prefix_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of greedy tokens equal to the reference before the first divergence."""
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same / max(n, 1)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(rows: list[dict], bandwidth: float, args: argparse.Namespace, load_before: str) -> str:
    header = (
        f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}; {args.prompts} ChatGPT prompts "
        f"(chat template, <= {args.max_prompt_tokens} tokens), {args.max_new_tokens} new tokens, greedy, "
        f"{args.rounds} interleaved rounds (decode tok/s and x decode: median over rounds);\n"
        f"XLA matvec read bandwidth {bandwidth / 1e9:.1f} GB/s; jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"before: {load_before}; after: {_load_average()}"
    )
    cols = [
        ("engine", "engine", "<38"), ("prefill tok/s", "prefill_tok_s", ">13.1f"), ("TTFT ms", "ttft_ms", ">8.1f"),
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
        help="dense engines to run (default: float32 on a CPU, where bfloat16 decodes 5-8x slower; float32 and "
             "bfloat16 on an accelerator)",
    )
    parser.add_argument("--weights", nargs="+", choices=WEIGHT_FORMATS, default=["float"],
                        help="weight formats to run each mode with (int8: modes dense and threshold)")
    add_mode_arguments(parser, modes=True)
    parser.add_argument("--prompts", type=int, default=5, help="number of ChatGPT prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all prompts and engines")
    parser.add_argument(
        "--peers", nargs="*", choices=PEERS, default=list(PEERS),
        help="peer engines to run when installed (default: all; llama.cpp needs the 'peers' extra)",
    )
    parser.add_argument("--no-peers", dest="peers", action="store_const", const=[], help="run jpinfer only")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all cores)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def run(args: argparse.Namespace) -> int:
    from jpinfer.modes import check_mode_arguments

    for mode in args.modes:  # before any model loads
        for weights in args.weights:
            check_mode_arguments(mode, args.predictors, args.profile, args.gpu_budget, None,
                                 mode_options(args)["thresholds"], weights)
    prepare_devices(args.modes)
    if args.dtypes is None:
        args.dtypes = ["float32"] if jax.devices()[0].platform == "cpu" else ["float32", "bfloat16"]
    for name in ("prompts", "max_prompt_tokens", "max_new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rows = bench_engines(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
