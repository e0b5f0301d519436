"""Decode speed against sparsity and against the accelerator budget, measured on this CPU.

Protocol (everything from one pack: the default model's, or ``--pack``):
- engines: dense; the threshold mode at activation sparsities ``--sparsities`` (uniform
  thresholds from the pack's calibration histograms); the predictor-driven sparse mode at the
  operating points ``--points`` (recall / strong recall, ``predictor.retune``; capacity: what the
  retuned predictors pick, 0.99 quantile); the hybrid at GPU budgets ``--budgets`` (fractions of the
  model's bytes; placement solved for each), on two simulated CPU devices (device 0 plays the GPU);
- ``--prompts`` prompts of 64 tokens (the bench's sampler), 64 greedy tokens each, every engine in
  turn, ``--rounds`` interleaved rounds; decode tok/s: all steps of a round over their time, median
  over rounds; x dense: median of same-round ratios; the load average before and after;
- bytes: the FFN weight bytes a decode step reads as a fraction of dense (threshold: (3 - s) / 3,
  gate and up are read whole; predictors: the neurons they select on held-out samples).
On this 2-core CPU the simulated devices share the cores, so the hybrid column measures the split's
overheads, not a GPU's speed (``bench/modelled_speed.py`` models that).

    python bench/decode_speed.py --out bench/results/decode_speed.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402

import jpinfer  # noqa: E402
from jpinfer.bench.engines import JaxEngine, decode_tok_s, speed_rounds  # noqa: E402
from jpinfer.bench.prompts import sample_prompts  # noqa: E402
from jpinfer.bench.protocol import load_average, machine, machine_line  # noqa: E402
from jpinfer.bench.results import command_line, publish  # noqa: E402
from jpinfer.modes import build_engine  # noqa: E402
from jpinfer.pack import Pack, pack_for  # noqa: E402
from jpinfer.predictor.fit import retune  # noqa: E402
from jpinfer.profiler.sparsity import from_histograms  # noqa: E402

NEW_TOKENS = 64


def engines(model, pack: Pack, args) -> list[dict]:
    """Every engine of the protocol with what it is (kind, setting, bytes read)."""
    out = [{"kind": "dense", "setting": "-", "bytes": 1.0, "engine": jpinfer.Engine(model)}]
    hists = pack.calibration_histograms()
    for s in args.sparsities:
        thresholds = from_histograms(hists, {"activation": s, "input": None}, "uniform")
        out.append({"kind": "threshold", "setting": f"activation {s:.0%}", "sparsity": s, "bytes": (3 - s) / 3,
                    "engine": build_engine(model, "threshold", thresholds=thresholds)})
    for point in args.points.split(","):
        recall, strong = (float(v) for v in point.split("/"))
        predictors = retune(model, pack.predictors, pack.profile, recall, strong)
        computed = float(np.mean([s["predicted"] for s in predictors.meta["held_out_scores"]]))
        out.append({"kind": "sparse", "setting": f"recall {recall} / {strong}", "bytes": computed,
                    "engine": build_engine(model, "sparse", predictors=predictors, profile=pack.profile)})
    computed = float(np.mean([s["predicted"] for s in pack.predictors.meta["held_out_scores"]]))
    with jax.default_device(jax.devices("cpu")[1]):  # as jpinfer.load does: the accelerator gets only its share
        host_model = jpinfer.load_model(None)
    for budget in args.budgets:
        out.append({"kind": "hybrid", "setting": f"budget {budget:.0%}", "budget": budget, "bytes": computed,
                    "engine": build_engine(host_model, "hybrid", predictors=pack.predictors, profile=pack.profile,
                                           gpu_budget=budget)})
    return out


def figure(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for kind, style in (("threshold", "^-"), ("sparse", "s-")):
        points = sorted((r["bytes"], r["vs_dense"]) for r in rows if r["kind"] == kind)
        left.plot(*zip(*points), style, label=f"{kind} (measured)")
    x = np.linspace(0.3, 1, 50)
    left.plot(x, 1 / x, "k:", lw=1, label="bytes-bound ideal (1 / bytes)")
    left.axhline(1, color="gray", lw=1)
    left.set_xlabel("FFN weight bytes read per token (fraction of dense)")
    left.set_ylabel("decode speed, x dense")
    left.set_title("one CPU device", fontsize=9)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    points = sorted((r["budget"], r["vs_dense"]) for r in rows if r["kind"] == "hybrid")
    right.plot(*zip(*points), "o-", label="hybrid (measured, 2 simulated CPU devices)")
    right.axhline(1, color="gray", lw=1)
    right.set_xlabel("GPU budget (fraction of the model's bytes)")
    right.set_ylabel("decode speed, x dense")
    right.set_title("hybrid on two simulated CPU devices: the split's overheads", fontsize=9)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="pack directory (default: the default model's, built if missing)")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--points", default="0.8/0.99,0.9/0.995,0.99/0.999", help="predictor recall/strong recall points")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.6, 0.75, 0.9])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="markdown file (JSON and PNG beside it)")
    args = ap.parse_args()

    model = jpinfer.load_model(None)
    pack = pack_for(model, args.pack)
    rows = engines(model, pack, args)
    prompts = sample_prompts(model.tokenizer, [64], args.prompts, seed=0)[64]
    runners = {str(e): JaxEngine(f"{r['kind']} {r['setting']}", r.pop("engine")) for e, r in enumerate(rows)}
    load_before = load_average()
    measured, _ = speed_rounds(runners, prompts, NEW_TOKENS, args.rounds)
    rates = np.array([measured.values(e, decode_tok_s) for e in runners]).T  # (rounds, engines)
    for e, row in zip(runners, rows):
        row["decode_tok_s"] = float(measured.median(e, decode_tok_s))
        row["vs_dense"] = float(measured.median_ratio(e, "0", decode_tok_s))
    m = machine(load_before)

    command = "python bench/decode_speed.py " + " ".join(sys.argv[1:])
    lines = [
        "# Decode speed against sparsity and budget, measured on this CPU (SmolLM2-135M-Instruct, float32)", "",
        f"{command_line(command)}. {machine_line(m)}", "",
        f"Pack: `{pack.path.name}`. {args.prompts} prompts of 64 tokens x {NEW_TOKENS} greedy tokens per engine and "
        f"round, {args.rounds} interleaved rounds (the order rotating); tok/s: median over rounds; x dense: median "
        "of same-round ratios. "
        "The hybrid runs on two simulated CPU devices sharing the same two cores: it measures the split's "
        "overheads, not a GPU (modelled GPU speeds: modelled_speed.md).", "",
        "![decode speed](decode_speed.png)", "",
        "| engine | setting | FFN bytes read (x dense) | decode tok/s | x dense |", "|---|---|---|---|---|",
    ]
    for r in rows:
        read = "-" if r["bytes"] is None else f"{r['bytes']:.3f}"
        lines.append(f"| {r['kind']} | {r['setting']} | {read} | {r['decode_tok_s']:.1f} | {r['vs_dense']:.2f} |")
    data = {"command": command, "date": m["date"], "jax": jax.__version__, "machine": m,
            "load_before": m["load_before"], "load_after": m["load_after"], "rows": rows, "rates": rates.tolist()}
    publish("\n".join(lines) + "\n", args.out, data)
    if args.out:
        figure(rows, pathlib.Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
