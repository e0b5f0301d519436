"""Activation predictors on the default model: training time, sizes, quality end to end, cost.

Protocol:
- profile: WikiText-2 valid, 131072 tokens (the profiler's default), uniform thresholds for
  50% sparsity, ``--samples`` predictor samples per layer (cached under $JPINFER_CACHE/bench);
- ``train_predictors`` with its defaults (adaptive widths, recall 0.99, budget 10% of the
  model), timed; then every layer at one fixed width with the same total parameters;
- quality: WikiText-2 test perplexity (the first ``--test-windows`` windows of 512 tokens, as
  bench/sparsity_ppl.py) of the model computing only the predicted neurons
  (``PredictorMaskFFN``), with the cut-offs re-chosen for each operating point in ``--points``
  (recall of active neurons / recall of the strong ones, the largest 10% contributions; no
  retraining), next to dense and to the oracle (exact active sets, uniform thresholds) at
  the same mean number of computed neurons per token; test-text recall per layer (the
  fixed-width predictors at the first and last point only, without the oracle);
- greedy tokens against dense on ``--prompts`` ChatGPT prompts at the best operating point;
- cost: decode step time with predictors (the masked FFN: dense FFN + predictor + mask, an
  upper bound on the predictor's own cost) against the dense step, interleaved rounds.

    python bench/predictors.py --out bench/results/predictors.md
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

import jpinfer
from jpinfer.bench.accuracy import WINDOW, cached_profile, trained, wikitext_windows
from jpinfer.bench.protocol import (
    TEST_WINDOWS,
    interleaved_rounds,
    load_average,
    machine,
    machine_line,
    matching_prefix,
    pooled_positions_agreement,
)
from jpinfer.bench.results import command_line, publish
from jpinfer.data import chatgpt_prompts
from jpinfer.ffn import PredictorMaskFFN, evaluate, mask_states, perplexity
from jpinfer.predictor import Predictors
from jpinfer.predictor.fit import model_params, retune
from jpinfer.predictor.sizing import predictor_params
from jpinfer.profiler import ActivationProfile, calibrate, token_windows


def masked(engine, predictors: Predictors, prof: ActivationProfile) -> jpinfer.FfnStrategy:
    return jpinfer.FfnStrategy(PredictorMaskFFN(engine.cfg), mask_states(predictors.layers, prof.thresholds),
                               "predicted masks")


def quality(engine, predictors, prof, test) -> dict:
    """Perplexity and per-layer test-text counts of the predicted-mask model."""
    strategy = masked(engine, predictors, prof)
    ppl, sums = evaluate(engine, test, strategy.impl, strategy.state, progress=True)
    n_tokens = test.size
    per_layer = [{k: v / n_tokens for k, v in layer.items()} for layer in sums]
    return {"ppl": ppl, "neurons": float(np.mean([c["predicted"] for c in per_layer])),
            "test_recall": [c["hits"] / c["active"] for c in per_layer],
            "test_recall_all": sum(c["hits"] for c in per_layer) / sum(c["active"] for c in per_layer),
            "per_layer_predicted": [c["predicted"] for c in per_layer]}


def agreement(engine, strategy, prompts, new_tokens) -> dict:
    """Greedy agreement (positions) against dense over all the prompts' tokens
    (``token_agreement``), prompts whose outputs are identical, and the mean number of tokens
    before the first difference (``matching_prefix``, the count behind greedy agreement (prefix))."""
    other = engine.with_ffn(strategy)
    dense = [engine.generate(p, max_new_tokens=new_tokens).token_ids for p in prompts]
    masked_out = [other.generate(p, max_new_tokens=new_tokens).token_ids for p in prompts]
    return {"token_agreement": pooled_positions_agreement(masked_out, dense),
            "identical_prompts": sum(a == b for a, b in zip(dense, masked_out)), "prompts": len(prompts),
            "matching_prefix": float(np.mean([matching_prefix(b, a) for a, b in zip(dense, masked_out)]))}


def step_cost(engine, strategy, prompt, rounds: int) -> dict:
    """Median decode step (no host round trips) of dense and of the masked model, interleaved
    rounds; the overhead is the median of the same-round ratios less one."""
    other = engine.with_ffn(strategy)
    measured = interleaved_rounds({"dense": lambda r: engine.device_step_seconds(prompt, 64),
                                   "masked": lambda r: other.device_step_seconds(prompt, 64)}, rounds)
    step = lambda seconds: seconds
    d, p = measured.median("dense", step), measured.median("masked", step)
    return {"dense_ms": d * 1e3, "masked_ms": p * 1e3, "overhead": measured.median_ratio("masked", "dense", step) - 1,
            "load": (load_average() or [float("nan")])[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--test-windows", type=int, default=TEST_WINDOWS)
    ap.add_argument("--points", default="0.99/0.999,0.95/0.999,0.9/0.995,0.8/0.99",
                    help="operating points: recall/strong recall, comma-separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reuse", action="store_true", help="reuse predictors trained by an earlier run")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    load_before = load_average()
    points = [tuple(float(v) for v in point.split("/")) for point in args.points.split(",")]

    engine = jpinfer.load()
    cfg = engine.cfg
    prof = cached_profile(engine, args.samples)
    adaptive, adaptive_s = trained(engine, prof, "adaptive", args.reuse)
    # predictor_params(r) = c + r * slope (the output bias does not grow with r): solve for equal totals
    slope = predictor_params(2, cfg.d_model, cfg.d_ff) - predictor_params(1, cfg.d_model, cfg.d_ff)
    per_layer = adaptive.n_params / cfg.n_layers - (predictor_params(1, cfg.d_model, cfg.d_ff) - slope)
    fixed_rank = max(1, round(per_layer / slope))
    fixed, fixed_s = trained(engine, prof, f"fixed{fixed_rank}", args.reuse, ranks=fixed_rank)
    print(f"adaptive {adaptive.ranks} ({adaptive.n_params:,}) in {adaptive_s:.0f} s; fixed {fixed_rank} "
          f"({fixed.n_params:,}) in {fixed_s:.0f} s", flush=True)

    w = WINDOW
    test = wikitext_windows(engine.tokenizer, args.test_windows)
    calib = token_windows("wikitext2-valid", engine.tokenizer, window=w).tokens[:32]
    rows, tuned_by_row = [], []
    dense_ppl = perplexity(engine, test, progress=True)
    for name, predictors, at in (("adaptive", adaptive, points), ("fixed", fixed, points[:: max(1, len(points) - 1)])):
        for recall, strong_recall in at:
            tuned = retune(engine, predictors, prof, recall, strong_recall)
            q = quality(engine, tuned, prof, test)
            oracle_sparsity = 1 - q["neurons"] / cfg.d_ff
            q["oracle_ppl"] = (perplexity(engine, test, calibrate(engine, calib, oracle_sparsity), progress=True)
                               if name == "adaptive" else float("nan"))
            rows.append({"predictors": name, "recall": recall, "strong_recall": strong_recall, **q})
            tuned_by_row.append(tuned)
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)

    ok = [r for r in rows if r["ppl"] <= 1.05 * dense_ppl]
    best = min(ok, key=lambda r: r["neurons"]) if ok else min(rows, key=lambda r: r["ppl"])
    prompts = [engine.encode_prompt(t, chat=True)[:128] for t in chatgpt_prompts()[: args.prompts]]
    agree = agreement(engine, masked(engine, tuned_by_row[rows.index(best)], prof), prompts, args.new_tokens)
    agree_first = agreement(engine, masked(engine, tuned_by_row[0], prof), prompts, args.new_tokens)
    cost = step_cost(engine, masked(engine, adaptive, prof), prompts[0], args.rounds)
    n_model = model_params(engine)

    meta = adaptive.meta
    lines = [
        "# Activation predictors on the default model", "",
        command_line(f"python bench/predictors.py --samples {args.samples} --test-windows {args.test_windows} "
                     f"--points {args.points} --prompts {args.prompts} --new-tokens {args.new_tokens} "
                     f"--rounds {args.rounds}{' --reuse' if args.reuse else ''}"), "",
        f"{machine_line(machine(load_before))} Labels: |silu(g)*u| over the "
        f"profile's uniform 50% thresholds; {meta['n_samples']} samples per layer (held-out tail "
        f"{meta['train_config']['held_out']:.0%}).", "",
        "## Training", "",
        *(["Predictors reused (`--reuse`): the training times are those of the run that trained them.", ""]
          if args.reuse else []),
        f"- `train_predictors(model, profile)` (adaptive widths, recall {meta['recall']}, budget "
        f"{meta['budget']:.0%}): {adaptive_s / 60:.1f} min on this machine; widths {adaptive.ranks}; "
        f"{adaptive.n_params:,} parameters = {adaptive.n_params / n_model:.2%} of the model's {n_model:,}.",
        f"- one fixed width {fixed_rank} for every layer (equal total parameters: {fixed.n_params:,}): "
        f"{fixed_s / 60:.1f} min.", "",
        "## Quality (WikiText-2 test, the first "
        f"{args.test_windows} windows of {w} tokens)", "",
        f"Dense perplexity {dense_ppl:.2f}; 1.05x dense = {1.05 * dense_ppl:.2f}. \"neurons\": mean neurons computed "
        f"per token and layer (of {cfg.d_ff}); oracle: exact active sets at the same mean count (uniform "
        "thresholds).", "",
        "| predictors | recall / strong recall | neurons / token | share | perplexity | ppl / dense | oracle ppl | "
        "test recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['predictors']} | {r['recall']} / {r['strong_recall']} | {r['neurons']:.0f} | "
                     f"{r['neurons'] / cfg.d_ff:.1%} | {r['ppl']:.2f} | {r['ppl'] / dense_ppl:.3f} | "
                     f"{r['oracle_ppl']:.2f} | "
                     f"{r['test_recall_all']:.3f} |")
    lines += [
        "", "Best operating point at perplexity <= 1.05x dense: "
        + (f"{best['predictors']} predictors, recall {best['recall']} / strong {best['strong_recall']}: "
           f"{best['neurons']:.0f} of {cfg.d_ff} "
           f"neurons per token ({best['neurons'] / cfg.d_ff:.1%}), perplexity {best['ppl']:.2f}." if ok else
           "none of the measured points (below: the point with the lowest perplexity)."),
        f"Greedy tokens there against dense, {agree['prompts']} ChatGPT prompts x {args.new_tokens} tokens: "
        f"{agree['token_agreement']:.1%} of positions equal (greedy agreement (positions)), "
        f"{agree['identical_prompts']} prompts identical, {agree['matching_prefix']:.1f} tokens before the first "
        "difference on average (the matching prefix); at "
        f"{rows[0]['recall']} / {rows[0]['strong_recall']}: {agree_first['token_agreement']:.1%}, "
        f"{agree_first['identical_prompts']} identical, {agree_first['matching_prefix']:.1f} tokens.", "",
        "## Cost per decode step", "",
        f"Median of {args.rounds} interleaved rounds of 64 steps: dense {cost['dense_ms']:.2f} ms, with predictors "
        f"(dense FFN + predictor + mask) {cost['masked_ms']:.2f} ms: predictor overhead <= {cost['overhead']:.1%} "
        f"of the dense step (load {cost['load']:.1f}).", "",
        "## Per layer (adaptive vs fixed)", "",
        "| layer | width | params | held-out precision @ 0.99 | computed @ 0.99 | test recall | fixed: precision | "
        "fixed: computed | start width | trials (width: computed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    adaptive_rows = [r for r in rows if r["predictors"] == "adaptive" and r["recall"] == meta["recall"]
                     and r["strong_recall"] == meta["strong_recall"]]
    test_recall = adaptive_rows[0]["test_recall"] if adaptive_rows else [float("nan")] * cfg.n_layers
    sizing = meta.get("sizing") or {}
    for layer in range(cfg.n_layers):
        a, f = meta["held_out_scores"][layer], fixed.meta["held_out_scores"][layer]
        trials = sizing.get("trials", {}).get(str(layer), {})
        trial_text = ", ".join(f"{r}: {t['predicted']:.3f}"
                               for r, t in sorted(trials.items(), key=lambda kv: int(kv[0])))
        lines.append(f"| {layer} | {adaptive.ranks[layer]} | {adaptive.layers[layer].n_params:,} | "
                     f"{a['precision']:.3f} | {a['predicted']:.3f} | {test_recall[layer]:.3f} | {f['precision']:.3f} | "
                     f"{f['predicted']:.3f} | {sizing.get('start', ['-'] * cfg.n_layers)[layer]} | {trial_text} |")
    publish("\n".join(lines) + "\n", args.out,
            {"rows": rows, "dense_ppl": dense_ppl, "agreement": agree, "agreement_first_point": agree_first,
             "cost": cost,
             "adaptive": {"ranks": adaptive.ranks, "seconds": adaptive_s, "n_params": adaptive.n_params},
             "fixed": {"rank": fixed_rank, "seconds": fixed_s, "n_params": fixed.n_params}})


if __name__ == "__main__":
    main()
