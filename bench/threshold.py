"""The training-free threshold mode on the default model: activation, input and combined sparsity against
dense, next to the predictor-driven sparse mode, in one interleaved run.

Protocol (CPU, float32):
- thresholds calibrated on WikiText-2 *valid* (histograms of |a| and |x| over ``--calibration-windows``
  windows of 512 tokens; greedy allocation estimates each layer's loss increase on the next as many valid
  windows, never on test text), for each operating point in ``--points``: ``a0.5`` activation 50%, ``i0.3``
  input 30%, ``a0.5+i0.3`` both, a ``g`` suffix for greedy allocation;
- quality: WikiText-2 test perplexity (``--test-windows`` x 512 tokens) of exactly what the engine computes
  (``profiler.evaluate`` with the threshold FFN; several tokens zero the same entries a single token skips),
  and the fraction of FFN inputs and neurons skipped on the test text; greedy agreement (positions) with dense on the
  ChatGPT prompts;
- the predictor mode at its two operating points (recall 0.99 / strong 0.999 and 0.9 / 0.995), predictors
  as bench/predictors.py (cached under $JPINFER_CACHE/bench; trained when missing), K = predicted;
- speed: decode tok/s over ``--prompts`` ChatGPT prompts x ``--new-tokens``, every engine once per round,
  ``--rounds`` interleaved rounds (``jpinfer.bench.engines.speed_rounds``), median per engine, medians of
  same-round ratios to dense; load average printed; greedy agreement (positions) with dense.

    python bench/threshold.py --out bench/results/threshold.md
"""

from __future__ import annotations

import argparse
import statistics

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jpinfer  # noqa: E402
from jpinfer.bench.accuracy import (  # noqa: E402
    cached_profile,
    calibration_windows,
    parse_point,
    trained,
    wikitext_windows,
)
from jpinfer.bench.engines import JaxEngine, decode_tok_s, speed_rounds, weights_read_per_token  # noqa: E402
from jpinfer.bench.protocol import (  # noqa: E402
    AGREEMENT_LABELS,
    AGREEMENT_MEANINGS,
    TEST_WINDOWS,
    load_average,
    machine,
    machine_line,
    pooled_positions_agreement,
    positions_agreement,
)
from jpinfer.bench.results import command_line, publish  # noqa: E402
from jpinfer.data import chatgpt_prompts  # noqa: E402
from jpinfer.ffn import PredictorMaskFFN, ThresholdRowsFFN, evaluate, layer_capacities, mask_states  # noqa: E402
from jpinfer.modes import build_engine  # noqa: E402
from jpinfer.modes.engines import threshold_states  # noqa: E402
from jpinfer.predictor.fit import retune  # noqa: E402
from jpinfer.profiler import calibration, sparsity  # noqa: E402

WINDOW = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="a0.3,a0.4,a0.5,a0.6,i0.2,i0.3,i0.4,a0.4+i0.2,a0.5+i0.3,a0.5g,a0.5+i0.3g")
    parser.add_argument("--predictor-points", default="0.99/0.999,0.9/0.995",
                        help="recall/strong recall operating points of the predictor mode ('' for none)")
    parser.add_argument("--samples", type=int, default=65536, help="predictor samples per layer (profile)")
    parser.add_argument("--calibration-windows", type=int, default=32)
    parser.add_argument("--test-windows", type=int, default=TEST_WINDOWS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="markdown file (a .json with the rows is written beside it)")
    args = parser.parse_args()

    load_before = load_average()
    dense = jpinfer.load()
    cfg = dense.cfg
    n_cal = args.calibration_windows
    valid = calibration_windows(dense.tokenizer, n_cal)
    test = wikitext_windows(dense.tokenizer, args.test_windows)
    prompts = [dense.encode_prompt(t, chat=True)[:128] for t in chatgpt_prompts()[: args.prompts]]
    dense_ppl, _ = evaluate(dense, test, progress=True)

    hists = sparsity.histograms(dense, valid[:n_cal], progress=True)
    points = [(text, *parse_point(text)) for text in args.points.split(",")]
    sensitivities = {}
    for kind in {k for _, targets, method in points if method == "greedy" for k in targets}:
        sensitivities[kind] = calibration.sensitivity(dense, valid[n_cal:], hists[kind], progress=True)

    rows, engines = [], {"dense": dense}
    for text, targets, method in points:
        th = sparsity.from_histograms(hists, targets, method, sensitivities)
        name = f"threshold {th.describe()}"
        engine = build_engine(dense.model, "threshold", thresholds=th)
        ppl, sums = evaluate(dense, test, ThresholdRowsFFN(), threshold_states(dense.model, th), progress=True)
        n = test.size * cfg.n_layers
        rows.append(dict(engine=name, point=text, ppl=ppl, ppl_ratio=ppl / dense_ppl,
                         inputs_skipped=1 - sum(s["inputs"] for s in sums) / (n * cfg.d_model),
                         neurons_skipped=1 - sum(s["neurons"] for s in sums) / (n * cfg.d_ff)))
        engines[name] = engine

    predictor_points = [p for p in args.predictor_points.split(",") if p]
    if predictor_points:
        prof = cached_profile(dense, args.samples)
        predictors, _ = trained(dense, prof, "adaptive", reuse=True)
    for point in predictor_points:
        recall, strong = (float(v) for v in point.split("/"))
        tuned = retune(dense, predictors, prof, recall, strong)
        ks = layer_capacities(dense.cfg, "predicted", prof, tuned)
        ppl, sums = evaluate(dense, test, PredictorMaskFFN(cfg, ks), mask_states(tuned.layers, prof.thresholds),
                             progress=True)
        computed = sum(layer["predicted"] for layer in sums) / (test.size * cfg.n_layers * cfg.d_ff)
        name = f"sparse (predictors {point})"
        engines[name] = build_engine(dense.model, "sparse", predictors=tuned, profile=prof, capacity=ks)
        rows.append(dict(engine=name, point=point, ppl=ppl, ppl_ratio=ppl / dense_ppl, inputs_skipped=0.0,
                         neurons_skipped=1 - computed))

    # weight bytes a decode step reads: all but the embedding table; the FFN's gate/up and down matrices apart
    total_bytes = weights_read_per_token(dense)
    gate_up_bytes = sum(int(layer.w_gate_up.nbytes) for layer in dense.weights.layers)
    down_bytes = sum(int(layer.w_down.nbytes) for layer in dense.weights.layers)
    for row in rows:
        skipped = (row["neurons_skipped"] * (gate_up_bytes + down_bytes) if row["engine"].startswith("sparse")
                   else row["inputs_skipped"] * gate_up_bytes + row["neurons_skipped"] * down_bytes)
        row["bytes_ratio"] = (total_bytes - skipped) / total_bytes

    runners = {name: JaxEngine(name, engine) for name, engine in engines.items()}
    measured, loads = speed_rounds(runners, prompts, args.new_tokens, args.rounds)
    tps = {name: measured.values(name, decode_tok_s) for name in runners}
    speed = {name: measured.median(name, decode_tok_s) for name in runners}
    ref = [s.tokens for s in measured.results("dense")[0]]
    for row in rows:
        ratios = measured.ratios(row["engine"], "dense", decode_tok_s)  # same-round ratios: load hits both alike
        row.update(tok_s=speed[row["engine"]], speedup=statistics.median(ratios),
                   speedup_range=[min(ratios), max(ratios)],
                   agreement=pooled_positions_agreement([s.tokens for s in measured.results(row["engine"])[0]], ref))

    lines = [
        "# Threshold mode (training-free) against dense and the predictor mode, default model",
        "",
        f"{machine_line(machine(load_before))} Load average {min(loads):.1f}-{max(loads):.1f} during the speed "
        "rounds. " + command_line(f"python bench/threshold.py --points {args.points} --test-windows "
                                  f"{args.test_windows} --rounds {args.rounds} --prompts {args.prompts} "
                                  f"--new-tokens {args.new_tokens}"),
        "",
        f"Dense: WikiText-2 test perplexity {dense_ppl:.2f} ({args.test_windows} x {WINDOW} tokens), "
        f"decode {speed['dense']:.1f} tok/s (median of {args.rounds} interleaved rounds, {args.prompts} ChatGPT "
        f"prompts x {args.new_tokens} tokens). Thresholds calibrated on WikiText-2 valid.",
        "",
        f"Weight bytes per token: what a step reads of the {total_bytes / 2**20:.0f} MiB of matrices (all but the "
        f"embedding table), given the skipped fractions; 'bytes bound' is the speed-up over dense if a step took time "
        f"in proportion to them.",
        "",
        "Decode 'x dense' is the median of the same-round ratios (their range beside it); the rounds interleave the "
        f"engines, the order rotating. {AGREEMENT_MEANINGS[positions_agreement]} (dense's), over all the prompts' "
        "tokens of the first round.",
        "",
        "| engine | perplexity | x dense | FFN inputs skipped | neurons skipped | weight bytes x dense | bytes bound "
        f"| decode tok/s | x dense | range | {AGREEMENT_LABELS[positions_agreement]} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['engine']} | {row['ppl']:.2f} | {row['ppl_ratio']:.3f} | {row['inputs_skipped']:.1%} | "
                     f"{row['neurons_skipped']:.1%} | {row['bytes_ratio']:.3f} | {1 / row['bytes_ratio']:.2f} | "
                     f"{row['tok_s']:.1f} | {row['speedup']:.2f} | {row['speedup_range'][0]:.2f}-"
                     f"{row['speedup_range'][1]:.2f} | {row['agreement']:.1%} |")
    publish("\n".join(lines) + "\n", args.out,
            {"dense_ppl": dense_ppl, "dense_tok_s": speed["dense"], "rows": rows, "loads": loads, "tok_s_rounds": tps,
             "greedy_agreement": "positions", "machine": machine(load_before)})


if __name__ == "__main__":
    main()
