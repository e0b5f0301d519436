"""Model-wide threshold sparsity on the default model: the FFN's kinds alone against the FFN's and the attention's
(q|k|v and output products' inputs), uniform against the model-wide greedy allocation, at equal bytes read.

Protocol (CPU; float32 weights, or ``--weights int8`` / ``int4``: that model's own thresholds; int4 reads the
matrices it skips rows of as int8 copies of its 4-bit blocks, ``sparse.threshold_layout``, and the bytes say so):
- calibration: histograms of |a|, |x| of the FFN input and of the attention products' inputs over
  ``--calibration-windows`` windows of 512 tokens of WikiText-2 *valid*; greedy allocations estimate each
  (layer, kind)'s loss increase on the next as many valid windows (never on test text);
- points (``--points``): ``ffn:A+I`` activation A and input I uniform (FFN only); ``all:A+I+Q`` the same plus
  attention Q uniform; ``ffn-greedy:T`` / ``all-greedy:T``: model-wide greedy over the FFN's kinds / over every
  kind, skipping the fraction T of those matrices' bytes (``profiler.sparsity.model_wide_greedy``: of the Fisher
  allocation over (layer, kind), the measured one over kinds and uniform, the least held-out loss); one more
  ``+H`` on an ``all`` or greedy point: the head skips the fraction H of its inputs too (its quantile);
- quality: WikiText-2 test perplexity (``--test-windows`` x 512 tokens) of exactly what the engine computes
  (``ffn.evaluate`` with the threshold mode's layer states, attention products included);
- bytes: weight bytes a decode step reads, all weights but the embedding table (the tied head included), as a
  fraction of dense: a matrix read by rows counts the bytes of its by-rows form (float32 or int8) times the
  fraction of its rows kept, that fraction measured on the test text (histograms of the test text read at each
  threshold, to their 1.6%-wide bins), in place of its bytes as loaded;
- speed: decode tok/s of dense and of the ``--speed`` points (default: per family, the fewest bytes within
  ``--ppl-bound`` x dense perplexity), ``--rounds`` interleaved rounds over
  ``--prompts`` ChatGPT prompts x ``--new-tokens`` (``bench.engines.speed_rounds``), medians of same-round ratios;
- where the model-wide greedy put the sparsity: per layer and kind, for its point of fewest bytes within the bound.

    python bench/model_wide.py --out bench/results/model_wide.md
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np

import jpinfer
from jpinfer.bench.accuracy import calibration_windows, wikitext_windows
from jpinfer.bench.engines import JaxEngine, decode_tok_s, speed_rounds, weights_read_per_token
from jpinfer.bench.protocol import TEST_WINDOWS, load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.data import chatgpt_prompts
from jpinfer.ffn import ThresholdRowsFFN, evaluate
from jpinfer.models.params import nbytes
from jpinfer.modes import build_engine
from jpinfer.modes.engines import threshold_states
from jpinfer.profiler import calibration, sparsity

WINDOW = 512


def parse(point: str) -> tuple[str, dict[str, float]]:
    """'ffn:0.5+0.3' -> ('ffn', {'activation': 0.5, 'input': 0.3}); 'all:0.5+0.3+0.3' adds attention 0.3 (and
    '+0.2' after it head 0.2); 'all-greedy:0.4' -> ('all-greedy', {'model_wide': 0.4}) ('all-greedy:0.4+0.2':
    and head 0.2)."""
    family, values = point.split(":")
    numbers = [float(v) for v in values.split("+")]
    names = ("model_wide", sparsity.HEAD) if family.endswith("greedy") else ("activation", "input", "attention",
                                                                             sparsity.HEAD)
    if len(numbers) > len(names) or family == "ffn" and len(numbers) > 2:
        raise SystemExit(f"point {point!r}: too many numbers (see --help)")
    return family, dict(zip(names, numbers))


def thresholds_for(family, spec, hists, model, heldout, sens) -> sparsity.SparsityThresholds:
    head = spec.get(sparsity.HEAD)
    if family.endswith("greedy"):  # ffn-greedy: the same allocation over the FFN's kinds only
        kinds = sparsity.FFN_KINDS if family == "ffn-greedy" else sparsity.KINDS
        wide = sparsity.model_wide_greedy(model, hists, spec["model_wide"], heldout, kinds=kinds,
                                          sensitivities={kind: sens[kind] for kind in kinds}, progress=True)
        return sparsity.with_head(wide, hists, head)
    targets = {"activation": spec.get("activation"), "input": spec.get("input"),
               "qkv": spec.get("attention"), "o": spec.get("attention"), sparsity.HEAD: head}
    return sparsity.from_histograms(hists, targets, "uniform")


MATRICES = {"activation": "w_down", "input": "w_gate_up", "qkv": "w_qkv", "o": "wo"}  # the matrix each kind reads


def kept_bytes(th: sparsity.SparsityThresholds, test_hists, loaded_bytes: dict[str, list[int]],
               row_bytes: dict[str, int], head_bytes: int, total: int) -> float:
    """Bytes a decode step reads as a fraction of dense: per kind on, each layer's matrix as loaded
    (``loaded_bytes``) replaced by its by-rows form (``row_bytes``) times the rows kept on the test text; the
    head's ``head_bytes`` (read by input rows as loaded) times its rows kept."""
    read = float(total)
    for kind, per_layer in loaded_bytes.items():
        values = getattr(th, kind)
        if values is not None:
            for layer, t in enumerate(values):
                kept = 1.0 - test_hists[kind].fraction_at_most(layer, float(t))
                read += row_bytes[kind] * kept - per_layer[layer]
    if th.head is not None:
        read -= head_bytes * test_hists[sparsity.HEAD].fraction_at_most(0, th.head)
    return read / total


def figure(rows: list[dict], path: pathlib.Path, bound: float) -> None:
    """Perplexity (x dense) against the bytes read (x dense), one series per family of points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    labels = {"ffn": "FFN only, uniform", "all": "FFN + attention, uniform", "ffn-greedy": "FFN only, greedy",
              "all-greedy": "model-wide greedy (FFN + attention)"}
    for family, label in labels.items():
        points = sorted((r["bytes_ratio"], r["ppl_ratio"]) for r in rows if r["family"] == family)
        if points:
            ax.plot(*zip(*points), "o-" if family.startswith("all") else "s--", label=label)
    ax.axhline(bound, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("weight bytes read per decoded token (x dense, all weights)")
    ax.set_ylabel("WikiText-2 test perplexity (x dense)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="ffn:0.5+0.2,ffn:0.5+0.3,ffn:0.6+0.3,all:0.5+0.2+0.2,all:0.5+0.3+0.3,"
                                            "all:0.6+0.3+0.3,ffn-greedy:0.35,ffn-greedy:0.45,all-greedy:0.3,"
                                            "all-greedy:0.4,all-greedy:0.5")
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--test-windows", type=int, default=TEST_WINDOWS)
    parser.add_argument("--ppl-bound", type=float, default=1.05)
    parser.add_argument("--speed", default=None, help="points to time (default: the fewest bytes within the bound)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weights", choices=("float", "int8", "int4"), default="float")
    parser.add_argument("--out", default=None, help="markdown file (a .json with the rows is written beside it)")
    args = parser.parse_args()

    load_before = load_average()
    dense = jpinfer.load(weights=args.weights)
    cfg = dense.cfg
    n_cal = args.calibration_windows
    valid = calibration_windows(dense.tokenizer, n_cal)
    test = wikitext_windows(dense.tokenizer, args.test_windows)
    dense_ppl, _ = evaluate(dense, test, progress=True)
    hists = sparsity.histograms(dense, valid[:n_cal], progress=True)
    test_hists = sparsity.histograms(dense, test, progress=True)
    points = [(text, *parse(text)) for text in args.points.split(",")]
    sens = {}
    if any(family.endswith("greedy") for _, family, _ in points):
        sens = {kind: calibration.sensitivity(dense, valid[n_cal:], hists[kind], progress=True)
                for kind in sparsity.KINDS}

    sizes = sparsity.matrix_sizes(cfg)
    loaded_bytes = {kind: [nbytes(getattr(layer, name)) for layer in dense.weights.layers]
                    for kind, name in MATRICES.items()}
    row_bytes = {kind: sizes[kind] * (4 if args.weights == "float" else 1) for kind in sparsity.KINDS}
    total = weights_read_per_token(dense)
    if args.weights != "float" and any(sparsity.HEAD in spec for _, _, spec in points):
        raise SystemExit("head sparsity reads fewer rows of a float head only (int8 and int4 heads are read whole)")
    rows, chosen = [], {}
    for text, family, spec in points:
        th = thresholds_for(family, spec, hists, dense, valid[n_cal:], sens)
        ppl, _ = evaluate(dense, test, ThresholdRowsFFN(head_threshold=th.head), threshold_states(dense.model, th),
                          progress=True)
        rows.append(dict(point=text, family=family, describe=th.describe(), ppl=ppl, ppl_ratio=ppl / dense_ppl,
                         bytes_ratio=kept_bytes(th, test_hists, loaded_bytes, row_bytes,
                                                nbytes(dense.weights.head), total),
                         layer_sparsity={k: [float(v) for v in s] for k, s in th.layer_sparsity.items()},
                         allocation=th.meta.get("allocation"), held_out_loss=th.meta.get("held_out_loss")))
        chosen[text] = th
        print(rows[-1]["describe"], f"ppl x{rows[-1]['ppl_ratio']:.3f} bytes x{rows[-1]['bytes_ratio']:.3f}",
              flush=True)

    within = [r for r in rows if r["ppl_ratio"] <= args.ppl_bound]
    if args.speed:
        timed = args.speed.split(",")
    else:  # per family, the fewest bytes within the bound
        best = [min((r for r in within if r["family"] == family), key=lambda r: r["bytes_ratio"], default=None)
                for family in ("ffn", "all", "ffn-greedy", "all-greedy")]
        timed = [r["point"] for r in best if r]
    engines = {"dense": JaxEngine("dense", dense)}
    for text in timed:
        engines[text] = JaxEngine(text, build_engine(dense.model, "threshold", thresholds=chosen[text]))
    prompts = [dense.encode_prompt(t, chat=True)[:128] for t in chatgpt_prompts()[: args.prompts]]
    measured, loads = speed_rounds(engines, prompts, args.new_tokens, args.rounds)
    speed = {name: measured.median(name, decode_tok_s) for name in engines}
    for row in rows:
        if row["point"] in engines:
            ratios = measured.ratios(row["point"], "dense", decode_tok_s)
            row.update(tok_s=speed[row["point"]], speedup=statistics.median(ratios),
                       speedup_range=[min(ratios), max(ratios)])

    lines = [
        "# Model-wide threshold sparsity (FFN and attention) against the FFN alone, default model"
        + ("" if args.weights == "float" else f", {args.weights} weights"),
        "",
        f"{machine_line(machine(load_before))} Load average {min(loads):.1f}-{max(loads):.1f} during the speed "
        "rounds. " + command_line(
            f"python bench/model_wide.py --points {args.points} --calibration-windows {n_cal} --test-windows "
            f"{args.test_windows} --rounds {args.rounds} --prompts {args.prompts} --new-tokens {args.new_tokens}"
            + ("" if args.speed is None else f" --speed {args.speed}")
            + ("" if args.weights == "float" else f" --weights {args.weights}")),
        "",
        f"Dense: WikiText-2 test perplexity {dense_ppl:.2f} ({args.test_windows} x {WINDOW} tokens), decode "
        f"{speed['dense']:.1f} tok/s (median of {args.rounds} interleaved rounds). Thresholds calibrated on "
        f"WikiText-2 valid; greedy allocations held out on the next {n_cal} valid windows.",
        "",
        f"Bytes: what a decode step reads of the {total / 2**20:.0f} MiB of weights (all but the embedding table; "
        "the tied head included) as a fraction of dense, each matrix's kept rows measured on the test text. "
        "Decode 'x dense' is the median of same-round ratios (range beside it).",
        "",
        "| point | thresholds | perplexity | x dense | bytes x dense | decode tok/s | x dense | range |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        timing = (f"{row['tok_s']:.1f} | {row['speedup']:.2f} | {row['speedup_range'][0]:.2f}-"
                  f"{row['speedup_range'][1]:.2f}") if "tok_s" in row else "- | - | -"
        lines.append(f"| {row['point']} | {row['describe']} | {row['ppl']:.2f} | {row['ppl_ratio']:.3f} | "
                     f"{row['bytes_ratio']:.3f} | {timing} |")
    for label, pick in (("FFN only", "ffn"), ("model-wide", "all")):
        best = min((r for r in within if r["family"].startswith(pick)), key=lambda r: r["bytes_ratio"], default=None)
        lines += ["", f"Fewest bytes within {args.ppl_bound}x dense perplexity, {label}: "
                  + (f"`{best['point']}` at {best['bytes_ratio']:.3f} of dense ({best['ppl_ratio']:.3f}x)."
                     if best else "none.")]
    choices = [r for r in rows if r["held_out_loss"]]
    if choices:
        names = list(choices[0]["held_out_loss"])
        lines += ["", "The greedy points' candidate allocations: mean next-token NLL on the held-out valid windows "
                  "(the least is kept):", "", "| point | " + " | ".join(names) + " | kept |",
                  "|---|" + "---|" * (len(names) + 1)]
        lines += [f"| {r['point']} | " + " | ".join(f"{r['held_out_loss'][n]:.4f}" for n in names)
                  + f" | {r['allocation']} |" for r in choices]
    greedy = [r for r in rows if r["family"] == "all-greedy"]
    if greedy:
        shown = min((r for r in greedy if r in within), key=lambda r: r["bytes_ratio"], default=greedy[0])
        per_layer = {k: v for k, v in shown["layer_sparsity"].items() if k != sparsity.HEAD}
        lines += ["", f"Where `{shown['point']}` put the sparsity (fraction of each matrix's rows skipped on the "
                  "calibration text):", "", "| layer | " + " | ".join(per_layer) + " |",
                  "|---|" + "---|" * len(per_layer)]
        for i in range(cfg.n_layers):
            lines.append(f"| {i} | " + " | ".join(f"{v[i]:.0%}" for v in per_layer.values()) + " |")
        lines.append("| mean | " + " | ".join(f"{np.mean(v):.0%}" for v in per_layer.values()) + " |")
    if args.out:
        figure(rows, pathlib.Path(args.out).with_suffix(".png"), args.ppl_bound)
        lines[2:2] = [f"![perplexity against bytes]({pathlib.Path(args.out).with_suffix('.png').name})", ""]
    publish("\n".join(lines) + "\n", args.out,
            {"weights": args.weights, "dense_ppl": dense_ppl, "dense_tok_s": speed["dense"], "rows": rows,
             "loads": loads, "machine": machine(load_before)})


if __name__ == "__main__":
    main()
