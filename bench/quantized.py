"""Quantized weights on the default model: int8 (W8A8) and int4 (W4A8) accuracy and decode speed against
float32 and llama.cpp on the same weights (F32 / Q8_0 / Q4_1 / Q4_0), dense and threshold-sparse, one
interleaved run.

Protocol (CPU):
- models: jpinfer float32 (the GGUF dequantized), jpinfer int8 (``load(weights="int8")``: SmoothQuant's
  migration then per-row int8), the same without the migration ("no migration"), jpinfer int4 (the shipped
  file's own Q4_1 blocks); the threshold mode on the int8 model at ``--points`` (thresholds calibrated on
  the int8 model itself, WikiText-2 *valid*, as ``jpinfer profile --weights int8`` does); with the ``peers``
  extra, llama.cpp (``--threads`` threads) on a float32 GGUF of the same weights, on that file quantized by
  llama.cpp to Q8_0 and Q4_0, and on the shipped Q4_1 file itself, and jpinfer int4 on llama.cpp's Q4_0 file
  (its Q4_0 blocks as stored): each 4-bit pair computes from identical blocks;
- accuracy: WikiText-2 test perplexity (``--test-windows`` x 512 tokens; llama.cpp's from its own logits on
  the same token windows), greedy agreement (positions) with jpinfer float32 on the speed prompts; where the int8 error
  comes from: each projection kind quantized alone, with and without the migration (``--attribution-windows``);
- speed: decode tok/s and end to end tok/s (new tokens / (prefill + decode)) over ``--prompts`` ChatGPT prompts
  (chat template, at most 128 tokens) x ``--new-tokens`` greedy tokens, every engine once per round,
  ``--rounds`` interleaved rounds; medians, and ratios to jpinfer float32 from the same rounds.

    python bench/quantized.py --out bench/results/quantized.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jpinfer
from jpinfer.bench.accuracy import WINDOW, parse_point, wikitext_windows
from jpinfer.bench.child import EngineFailed
from jpinfer.bench.engines import JaxEngine, decode_tok_s, e2e_tok_s, speed_rounds, weights_read_per_token
from jpinfer.bench.llama_cpp import LlamaCppEngine, float32_gguf, peer_engine, quantized_gguf
from jpinfer.bench.protocol import (
    AGREEMENT_LABELS,
    AGREEMENT_MEANINGS,
    TEST_WINDOWS,
    load_average,
    machine,
    machine_line,
    pooled_positions_agreement,
    positions_agreement,
)
from jpinfer.bench.results import command_line, publish
from jpinfer.data import chatgpt_prompts
from jpinfer.ffn import ThresholdRowsFFN, evaluate
from jpinfer.models import quantized, smoothquant
from jpinfer.models.default_model import default_model_path
from jpinfer.models.loading import LoadedModel
from jpinfer.modes import build_engine
from jpinfer.modes.engines import threshold_states
from jpinfer.profiler import sparsity, token_windows
from jpinfer.profiler.smoothing import ALPHA, cached_channel_peaks, calibration_windows

KINDS = ("w_qkv", "wo", "w_gate_up", "w_down", "head")
SAME_FORMAT = {  # jpinfer row -> the llama.cpp row on the same weights at the same precision
    "jpinfer float32": "llama.cpp F32", "jpinfer int8": "llama.cpp Q8_0", "jpinfer int4 (Q4_1)": "llama.cpp Q4_1",
    "jpinfer int4 (Q4_0)": "llama.cpp Q4_0",
}


def quantized_alone(model: LoadedModel, full, kind: str) -> LoadedModel:
    """``model`` with only ``kind`` (a projection of every layer, or the head) taken from ``full``, the int8
    form of its weights."""
    weights = model.weights
    if kind == "head":
        mixed = dataclasses.replace(weights, head=full.head)
    else:
        mixed = dataclasses.replace(weights, layers=[dataclasses.replace(layer, **{kind: getattr(q, kind)})
                                                     for layer, q in zip(weights.layers, full.layers)])
    return LoadedModel(model.cfg, mixed, model.tokenizer, model.source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="a0.4,a0.5",
                        help="threshold-mode points on the int8 model (comma-separated; '' for none)")
    parser.add_argument("--calibration-windows", type=int, default=32)
    parser.add_argument("--test-windows", type=int, default=TEST_WINDOWS)
    parser.add_argument("--attribution-windows", type=int, default=TEST_WINDOWS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--out", default=None, help="markdown file (a .json with the rows is written beside it)")
    args = parser.parse_args()

    load_before = load_average()
    dense = jpinfer.load()
    int8_engine = jpinfer.load(weights="int8")
    model, cfg = dense.model, dense.cfg
    plain = jpinfer.Engine(LoadedModel(cfg, quantized.quantize_weights(model.weights, "int8"), model.tokenizer,
                                       model.source))
    test = wikitext_windows(dense.tokenizer, args.test_windows)
    valid = token_windows("wikitext2-valid", dense.tokenizer, window=WINDOW,
                          n_tokens=args.calibration_windows * WINDOW).tokens
    prompts = [dense.encode_prompt(t, chat=True)[:128] for t in chatgpt_prompts()[: args.prompts]]

    base, _ = evaluate(dense, test, progress=True)
    rows = [dict(engine="jpinfer float32", ppl=base)]
    engines = {"jpinfer float32": JaxEngine("jpinfer float32", dense)}
    rows.append(dict(engine="jpinfer int8", ppl=evaluate(int8_engine, test, progress=True)[0]))
    engines["jpinfer int8"] = JaxEngine("jpinfer int8", int8_engine)
    rows.append(dict(engine="jpinfer int8, no migration (accuracy only)", ppl=evaluate(plain, test, progress=True)[0]))
    int4_engine = jpinfer.load(weights="int4")
    rows.append(dict(engine="jpinfer int4 (Q4_1)", ppl=evaluate(int4_engine, test, progress=True)[0]))
    engines["jpinfer int4 (Q4_1)"] = JaxEngine("jpinfer int4 (Q4_1)", int4_engine)
    dense_int8_bytes = weights_read_per_token(int8_engine)
    gate_up_bytes = sum(layer.w_gate_up.nbytes for layer in int8_engine.weights.layers)
    down_bytes = sum(layer.w_down.nbytes for layer in int8_engine.weights.layers)

    hists = sparsity.histograms(int8_engine, valid, progress=True)
    for text in filter(None, args.points.split(",")):
        targets, method = parse_point(text)
        th = sparsity.from_histograms(hists, targets, method)
        name = f"jpinfer int8 threshold {th.describe()}"
        ppl, sums = evaluate(int8_engine, test, ThresholdRowsFFN(), threshold_states(int8_engine.model, th),
                             progress=True)
        n = test.size * cfg.n_layers
        neurons_skipped = 1 - sum(s["neurons"] for s in sums) / (n * cfg.d_ff)
        inputs_skipped = 1 - sum(s["inputs"] for s in sums) / (n * cfg.d_model)
        rows.append(dict(engine=name, ppl=ppl, neurons_skipped=neurons_skipped,
                         weight_mb=(dense_int8_bytes - neurons_skipped * down_bytes
                                    - inputs_skipped * gate_up_bytes) / 1e6))
        engines[name] = JaxEngine(name, build_engine(int8_engine.model, "threshold", thresholds=th))

    peers, peer_notes = {}, []
    if LlamaCppEngine.available():
        f32_file = float32_gguf(default_model_path())
        q4_0_file = quantized_gguf(f32_file, "Q4_0")
        int4_q4_0 = jpinfer.load(q4_0_file, weights="int4")  # llama.cpp's own Q4_0 blocks, as stored
        rows.append(dict(engine="jpinfer int4 (Q4_0)", ppl=evaluate(int4_q4_0, test, progress=True)[0]))
        engines["jpinfer int4 (Q4_0)"] = JaxEngine("jpinfer int4 (Q4_0)", int4_q4_0)
        for label, path in (("F32", f32_file), ("Q8_0", quantized_gguf(f32_file, "Q8_0")),
                            ("Q4_1", default_model_path()), ("Q4_0", q4_0_file)):
            name = f"llama.cpp {label}"
            try:  # in a process of its own: a crash there is reported, never the end of this run
                peer = peer_engine(path, n_threads=args.threads, label=label)
                rows.append(dict(engine=name, ppl=peer.perplexity(test)))
            except EngineFailed as failure:
                peer_notes.append(f"{name} failed and is left out: {failure}.")
                continue
            peers[name] = peer
            if "no weight repacking" in peer.name:
                peer_notes.append(f"{name} ran without llama.cpp's weight repacking (its first decode crashed "
                                  "with it).")
    engines |= peers

    attribution_windows = test[: args.attribution_windows]
    attribution_base, _ = evaluate(dense, attribution_windows)
    peaks = cached_channel_peaks(model, calibration_windows(model.tokenizer))
    smoothed = smoothquant.smooth(model.weights, peaks, ALPHA)
    smoothed_model = LoadedModel(cfg, smoothed, model.tokenizer, model.source)
    int8_forms = [(m, quantized.quantize_weights(m.weights, "int8")) for m in (model, smoothed_model)]
    attribution = []
    for kind in KINDS:
        alone = [evaluate(quantized_alone(m, full, kind), attribution_windows)[0] / attribution_base
                 for m, full in int8_forms]
        attribution.append(dict(kind=kind, plain=alone[0], migrated=alone[1]))

    measured, loads = speed_rounds(engines, prompts, args.new_tokens, args.rounds, drop=EngineFailed)
    peer_notes += [f"{name} failed in the speed rounds and is left out there: {error}."
                   for name, error in measured.errors.items()]
    for name in measured.errors:
        del engines[name]
    tps = {name: measured.values(name, decode_tok_s) for name in engines}
    e2e = {name: measured.values(name, e2e_tok_s) for name in engines}
    reference = "jpinfer float32"
    ref = [s.tokens for s in measured.results(reference)[0]]
    for row in rows:
        name = row["engine"]
        row["ppl_ratio"] = row["ppl"] / base
        if name in engines:
            ratios = measured.ratios(name, reference, decode_tok_s)
            row.update(tok_s=statistics.median(tps[name]), e2e_tok_s=statistics.median(e2e[name]),
                       speedup=statistics.median(ratios), speedup_range=[min(ratios), max(ratios)],
                       agreement=pooled_positions_agreement([s.tokens for s in measured.results(name)[0]], ref))
            row.setdefault("weight_mb", engines[name].weight_bytes_per_token / 1e6)
            peer = SAME_FORMAT.get(name)
            if peer in engines:
                row["x_llama_cpp"] = statistics.median(measured.ratios(name, peer, decode_tok_s))
                row["ppl_x_llama_cpp"] = row["ppl"] / next(r["ppl"] for r in rows if r["engine"] == peer)

    lines = [
        "# Quantized weights (int8 W8A8, int4 W4A8) against float32 and llama.cpp, default model",
        "",
        f"{machine_line(machine(load_before))} Load average {min(loads):.1f}-{max(loads):.1f} during the speed "
        "rounds. " + command_line(f"python bench/quantized.py --points '{args.points}' --test-windows "
                                  f"{args.test_windows} --rounds {args.rounds} --prompts {args.prompts} "
                                  f"--new-tokens {args.new_tokens} --threads {args.threads}"),
        "",
        f"Perplexity: WikiText-2 test, {args.test_windows} x {WINDOW} tokens (llama.cpp's from its own logits on the "
        f"same windows). Speed: {args.prompts} ChatGPT prompts x {args.new_tokens} greedy tokens, median of "
        f"{args.rounds} interleaved rounds (the order rotating); 'x float32' is the median of the same-round decode "
        "ratios to jpinfer float32 (range beside it). Weight MB: what one decode step reads (all but an untied "
        "embedding table; for the threshold mode, less the skipped down rows on the test text). "
        f"{AGREEMENT_MEANINGS[positions_agreement]} (jpinfer float32's), over all the prompts' tokens of the "
        "first round. 'x llama.cpp': jpinfer's decode tok/s over llama.cpp's on the same weights in the same format "
        "(F32, Q8_0 for int8, the same Q4_1 / Q4_0 blocks for int4), median of same-round ratios, and the "
        "perplexity ratio to that llama.cpp row.",
        *([""] + peer_notes if peer_notes else []),
        "",
        "| engine | perplexity | x float32 | neurons skipped | weight MB/token | decode tok/s | x float32 | range "
        f"| end to end tok/s | {AGREEMENT_LABELS[positions_agreement]} | x llama.cpp (speed) "
        "| x llama.cpp (perplexity) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        speed = (f"{row['weight_mb']:.0f} | {row['tok_s']:.1f} | {row['speedup']:.2f} | {row['speedup_range'][0]:.2f}-"
                 f"{row['speedup_range'][1]:.2f} | {row['e2e_tok_s']:.1f} | {row['agreement']:.1%}"
                 if "tok_s" in row else " | ".join([""] * 6))
        skipped = f"{row['neurons_skipped']:.1%}" if "neurons_skipped" in row else ""
        peer = (f"{row['x_llama_cpp']:.2f} | {row['ppl_x_llama_cpp']:.3f}" if "x_llama_cpp" in row else " | ")
        lines.append(f"| {row['engine']} | {row['ppl']:.2f} | {row['ppl_ratio']:.3f} | {skipped} | {speed} | {peer} |")
    lines += [
        "",
        f"Where the int8 error comes from: perplexity x float32 with one projection kind int8 and the rest float "
        f"({args.attribution_windows} x {WINDOW} WikiText-2 test tokens), per-row int8 as loaded, without and with the "
        f"migration (alpha {ALPHA}).",
        "",
        "| int8 alone | no migration | migration |",
        "|---|---|---|",
    ] + [f"| {a['kind']} | {a['plain']:.4f} | {a['migrated']:.4f} |" for a in attribution]
    publish("\n".join(lines) + "\n", args.out,
            {"rows": rows, "attribution": attribution, "loads": loads, "tok_s_rounds": tps, "e2e_rounds": e2e,
             "greedy_agreement": "positions", "machine": machine(load_before), "peer_notes": peer_notes})


if __name__ == "__main__":
    main()
