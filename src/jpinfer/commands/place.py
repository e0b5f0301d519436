"""jpinfer place: place neurons for a model shape and compare the methods.

Frequencies come from a (n_layers, d_ff) .npy file or a synthetic Zipf-like law.
Example (Llama-2-7B fp16 on an RTX 2080 Ti, 4096-token KV cache):
    jpinfer place --shape llama2-7b --hardware rtx2080ti --context 4096
Exit status 2 for bad input, 3 when no placement fits the memory budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jpinfer.solver.frequencies import load_frequencies, synthetic_frequencies
from jpinfer.solver.hardware import NUMERIC_FIELDS, PRESETS, measure_hardware, preset
from jpinfer.solver.memory import InfeasibleBudgetError
from jpinfer.solver.shapes import RUNS, SHAPES
from jpinfer.solver.solve import solve_placement


def add_arguments(p: argparse.ArgumentParser, command: str = "place") -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    p.add_argument("--layers", type=int, help="override the shape's number of layers")
    p.add_argument("--d-ff", type=int, help="override the shape's FFN width")
    p.add_argument("--hardware", default="rtx2080ti", help=f"preset ({', '.join(PRESETS)}) or 'measure'")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help=f"override a hardware field ({', '.join(NUMERIC_FIELDS)}); bytes, bytes/s, seconds",
    )
    p.add_argument("--budget-gib", type=float, help="accelerator memory in GiB (sets accel_memory)")
    p.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per weight (0.5625 for 4.5-bit)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--predictor-bytes", type=int, default=0, help="predictor bytes per layer")
    p.add_argument("--freq", help="(n_layers, d_ff) .npy of activation frequencies (count / tokens)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the synthetic frequencies")
    p.add_argument("--mean-active", type=float, default=0.1, help="mean activation rate of the synthetic law")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="mass,latency,greedy,layers", help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--mip-gap", type=float, default=1e-3)
    p.add_argument("--save", help="directory; each run's placement is saved under DIR/<run>")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")


def _hardware(args: argparse.Namespace):
    hw = measure_hardware() if args.hardware == "measure" else preset(args.hardware)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}")
        overrides[name] = float(value)
    if args.budget_gib is not None:
        overrides["accel_memory"] = args.budget_gib * 2**30
    return hw.replace(**overrides)


def run(args: argparse.Namespace) -> int:
    try:
        runs = [r.strip() for r in args.runs.split(",") if r.strip()]
        unknown = [r for r in runs if r not in RUNS]
        if unknown:
            raise ValueError(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
        cfg = SHAPES[args.shape]
        if args.layers or args.d_ff:
            cfg = dataclasses.replace(cfg, n_layers=args.layers or cfg.n_layers, d_ff=args.d_ff or cfg.d_ff)
        hw = _hardware(args)
        if args.freq:
            freqs = load_frequencies(args.freq)
        else:
            freqs = synthetic_frequencies(
                cfg.n_layers, cfg.d_ff, skew=args.skew, mean_active=args.mean_active, seed=args.seed
            )
        results = {}
        for run in runs:
            method, objective = RUNS[run]
            results[run] = solve_placement(
                freqs, cfg, hw, objective=objective, method=method, group_size=args.group_size,
                time_limit=args.time_limit, mip_gap=args.mip_gap, weight_bytes=args.weight_bytes,
                context=args.context, batch=args.batch, predictor_bytes=args.predictor_bytes,
            )
            if args.save:
                results[run].save(f"{args.save}/{run}")
    except (ValueError, OSError) as error:  # InfeasibleBudgetError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2 if not isinstance(error, InfeasibleBudgetError) else 3
    _report(results, args.json)
    return 0


def _report(results: dict, as_json: bool) -> None:
    best = min(p.per_token_time for p in results.values())
    if as_json:
        for run, p in results.items():
            print(json.dumps({"run": run, **p.summary()}))
        return
    header = (f"{'run':8} {'share':>7} {'ms/token':>9} {'vs best':>8} {'neurons':>9} {'split':>5} {'GiB':>7} "
              f"{'status':>10} {'gap':>8} {'solve s':>8}")
    print(header)
    for run, p in results.items():
        s = p.summary()
        gap = "-" if s["gap"] is None else f"{s['gap']:.2e}"
        print(
            f"{run:8} {s['accel_share']:7.4f} {s['per_token_time_ms']:9.3f} {p.per_token_time / best:8.4f} "
            f"{s['accel_neurons']:9d} {s['layers_split']:5d} {s['memory_used_gib']:7.3f} {s['status']:>10} "
            f"{gap:>8} {s['solve_time_s']:8.2f}"
        )

