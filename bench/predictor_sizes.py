"""Predictor size and recall per layer: adaptive widths against one fixed width (default model).

Protocol: the pack's predictors (widths sized per layer by ``predictor.sizing`` under the pack's
budget: the adaptive set) against predictors of one fixed width for every layer with (nearly) the
same total parameters, trained on the same profile samples with the same settings. Per layer, from
each set's held-out samples at its cut-off: width, parameters, recall of the active neurons,
recall of the strong ones (the largest 10% contributions), precision, and the neurons a token
computes (the predicted fraction: what the sparse mode reads). The fixed set is cached under
$JPINFER_CACHE/bench, so a second run only redraws.

    python bench/predictor_sizes.py --out bench/results/predictor_sizes.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

import jpinfer
from jpinfer.bench.protocol import load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.cache import cache_dir
from jpinfer.errors import ArtifactError
from jpinfer.pack import Pack, pack_for
from jpinfer.predictor import Predictors, SearchConfig, TrainConfig, train_predictors
from jpinfer.predictor.sizing import predictor_params


def fixed_width(model, pack: Pack) -> Predictors:
    """One width for every layer, the total closest to the adaptive set's; trained once, then cached."""
    cfg, adaptive = model.cfg, pack.predictors
    rank = min(range(1, 513), key=lambda r: abs(cfg.n_layers * predictor_params(r, cfg.d_model, cfg.d_ff)
                                                 - adaptive.n_params))
    path = cache_dir("bench") / f"predictor-sizes-{pack.manifest['stages']['predictors']['key'][:16]}-rank{rank}"
    if path.is_dir():
        try:
            return Predictors.load(path, model, pack.profile)
        except ArtifactError as err:
            print(f"training again: {err}", file=sys.stderr)
    s = pack.settings
    config = TrainConfig(recall=s.recall, strong_recall=s.strong_recall, max_epochs=s.max_epochs)
    predictors = train_predictors(model, pack.profile, ranks=rank, config=config, search=SearchConfig())
    predictors.save(path)
    return predictors


def per_layer(predictors: Predictors) -> list[dict]:
    return [{"width": p.rank, "params": p.n_params} | {k: s[k] for k in ("recall", "strong_recall", "precision",
                                                                         "predicted", "active")}
            for p, s in zip(predictors.layers, predictors.meta["held_out_scores"])]


def figure(adaptive: list[dict], fixed: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = np.arange(len(adaptive))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for rows, label, style in ((adaptive, "adaptive widths", "o-"), (fixed, "one fixed width", "s--")):
        left.plot(layers, [r["width"] for r in rows], style, ms=3, label=label)
        right.plot(layers, [r["predicted"] for r in rows], style, ms=3, label=f"{label}: computed")
    right.plot(layers, [r["active"] for r in adaptive], "k:", label="truly active")
    left.set_xlabel("layer")
    left.set_ylabel("predictor width (hidden units)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set_xlabel("layer")
    right.set_ylabel("fraction of neurons per token (held out)")
    right.set_title(f"at held-out recall {adaptive[0]['recall']:.2f}-ish (each layer's cut-off)", fontsize=8)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="pack directory (default: the default model's, built if missing)")
    ap.add_argument("--out", default=None, help="markdown file (JSON and PNG beside it)")
    args = ap.parse_args()
    load_before = load_average()
    model = jpinfer.load_model(None)
    pack = pack_for(model, args.pack)
    fixed_set = fixed_width(model, pack)
    adaptive, fixed = per_layer(pack.predictors), per_layer(fixed_set)
    total = lambda rows: sum(r["params"] for r in rows)
    mean = lambda rows, key: float(np.mean([r[key] for r in rows]))
    command = "python bench/predictor_sizes.py " + " ".join(sys.argv[1:])
    s = pack.settings
    m = machine(load_before)
    lines = [
        "# Predictor size and recall per layer: adaptive against fixed widths (SmolLM2-135M-Instruct)", "",
        f"{command_line(command)}. {machine_line(m)}", "",
        f"Pack `{pack.path.name}`: {s.n_samples} samples per layer "
        f"({pack.predictors.meta['train_config']['held_out']:.0%} "
        f"held out), recall {s.recall}, strong recall {s.strong_recall}, adaptive budget {s.predictor_budget:.0%} of "
        f"the model. Adaptive: {total(adaptive):,} parameters; fixed width {fixed[0]['width']}: {total(fixed):,}.", "",
        "![widths and neurons computed per layer](predictor_sizes.png)", "",
        f"Mean over layers: neurons computed per token {mean(adaptive, 'predicted'):.3f} (adaptive) vs "
        f"{mean(fixed, 'predicted'):.3f} (fixed); held-out recall {mean(adaptive, 'recall'):.4f} vs "
        f"{mean(fixed, 'recall'):.4f}; strong recall {mean(adaptive, 'strong_recall'):.4f} vs "
        f"{mean(fixed, 'strong_recall'):.4f}; truly active {mean(adaptive, 'active'):.3f}.", "",
        "| layer | adaptive width | params | recall | strong recall | precision | computed | fixed: recall | "
        "strong recall | precision | computed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (a, f) in enumerate(zip(adaptive, fixed)):
        lines.append(f"| {i} | {a['width']} | {a['params']:,} | {a['recall']:.4f} | {a['strong_recall']:.4f} | "
                     f"{a['precision']:.3f} | {a['predicted']:.3f} | {f['recall']:.4f} | {f['strong_recall']:.4f} | "
                     f"{f['precision']:.3f} | {f['predicted']:.3f} |")
    data = {"command": command, "date": m["date"], "jax": jax.__version__, "machine": m, "pack": str(pack.path),
            "adaptive": adaptive, "fixed": fixed}
    publish("\n".join(lines) + "\n", args.out, data)
    if args.out:
        figure(adaptive, fixed, pathlib.Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
