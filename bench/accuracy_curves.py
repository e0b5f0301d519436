"""Accuracy against sparsity on the default model: dense, oracle, predictor and threshold modes.

Protocol (everything from one pack: the default model's, or ``--pack``):
- WikiText-2 test perplexity over the first ``--test-windows`` windows of 512 tokens, of what each
  mode's decode step computes (``modes.evaluation.decode_equivalent``);
- x: the FFN weight bytes a decode step reads, as a fraction of the dense FFN's. A perfect
  predictor (the oracle) skips gate, up and down rows of the inactive neurons: 1 - s. The threshold
  mode's activation sparsity computes gate and up for every neuron and skips down rows:
  (2 + (1 - s)) / 3; input sparsity skips gate/up rows of the small inputs: (2 (1 - s) + 1) / 3.
  Predictors skip all three rows of the neurons they do not select (plus their own weights, a few
  percent, not counted);
- oracle: the exact active sets at uniform per-layer thresholds for sparsity s
  (``ffn.perplexity``, ``ScoreMaskFFN``); threshold mode: the same thresholds through the
  threshold engine (so oracle and activation-threshold points have the same perplexity, at
  different bytes), input sparsity, and activation 50% with input sparsity; every threshold comes
  from the pack's calibration histograms (uniform quantiles, no extra pass);
- predictors: the pack's, cut-offs re-chosen for each (recall, strong recall) in ``--points``
  (``predictor.retune``, no retraining), every selected neuron kept (no capacity).

    python bench/accuracy_curves.py --out bench/results/accuracy_curves.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

import jpinfer
from jpinfer.bench.accuracy import wikitext_windows
from jpinfer.bench.protocol import TEST_WINDOWS, load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.ffn import PredictorMaskFFN, evaluate, mask_states, perplexity
from jpinfer.modes import build_engine
from jpinfer.pack import Pack, pack_for
from jpinfer.predictor.fit import retune
from jpinfer.profiler import uniform
from jpinfer.profiler.sparsity import from_histograms


def threshold_point(model, pack: Pack, windows, activation: float | None, input: float | None) -> dict:
    """Perplexity of the threshold mode at uniform thresholds for these targets, and the bytes it reads."""
    thresholds = from_histograms(pack.calibration_histograms(), {"activation": activation, "input": input},
                                 "uniform")
    engine = build_engine(model, "threshold", thresholds=thresholds)
    ppl, _ = evaluate(engine.model, windows, engine.ffn.impl, engine.ffn.state, progress=True)
    s_a, s_i = activation or 0.0, input or 0.0
    return {"method": "threshold", "activation": activation, "input": input, "ppl": ppl,
            "bytes": (2 * (1 - s_i) + (1 - s_a)) / 3}


def oracle_point(model, pack: Pack, windows, sparsity: float) -> dict:
    """Perplexity with the exact active sets at uniform thresholds for ``sparsity`` (a perfect predictor)."""
    cal = uniform(pack.calibration_histograms()["activation"], sparsity)
    return {"method": "oracle", "activation": sparsity, "ppl": perplexity(model, windows, cal, progress=True),
            "bytes": 1 - sparsity}


def predictor_point(model, pack: Pack, windows, recall: float, strong: float) -> dict:
    predictors = retune(model, pack.predictors, pack.profile, recall, strong)
    impl = PredictorMaskFFN(model.cfg)
    ppl, sums = evaluate(model, windows, impl, mask_states(predictors.layers, pack.profile.thresholds), progress=True)
    computed = float(np.mean([layer["predicted"] for layer in sums])) / (windows.size * model.cfg.d_ff)
    return {"method": "predictor", "recall": recall, "strong_recall": strong, "ppl": ppl, "bytes": computed}


def figure(rows: list[dict], dense: float, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    styles = {"oracle": "o-", "predictor": "s-", "threshold activation": "^-", "threshold input": "v-",
              "threshold activation 50% + input": "D-"}
    for label, style in styles.items():
        points = sorted((r["bytes"], r["ppl"]) for r in rows if _series(r) == label)
        if points:
            ax.plot(*zip(*points), style, label=label, ms=4)
    ax.axhline(dense, color="k", lw=1, ls=":", label=f"dense ({dense:.2f})")
    ax.axhline(1.05 * dense, color="gray", lw=1, ls="--", label="1.05 x dense")
    ax.set_xlabel("FFN weight bytes read per decoded token (fraction of dense)")
    ax.set_ylabel("WikiText-2 test perplexity")
    ax.set_ylim(dense * 0.98, dense * 1.6)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _series(row: dict) -> str:
    if row["method"] != "threshold":
        return row["method"]
    if row.get("input") is None:
        return "threshold activation"
    return "threshold input" if row.get("activation") is None else "threshold activation 50% + input"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="pack directory (default: the default model's, built if missing)")
    ap.add_argument("--test-windows", type=int, default=TEST_WINDOWS, help="WikiText-2 test windows of 512 tokens")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--input-sparsities", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    ap.add_argument("--points", default="0.8/0.99,0.9/0.995,0.95/0.999,0.99/0.999",
                    help="predictor operating points: recall/strong recall, comma separated")
    ap.add_argument("--out", default=None, help="markdown file (JSON and PNG beside it)")
    args = ap.parse_args()
    load_before = load_average()

    model = jpinfer.load_model(None)
    pack = pack_for(model, args.pack)
    windows = wikitext_windows(model.tokenizer, args.test_windows)
    dense = evaluate(model, windows, progress=True)[0]
    rows = []
    for s in args.sparsities:
        rows += [oracle_point(model, pack, windows, s), threshold_point(model, pack, windows, s, None)]
    for s in args.input_sparsities:
        rows.append(threshold_point(model, pack, windows, None, s))
    for s in args.input_sparsities[:2]:
        rows.append(threshold_point(model, pack, windows, 0.5, s))
    for point in args.points.split(","):
        recall, strong = (float(v) for v in point.split("/"))
        rows.append(predictor_point(model, pack, windows, recall, strong))
    for row in rows:
        row["ppl_vs_dense"] = row["ppl"] / dense

    command = "python bench/accuracy_curves.py " + " ".join(sys.argv[1:])
    m = machine(load_before)
    lines = [
        "# Accuracy against sparsity (SmolLM2-135M-Instruct, float32)", "",
        f"{command_line(command)}. {machine_line(m)}", "",
        f"Pack: `{pack.path.name}` ({pack.settings.n_tokens} profiled tokens; activity thresholds for "
        f"{pack.settings.sparsity:.0%}; predictors trained at recall {pack.settings.recall}). WikiText-2 test "
        f"perplexity over {args.test_windows} windows of 512 tokens; dense {dense:.3f}. `bytes`: FFN weight bytes read "
        "per decoded token as a fraction of dense (see the script's docstring).", "",
        "![perplexity against bytes read](accuracy_curves.png)", "",
        "| method | activation s | input s | recall / strong | bytes | perplexity | x dense |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        point = f"{r['recall']} / {r['strong_recall']}" if r["method"] == "predictor" else "-"
        lines.append(f"| {r['method']} | {fmt(r.get('activation'), '.0%')} | {fmt(r.get('input'), '.0%')} | {point} | "
                     f"{r['bytes']:.3f} | {r['ppl']:.3f} | {r['ppl_vs_dense']:.3f} |")
    oracle = {r["activation"]: r["ppl"] for r in rows if r["method"] == "oracle"}
    same = [abs(r["ppl"] / oracle[r["activation"]] - 1) for r in rows
            if _series(r) == "threshold activation" and r["activation"] in oracle]
    lines += ["", f"Oracle and activation-threshold perplexities (the same kept neurons through two code paths) "
                  f"differ by at most {max(same):.1e} (relative)." if same else ""]
    within = [r for r in rows if r["ppl_vs_dense"] <= 1.05]
    if within:
        best = min(within, key=lambda r: r["bytes"])
        lines.append(f"Fewest bytes within 1.05x dense perplexity: {_series(best)} at {best['bytes']:.3f} of the dense "
                     f"FFN's bytes ({best['ppl_vs_dense']:.3f}x).")
    data = {"command": command, "date": m["date"], "jax": jax.__version__, "machine": m, "windows": args.test_windows,
            "dense_ppl": dense, "pack": str(pack.path), "rows": rows}
    publish("\n".join(lines) + "\n", args.out, data)
    if args.out:
        figure(rows, dense, pathlib.Path(args.out).with_suffix(".png"),
               f"SmolLM2-135M-Instruct, WikiText-2 test ({args.test_windows} x 512 tokens)")


if __name__ == "__main__":
    main()
