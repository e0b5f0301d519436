"""bench/results/REPORT.md from the files the reproduction scripts wrote (nothing else).

Each section reads the JSON a script wrote beside its markdown, quotes what matters, shows its
figure and names the command that regenerates it; a section whose file is missing says which
command makes it. Numbers are copied from those files, never typed here.

    python bench/report.py
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

from jpinfer.bench.gpu_suite import part_note
from jpinfer.bench.protocol import AGREEMENT_LABELS, AGREEMENT_MEANINGS, machine_line, prefix_agreement
from jpinfer.bench.results import format_cell as fmt
from jpinfer.bench.results import markdown_table as table
from jpinfer.pack.settings import AUTO, AUTO_TARGET, HEAD_AUTO_TARGET

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def missing(command: str) -> list[str]:
    return [f"Not run yet: `{command}`.", ""]


COMMANDS = {
    "bench": "python -m jpinfer.bench --json bench/results/bench.json --out bench/results/bench.md",
    "long_context": "python -m jpinfer.bench --modes dense --peers transformers llama.cpp --lengths 128 1024 4096 "
                    "--long-prompt 0 --max-new-tokens 64 --ppl-windows 0 --json bench/results/long_context.json "
                    "--out bench/results/long_context.md",
    "first_run": "python bench/first_run.py --out bench/results/first_run.md",
    "accuracy_curves": "python bench/accuracy_curves.py --out bench/results/accuracy_curves.md",
    "model_wide": "python bench/model_wide.py --out bench/results/model_wide.md",
    "model_wide_head": "python bench/model_wide.py --points ffn:0.5+0.25,all:0.5+0.25+0.25,all:0.5+0.25+0.25+0.1,"
                       "all:0.5+0.25+0.25+0.2,all:0.5+0.25+0.25+0.3,all:0.5+0.3+0.3,all:0.5+0.3+0.3+0.2,"
                       "all-greedy:0.35,all-greedy:0.35+0.2 --speed all:0.5+0.25+0.25,all:0.5+0.25+0.25+0.2,"
                       "all:0.5+0.25+0.25+0.3,all-greedy:0.35+0.2 --out bench/results/model_wide_head.md",
    **{f"model_wide_{w}": f"python bench/model_wide.py --weights {w} --points ffn:0.5,all:0.5+0.25+0.25,"
                          "all:0.5+0.3+0.3 --speed ffn:0.5,all:0.5+0.25+0.25,all:0.5+0.3+0.3 "
                          f"--out bench/results/model_wide_{w}.md" for w in ("int8", "int4")},
    "serve": "python bench/serve.py --out bench/results/serve.md",
    "decode_speed": "python bench/decode_speed.py --out bench/results/decode_speed.md",
    "modelled_speed": "python bench/modelled_speed.py --out bench/results/modelled_speed.md",
    "placement_share": "python bench/placement_share.py --out bench/results/placement_share.md",
    "kernel_efficiency": "python bench/kernel_efficiency.py --out bench/results/kernel_efficiency.md",
    "power_law": "python bench/power_law.py --pack --out-dir bench/results",
    "predictor_sizes": "python bench/predictor_sizes.py --out bench/results/predictor_sizes.md",
    "quantized": "python bench/quantized.py --out bench/results/quantized.md",
    "cpu_7b": "python bench/cpu_7b.py --out-dir bench/results",
    "gpu_suite": "PYTHONPATH=src python -m jpinfer.bench gpu --out bench/results",  # on a GPU machine
}


def gpu_note() -> str:
    """Whether any number here was measured on a GPU, from the files: the GPU suite's record or its absence."""
    suite = load("gpu_suite")
    if suite is None:
        return ("No GPU run is recorded in bench/results (gpu_suite.json is absent): every number here is from this "
                "CPU, and GPU figures are modelled and say so.")
    return (f"GPU figures measured on {suite['machine']['device']} ({suite['machine']['date']}) are in the GPU "
            "section; other GPU figures are modelled and say so.")


def source(name: str) -> str:
    return f"Source: [`{name}.md`]({name}.md) (data: `{name}.json`), made by `{COMMANDS[name]}`."


def threshold_targets(settings: dict[str, Any]) -> str:
    """The threshold mode's targets in a pack's recorded settings, e.g. 'activation 50%, input auto (25% for float
    and int8 weights), attention auto (...), head auto (20% for float weights, ...) (uniform)'."""
    auto = f"{AUTO} ({AUTO_TARGET:.0%} for float and int8 weights, off for int4)"
    head_auto = f"{AUTO} ({HEAD_AUTO_TARGET:.0%} for float weights, off for int8 and int4)"
    target = lambda v, auto=auto: "off" if v is None else auto if v == AUTO else f"{v:.0%}"
    head = f"head {target(settings.get('head_sparsity'), head_auto)}"
    if settings.get("model_wide_sparsity") is not None:
        return f"model-wide {settings['model_wide_sparsity']:.0%}, {head} (greedy)"
    activation = settings["sparsity"] if settings.get("threshold_sparsity") is None else settings["threshold_sparsity"]
    return (f"activation {target(activation)}, input {target(settings.get('input_sparsity'))}, attention "
            f"{target(settings.get('attention_sparsity'))}, {head} ({settings.get('allocation', 'uniform')})")


def setup() -> list[str]:
    out = ["## Setup", ""]
    bench, first = load("bench"), load("first_run")
    if bench is None:
        return out + missing(COMMANDS["bench"])
    m = bench["machine"]
    if "cores" in m:  # jpinfer.bench.protocol.machine's dict
        out += [f"- {machine_line(m)} The main bench ran {bench['date']}. {gpu_note()}"]
    else:  # recorded before the protocol module: load averages as text
        out += [f"- Machine: {m['cpus']} CPUs, jax {m['jax']} on {m['platform']}; the main bench ran {bench['date']} "
                f"(load average before {m['load_before']}, after {m['load_after']}). {gpu_note()}"]
    out += [
            f"- Model: {bench['model']}, float32."]
    pack = bench.get("pack")
    if pack:
        s = pack["settings"]
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in pack["stage_seconds"].items())
        out += [f"- Pack (every reproduction reads it): {s['n_tokens']} tokens of {s['corpus']} profiled "
                f"({s['calibration_tokens']} calibrate the thresholds), activity thresholds for {s['sparsity']:.0%} "
                f"sparsity, threshold mode targets {threshold_targets(s)}, "
                f"{s['n_samples']} predictor samples per layer, predictors at recall {s['recall']} / strong "
                f"{s['strong_recall']}, placement for a GPU budget of {s['gpu_budget']} of the weights "
                f"({s['hardware']} preset, objective {s['objective']}). Stages: {stages}."]
    if first:
        for i, run in enumerate(first["runs"], 1):
            parts = [f"{k} at {v / 60:.1f} min" for k, v in run.items() if k != "end"]
            out.append(f"- `make bench` on a fresh clone, run {i}: ended after {run['end'] / 60:.1f} min "
                       f"({'; '.join(parts)}). {source('first_run')}")
    else:
        out += ["- " + missing(COMMANDS["first_run"])[0]]
    out += ["", "Commands (each writes its markdown, JSON and figure into `bench/results/`):", ""]
    out += table(["result", "command"], [[f"[{n}]({n}.md)", f"`{c}`"] for n, c in COMMANDS.items()])
    return out + [""]


def accuracy() -> list[str]:
    out = ["## Accuracy", ""]
    curves = load("accuracy_curves")
    if curves is None:
        out += missing(COMMANDS["accuracy_curves"])
    else:
        out += [f"WikiText-2 test perplexity ({curves['windows']} windows of 512 tokens; dense "
                f"{curves['dense_ppl']:.3f}) against the FFN weight bytes each mode reads per decoded token.", "",
                "![accuracy](accuracy_curves.png)", ""]
        rows = [[r["method"], fmt(r.get("activation"), ".0%"), fmt(r.get("input"), ".0%"),
                 f"{r['recall']} / {r['strong_recall']}" if r["method"] == "predictor" else "-",
                 f"{r['bytes']:.3f}", f"{r['ppl']:.3f}", f"{r['ppl_vs_dense']:.3f}"] for r in curves["rows"]]
        out += table(["method", "activation s", "input s", "recall / strong", "bytes read", "perplexity", "x dense"],
                     rows)
        for label, keep in (("any method", lambda r: True), ("a method that runs (the oracle is a perfect predictor)",
                                                             lambda r: r["method"] != "oracle")):
            within = [r for r in curves["rows"] if keep(r) and r["ppl_vs_dense"] <= 1.05]
            if within:
                best = min(within, key=lambda r: r["bytes"])
                setting = (f"recall {best['recall']} / {best['strong_recall']}" if best["method"] == "predictor" else
                           ", ".join(f"{k} {best[k]:.0%}" for k in ("activation", "input") if best.get(k) is not None))
                out.append(f"- Fewest bytes within 1.05x dense perplexity, {label}: {best['method']} ({setting}), "
                           f"{best['bytes']:.3f} of the dense FFN's bytes at {best['ppl_vs_dense']:.3f}x.")
        out += ["", source("accuracy_curves"), ""]
    out += model_wide()
    bench = load("bench")
    if bench is not None:
        # the bench has always reported the matching prefix (jpinfer.bench.compare, protocol.prefix_agreement)
        out += ["Accuracy of each engine of the main bench (what it decodes with; greedy agreement with dense on "
                f"the bench's prompts; {AGREEMENT_MEANINGS[prefix_agreement]}):", ""]
        out += table(["engine", "perplexity", "x dense", AGREEMENT_LABELS[prefix_agreement],
                      "neurons / token and layer", "clipped"],
                     [[r["engine"], fmt(r["perplexity"], ".3f"), fmt(r["ppl_vs_dense"], ".3f"),
                       f"{r['greedy_agreement']:.2f}", fmt(r["neurons"], ".0f"), fmt(r["clipped"], ".1f")]
                      for r in bench["engines"]])
        out += ["", source("bench"), ""]
    return out


def per_length(results: dict[str, Any], cell: Callable[[dict[str, Any]], str]) -> list[str]:
    """A table of a bench run's engines (rows) by prompt length (columns), cell(row of per_length) each."""
    lengths = sorted({r["length"] for r in results["per_length"]})
    engines = list(dict.fromkeys(r["engine"] for r in results["per_length"]))
    by = {(r["engine"], r["length"]): r for r in results["per_length"]}
    return table(["engine", *(f"{n} tokens" for n in lengths)],
                 [[e, *(cell(by[e, n]) if (e, n) in by else "-" for n in lengths)] for e in engines])


def speed() -> list[str]:
    out = ["## Speed", "", "### Every engine on the paper's protocol (measured, this CPU)", ""]
    bench = load("bench")
    if bench is None:
        out += missing(COMMANDS["bench"])
    else:
        p = bench["protocol"]
        out += [f"Prompts of {', '.join(map(str, p['lengths']))} and {p['long_prompt']} tokens, {p['max_new_tokens']} "
                f"greedy output tokens, batch 1, {p['rounds']} interleaved rounds.", ""]
        out += table(["engine", "decode tok/s", "x dense", "end-to-end tok/s", "x dense", "p50 / p99 ms"],
                     [[r["engine"], f"{r['decode_tok_s']:.1f}", f"{r['decode_vs_dense']:.2f}", f"{r['e2e_tok_s']:.1f}",
                       f"{r['e2e_vs_dense']:.2f}", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"] for r in bench["engines"]])
        out += ["", "Decode tok/s (x dense) and time to first token per prompt length:", ""]
        out += per_length(bench, lambda r: f"{r['decode_tok_s']:.1f} ({r['decode_vs_dense']:.2f}x), TTFT "
                                           f"{r['ttft_ms']:.0f} ms")
        out += ["", source("bench"), ""]
    out += ["### Long prompts (measured, this CPU)", ""]
    long = load("long_context")
    if long is None:
        out += missing(COMMANDS["long_context"])
    else:
        out += [f"{machine_line(long['machine'])} {long['protocol']['max_new_tokens']} greedy output tokens, "
                f"{long['protocol']['rounds']} interleaved rounds; prefill tok/s / decode tok/s per prompt length:", ""]
        out += per_length(long, lambda r: f"{r['prefill_tok_s']:.0f} / {r['decode_tok_s']:.1f}")
        out += ["", source("long_context"), ""]
    out += ["### Against sparsity and budget (measured, this CPU)", ""]
    decode = load("decode_speed")
    if decode is None:
        out += missing(COMMANDS["decode_speed"])
    else:
        out += ["![decode speed](decode_speed.png)", ""]
        out += table(["engine", "setting", "FFN bytes read", "decode tok/s", "x dense"],
                     [[r["kind"], r["setting"], fmt(r["bytes"], ".3f"), f"{r['decode_tok_s']:.1f}",
                       f"{r['vs_dense']:.2f}"] for r in decode["rows"]])
        out += ["", source("decode_speed"), ""]
    out += ["### On GPUs this machine lacks (MODELLED, not measured; oracle predictor, upper bound)", ""]
    modelled = load("modelled_speed")
    if modelled is None:
        out += missing(COMMANDS["modelled_speed"])
    else:
        out += ["The placement solver's cost model (batch 1, memory-bound, datasheet bandwidths, no launch costs) "
                "for jpinfer's placement (MILP, latency objective), the greedy placement and layer offload. It "
                "assumes each token computes exactly the profile's active neurons (an oracle predictor), so its "
                "speeds are upper bounds.", "",
                "![modelled speed](modelled_speed.png)", ""]
        rows = []
        for case in modelled["cases"]:
            for r in case["rows"]:
                title = [case["title"].replace(" (modelled)", ""), r["skew"], r["preset"], "yes" if r["fits"] else "no"]
                if r["runs"] is None:  # even the dense part does not fit this GPU
                    rows.append(title + [f"needs {r['minimum_gib']:.1f} GiB on the GPU", "-", "-", "-"])
                    continue
                ms = lambda run: r["runs"][run]["per_token_time_ms"]
                rows.append(title + [f"{1e3 / ms('latency'):.0f}", f"{1e3 / ms('greedy'):.0f}",
                                     f"{1e3 / ms('layers'):.0f}", f"{ms('layers') / ms('latency'):.2f}x"])
        out += table(["model", "skew", "preset", "fits", "jpinfer tok/s (upper bound)", "greedy tok/s (upper bound)",
                      "layer offload tok/s", "jpinfer / offload"], rows)
        compared = modelled.get("measured_vs_modelled") or []
        if compared:
            out += ["", "Measured against modelled:", ""]
            out += table(["configuration", "source", "measured ms/token", "modelled ms/token", "model error"],
                         [[c["configuration"], c["source"], f"{c['measured_ms']:.3f}", f"{c['modelled_ms']:.3f}",
                           f"{c['error']:+.1%}"] for c in compared])
        else:
            recorded = ("the recorded GPU suite run holds no fixed-list decode" if load("gpu_suite") else
                        "no GPU run is recorded in bench/results")
            out += ["", f"Measured against modelled: {recorded}"
                    + f", so the model's error is not measured yet (`{COMMANDS['gpu_suite']}` on a GPU machine records "
                    "one, then `" + COMMANDS["modelled_speed"] + "`)."]
        out += ["", source("modelled_speed"), ""]
    return out


def gpu() -> list[str]:
    """The GPU suite's record (``jpinfer.bench.gpu_suite``): checks, kernel efficiency, sparse and hybrid decodes."""
    out = ["## GPU (measured)", ""]
    suite = load("gpu_suite")
    if suite is None:
        return out + [f"No GPU run is recorded: `{COMMANDS['gpu_suite']}` on a GPU machine records one.", ""]
    tiny = " --tiny (shrunk shapes on the CPU): a check of the suite, not a timing." if suite["tiny"] else ""
    out += [f"{machine_line(suite['machine'])} Command: `{suite['command']}`; {suite['elapsed_s']:.0f} s of "
            f"--max-seconds {suite['max_seconds']:g}.{tiny}", ""]
    out += [f"- part {p['name']}: {p['status']}" + (f" ({part_note(p)})" if part_note(p) else "")
            for p in suite["parts"]]
    checks = suite.get("checks")
    if checks:
        failed = [c["name"] for c in checks["rows"] if not c["passed"]]
        out += [f"- checks (bfloat16, against float64 / float32 references): {len(checks['rows']) - len(failed)} of "
                f"{len(checks['rows'])} passed" + (f"; FAILED: {'; '.join(failed)}" if failed else "") + "."]
    kernels = suite.get("kernels")
    if kernels:
        out += ["", f"Sparse FFN kernel efficiency (speedup over dense x (1 - s)), d_model {kernels['d_model']}, "
                f"d_ff {kernels['d_ff']}, {kernels['layers']} layers chained, bfloat16:", ""]
        rows = [[t["tokens"], r["op"], f"{r['s']:.2f}", fmt(r.get("ms"), ".3f"), fmt(r.get("speedup"), ".2f"),
                 fmt(r.get("efficiency"), ".2f")] for t in kernels["tables"] for r in t["rows"]]
        out += table(["tokens", "op", "s", "ms", "x dense", "efficiency"], rows)
    for key, title in (("fixed_list", "Fixed-list sparse decode (no predictor)"),
                       ("hybrid", "Hybrid against layer offload (synthetic activity, oracle predictor, upper bound)"),
                       ("modes", "The default model's engines (synthetic activity, oracle predictor, upper bound)")):
        part = suite.get(key)
        if not part:
            continue
        weights = f"; weights: {part['weights']}" if "weights" in part else ""
        out += ["", f"{title}, {part['model']}{weights}:", ""]
        out += [f"- {fact}" for fact in part.get("facts", [])] + ([""] if part.get("facts") else [])
        out += table(["engine", "decode tok/s", "x dense", "greedy agreement (prefix)", "note"],
                     [[r["engine"], fmt(r.get("tok_s"), ".1f"), fmt(r.get("vs_dense"), ".2f"),
                       r.get("agreement") or "-", r.get("note") or ""] for r in part["rows"]])
    return out + ["", source("gpu_suite"),
                  ""]


def placement() -> list[str]:
    out = ["## Placement", ""]
    share = load("placement_share")
    if share is None:
        return out + missing(COMMANDS["placement_share"])
    out += ["The accelerator's share of the FFN activation mass against its memory budget (the PowerInfer paper "
            "reports about 20% for llama.cpp's layer offload and about 70% for its placement): the MILP with "
            "both objectives, the greedy placement and layer offload.", "", "![placement share](placement_share.png)",
            ""]
    for case in share["cases"]:
        rows = case["rows"]
        paper = min(rows, key=lambda r: abs(r["runs"]["layers"]["accel_share"] - 0.2))
        runs = paper["runs"]
        out.append(f"- {case['title']}: at a budget of {paper['budget_gib']:.2f} GiB, where layer offload holds "
                   f"{runs['layers']['accel_share']:.1%} of the mass, the MILP (mass) holds "
                   f"{runs['mass']['accel_share']:.1%}, latency {runs['latency']['accel_share']:.1%}, greedy "
                   f"{runs['greedy']['accel_share']:.1%} (modelled {runs['mass']['per_token_time_ms']:.2f} / "
                   f"{runs['latency']['per_token_time_ms']:.2f} / {runs['layers']['per_token_time_ms']:.2f} ms per "
                   "token: mass / latency / layers).")
    return out + ["", source("placement_share"), ""]


def kernels() -> list[str]:
    out = ["## Kernels", ""]
    eff = load("kernel_efficiency")
    if eff is None:
        return out + missing(COMMANDS["kernel_efficiency"])
    out += ["Sparse FFN kernel efficiency (speedup over the dense FFN x (1 - sparsity); 1.0 = the sparse op moves "
            "its bytes as fast as dense) against sparsity.", "", "![kernel efficiency](kernel_efficiency.png)", ""]
    out += table(["layer shape", "layers a call", "sparsity", "dense ms", "sparse ms", "efficiency (median)", "range"],
                 [[r["shape"], str(r["layers"]), f"{r['s']:.2f}", f"{r['dense_ms']:.2f}", f"{r['sparse_ms']:.2f}",
                   f"{r['efficiency']:.2f}", f"{r['efficiency_min']:.2f}-{r['efficiency_max']:.2f}"]
                  for r in eff["cpu"]])
    gpu, suite = eff.get("gpu"), load("gpu_suite")
    measured = ("from " + gpu["source"] if gpu else "the GPU suite's table, in the GPU section" if suite and
                suite.get("kernels") else "not measured yet (no GPU run recorded)")
    out += ["", f"GPU: {measured}.", "",
            source("kernel_efficiency"), ""]
    return out


def model_wide() -> list[str]:
    """The threshold mode's FFN-only against model-wide (attention too) points, at the bytes of all weights: float
    weights, with the head's inputs too, then int8 and int4 (whose matrices read by rows are int8 copies)."""
    out = ["### Model-wide threshold sparsity (the attention's products too)", ""]
    for name, label in (("model_wide", "Float32 weights"),
                        ("model_wide_head", "Float32 weights, the head's inputs too (a last +H: the head skips H)"),
                        ("model_wide_int8", "Int8 weights"), ("model_wide_int4", "Int4 weights")):
        out += [f"{label}.", ""] + model_wide_run(name)
    return out


def model_wide_run(name: str) -> list[str]:
    data = load(name)
    if data is None:
        return missing(COMMANDS[name])
    out = [f"{machine_line(data['machine'])} WikiText-2 test perplexity (dense {data['dense_ppl']:.2f}) against the "
            "bytes of all weights a decode step reads (the tied head included), and decode speed of the points "
            "timed.", ""]
    rows = [[r["point"], r["describe"], f"{r['ppl_ratio']:.3f}", f"{r['bytes_ratio']:.3f}",
             fmt(r.get("speedup"), ".2f")] for r in data["rows"]]
    out += table(["point", "thresholds", "perplexity x dense", "bytes x dense", "decode x dense"], rows)
    for label, family in (("the FFN alone", "ffn"), ("model-wide", "all")):
        within = [r for r in data["rows"] if r["family"].startswith(family) and r["ppl_ratio"] <= 1.05]
        if within:
            best = min(within, key=lambda r: r["bytes_ratio"])
            out.append(f"- Fewest bytes within 1.05x dense perplexity, {label}: {best['describe']}, "
                       f"{best['bytes_ratio']:.3f} of dense at {best['ppl_ratio']:.3f}x.")
    kept = [f"{r['point']}: {r['allocation']}" for r in data["rows"] if r.get("allocation")]
    if kept:
        out.append("- The allocation each greedy point kept (the least held-out loss of the Fisher one, the measured "
                   "one over kinds and uniform): " + "; ".join(kept) + ".")
    return out + ["", source(name), ""]


def serving() -> list[str]:
    out = ["## Serving", ""]
    data = load("serve")
    if data is None:
        return out + missing(COMMANDS["serve"])
    out += [f"{machine_line(data['machine'])} `jpinfer serve` under {data['clients']} concurrent streamed greedy "
            f"chat requests of {data['tokens']} tokens; 'equal': answers equal to the request run alone; step: the "
            "batched decode step with every slot full against the one-slot step.", ""]
    rows = []
    for mode, by_slots in data["modes"].items():
        one = by_slots["1"]
        for slots, r in by_slots.items():
            rows.append([mode, slots, f"{r['complete']}/{r['requests']}", f"{r['equal_to_alone']}/{r['requests']}",
                         f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}",
                         f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / one['step_s']:.2f}"])
    out += table(["mode", "slots", "complete", "equal", "output tok/s", "x 1 slot", "step ms", "x 1-slot step"],
                 rows)
    return out + ["", source("serve"), ""]


def quantized_weights() -> list[str]:
    out = ["## Quantized weights", ""]
    data = load("quantized")
    if data is None:
        return out + missing(COMMANDS["quantized"])
    rows = [r for r in data["rows"] if "tok_s" in r]
    out += [f"{machine_line(data['machine'])} int8 is W8A8 with SmoothQuant's migration, int4 W4A8 on llama.cpp's "
            "4-bit blocks; 'x llama.cpp': same-round decode ratio to llama.cpp on the same weights in the same format "
            "(F32; Q8_0 for int8; the same Q4_1 / Q4_0 blocks for int4).", ""]
    out += table(["engine", "perplexity x float32", "decode tok/s", "x jpinfer float32", "x llama.cpp (speed)",
                  "x llama.cpp (perplexity)"],
                 [[r["engine"], fmt(r["ppl_ratio"], ".3f"), fmt(r["tok_s"], ".1f"), fmt(r["speedup"], ".2f"),
                   fmt(r.get("x_llama_cpp"), ".2f"), fmt(r.get("ppl_x_llama_cpp"), ".3f")] for r in rows])
    if data.get("peer_notes"):  # a peer that could not run as it should (e.g. without its weight repacking)
        out += ["", " ".join(data["peer_notes"])]
    return out + ["", source("quantized"), ""]


def cpu_7b() -> list[str]:
    out = ["## CPU decode at Llama-2-7B's shapes (random weights, planted activity)", ""]
    data = load("cpu_7b")
    if data is None:
        return out + missing(COMMANDS["cpu_7b"])
    out += [f"{machine_line(data['machine'])} Random weights of Llama-2-7B's shapes in one GGUF per format, loaded by "
            "llama.cpp and by jpinfer (straight into int8 / 4-bit); the sparse rows compute planted active sets "
            "drawn from a power law at PowerInfer's skew, with or without per-layer predictors "
            f"(rank {data['args']['rank']}) run every step; 'x llama.cpp': same-round decode ratio to llama.cpp's "
            "dense decode of the same file; 'of bound': measured over bytes read per token / XLA's matrix-vector "
            f"read bandwidth ({data['bandwidth'] / 1e9:.1f} GB/s, same run).", ""]
    out += table(["format", "engine", "decode tok/s", "x llama.cpp", "of bound"],
                 [[r["format"], r["engine"], fmt(r["decode_tok_s"], ".2f"), fmt(r.get("x_llama_cpp"), ".2f"),
                   fmt(r["decode_tok_s"] / r["bytes_bound_tok_s"], ".2f")] for r in data["rows"]])
    if data["memory"]:
        tensors = {ft: f["tensor_bytes"] for ft, f in data["files"].items()}
        out += ["", "Peak resident memory of each engine alone in its process, over its file's tensor bytes: " +
                "; ".join(f"{r['engine']} {r['peak'] / tensors[r['format']]:.2f}" for r in data["memory"]
                          if "peak" in r) + "."]
    return out + ["", source("cpu_7b"), ""]


def activity() -> list[str]:
    out = ["## Activity and predictors", ""]
    law = load("power_law")
    if law is None:
        out += missing(COMMANDS["power_law"])
    else:
        mean = law["mean"]
        out += [f"Power law per layer ({law['n_tokens']} profiled tokens, thresholds for {law['sparsity']:.0%} "
                f"sparsity): on average the hottest {mean['share_50']:.1%} / {mean['share_80']:.1%} / "
                f"{mean['share_90']:.1%} of a layer's neurons carry 50 / 80 / 90% of its activations (equal firing "
                "would give 50 / 80 / 90%; PowerInfer reports 80% in 26% of the neurons of OPT-30B, a ReLU model).",
                "", "![power law](power_law.png)", "", source("power_law"), ""]
    sizes = load("predictor_sizes")
    if sizes is None:
        out += missing(COMMANDS["predictor_sizes"])
    else:
        mean = lambda key, which: sum(r[key] for r in sizes[which]) / len(sizes[which])
        total = lambda which: sum(r["params"] for r in sizes[which])
        out += [f"Predictors, adaptive widths ({total('adaptive'):,} parameters) against one fixed width "
                f"({sizes['fixed'][0]['width']}, {total('fixed'):,}): a token computes "
                f"{mean('predicted', 'adaptive'):.3f} "
                f"against {mean('predicted', 'fixed'):.3f} of each layer's neurons at held-out recall "
                f"{mean('recall', 'adaptive'):.4f} against {mean('recall', 'fixed'):.4f} (truly active: "
                f"{mean('active', 'adaptive'):.3f}).", "", "![predictor sizes](predictor_sizes.png)", "",
                source("predictor_sizes"), ""]
    return out


SECTIONS: list[Callable[[], list[str]]] = [setup, accuracy, speed, serving, gpu, quantized_weights, cpu_7b, placement,
                                          kernels, activity]


def render() -> str:
    """REPORT.md's text from the files in ``RESULTS``."""
    lines = ["# jpinfer: report", "",
             "Generated by `python bench/report.py` from the files the scripts in `bench/` wrote into "
             "`bench/results/`: every number below is copied from one of them (named in each section).", ""]
    for section in SECTIONS:
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    (RESULTS / "REPORT.md").write_text(render())
    print(RESULTS / "REPORT.md")


if __name__ == "__main__":
    main()
