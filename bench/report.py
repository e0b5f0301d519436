"""bench/results/REPORT.md from the files the reproduction scripts wrote (nothing else).

Each section reads the JSON a script wrote beside its markdown, quotes what matters, shows its
figure and names the command that regenerates it; a section whose file is missing says which
command makes it. Numbers are copied from those files, never typed here.

    python bench/report.py
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from typing import Any, Callable

from jpinfer.bench.gpu_suite import part_note
from jpinfer.bench.protocol import AGREEMENT_LABELS, AGREEMENT_MEANINGS, machine_line, prefix_agreement
from jpinfer.bench.results import Header, read_header
from jpinfer.bench.results import format_cell as fmt
from jpinfer.bench.results import markdown_table as table
from jpinfer.pack.settings import AUTO, AUTO_TARGET, HEAD_AUTO_TARGET

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def missing(command: str) -> list[str]:
    return [f"Not run yet: `{command}`.", ""]


MODEL_WIDE_RUN = "--calibration-windows 16 --test-windows 16 --rounds 5 --prompts 3 --new-tokens 64"
COMMANDS = {  # each one reproduces its file: the options its file records (tests/test_report.py checks them)
    "bench": "jpinfer bench --json bench/results/bench.json --out bench/results/bench.md",
    "long_context": "jpinfer bench --modes dense --peers transformers --lengths 128 1024 4096 --long-prompt 0 "
                    "--max-new-tokens 64 --rounds 3 --ppl-windows 0 --json bench/results/long_context.json "
                    "--out bench/results/long_context.md",
    "first_run": "python bench/first_run.py --out bench/results/first_run.md",
    "accuracy_curves": "python bench/accuracy_curves.py --out bench/results/accuracy_curves.md",
    "model_wide": "python bench/model_wide.py --points ffn:0.5+0.2,ffn:0.5+0.3,all:0.5+0.2+0.2,all:0.5+0.25+0.25,"
                  "all:0.5+0.3+0.3,all:0.6+0.3+0.3,ffn-greedy:0.3,all-greedy:0.3,all-greedy:0.35,all-greedy:0.4 "
                  f"{MODEL_WIDE_RUN} --out bench/results/model_wide.md",
    "model_wide_head": "python bench/model_wide.py --points ffn:0.5+0.25,all:0.5+0.25+0.25,all:0.5+0.25+0.25+0.1,"
                       "all:0.5+0.25+0.25+0.2,all:0.5+0.25+0.25+0.3,all:0.5+0.3+0.3,all:0.5+0.3+0.3+0.2,"
                       "all-greedy:0.35,all-greedy:0.35+0.2 --speed all:0.5+0.25+0.25,all:0.5+0.25+0.25+0.2,"
                       f"all:0.5+0.25+0.25+0.3,all-greedy:0.35+0.2 {MODEL_WIDE_RUN} "
                       "--out bench/results/model_wide_head.md",
    **{f"model_wide_{w}": f"python bench/model_wide.py --weights {w} --points ffn:0.5,all:0.5+0.25+0.25,"
                          "all:0.5+0.3+0.3 --speed ffn:0.5,all:0.5+0.25+0.25,all:0.5+0.3+0.3 "
                          f"{MODEL_WIDE_RUN} --out bench/results/model_wide_{w}.md" for w in ("int8", "int4")},
    "serve": "python bench/serve.py --out bench/results/serve.md",
    "decode_speed": "python bench/decode_speed.py --out bench/results/decode_speed.md",
    "modelled_speed": "python bench/modelled_speed.py --out bench/results/modelled_speed.md",
    "placement_share": "python bench/placement_share.py --out bench/results/placement_share.md",
    "kernel_efficiency": "python bench/kernel_efficiency.py --out bench/results/kernel_efficiency.md",
    "power_law": "python bench/power_law.py --pack --out-dir bench/results",
    "predictor_sizes": "python bench/predictor_sizes.py --out bench/results/predictor_sizes.md",
    "quantized": "python bench/quantized.py --points 'a0.5,a0.4+i0.2,a0.5+i0.3' --test-windows 16 --rounds 5 "
                 "--prompts 4 --new-tokens 128 --threads 2 --out bench/results/quantized.md",
    "cpu_7b": "python bench/cpu_7b.py --out-dir bench/results",
    # on a GPU machine
    "gpu_suite": "PYTHONPATH=src python -m jpinfer.bench gpu --parts checks hybrid modes --update --max-seconds 240 "
                 "--out bench/results",
}


def other_machines(name: str) -> list[tuple[str, dict[str, Any]]]:
    """Runs of ``name``'s script on other machines (``machines/<machine>/<name>.json``): (path under RESULTS,
    data), by machine."""
    return [(p.relative_to(RESULTS).with_suffix("").as_posix(), json.loads(p.read_text()))
            for p in sorted(RESULTS.glob(f"machines/*/{name}.json"))]


def gpu_note() -> str:
    """Whether any number here was measured on a GPU, from the files: the GPU suite's record or its absence."""
    suite = load("gpu_suite")
    if suite is None:
        return ("No GPU run is recorded in bench/results (gpu_suite.json is absent): every number here is from this "
                "CPU, and GPU figures are modelled and say so.")
    return (f"GPU figures measured on {suite['machine']['device']} ({suite['machine']['date']}) are in the GPU "
            "section; other GPU figures are modelled and say so.")


def recorded(name: str) -> Header:
    """The machine, date and command ``name``'s markdown names (its header)."""
    path = RESULTS / f"{name}.md"
    return read_header(path.read_text()) if path.is_file() else Header(None, None, None)


def ran_on(name: str) -> str:
    """'<machine>, <date>' of ``name``'s run, from its file ('not recorded' where it says nothing)."""
    h = recorded(name)
    return f"{h.machine or 'machine not recorded'}, {h.date or 'date not recorded'}"


def source(name: str) -> str:
    return (f"Source: [`{name}.md`]({name}.md) (data: `{name}.json`), ran on {ran_on(name)}; made by "
            f"`{COMMANDS[name]}`.")


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


def paper() -> list[str]:
    """Which of the PowerInfer paper's figures this project reproduces, models or does not, from the files: what
    ran where, and what a reproduction of the rest would need."""
    out = ["## The paper's figures: reproduced, modelled, not reproduced", ""]
    bench, law, share, suite = load("bench"), load("power_law"), load("placement_share"), load("gpu_suite")
    modelled, eff = load("modelled_speed"), load("kernel_efficiency")
    model = bench["model"] if bench else "the default model"
    gpu_runs = (f"the only GPU run recorded is the GPU suite on one {suite['machine']['device']} with random weights "
                "and synthetic activity, its peers jpinfer's own engines ("
                + ", ".join(dict.fromkeys(r["engine"] for k in ("fixed_list", "hybrid", "hybrid_int4", "modes")
                                          if suite.get(k)
                                          for r in suite[k]["rows"])) + ")"
                if suite else "no GPU run is recorded")
    sparsity = f"{bench['pack']['settings']['sparsity']:.0%}" if bench and bench.get("pack") else "a chosen share"
    rows = [
        ["decode speed-up over llama.cpp, up to 11.69x, mean 7.23x (RTX 4090, ReLU models, hybrid CPU+GPU)",
         "**not reproduced**",
         f"No consumer GPU run: {gpu_runs}. The bench's model, {model}, is SwiGLU: none of its FFN outputs is "
         f"exactly zero, so the pack skips {sparsity} of the neurons by thresholds, at a perplexity cost (section "
         "Accuracy), where the paper's ReLU models skip their zeros for free. It would take a ReLU model (a "
         "ReLU-fied Llama as in the paper), an RTX 4090 host, llama.cpp built with CUDA offloading as many layers "
         "as the same GPU budget holds, and `jpinfer bench` with the hybrid mode against it on that machine.",
         "[gpu_suite](gpu_suite.md), [bench](bench.md)"],
        ["hybrid speed on GPUs against layer offload", "**modelled**",
         "The placement solver's cost model on datasheet presets ("
         + ", ".join(sorted({r["preset"] for c in (modelled or {}).get("cases", []) for r in c["rows"]}))
         + ") with an oracle predictor: upper bounds, not measurements (section Speed).",
         "[modelled_speed](modelled_speed.md)"],
        ["the GPU's share of the activation mass, about 70% against about 20% for layer offload", "**modelled**",
         "The MILP and greedy placements against layer offload at the same budgets, on measured (default model) and "
         f"synthetic ReLU frequencies{' (section Placement)' if share else ''}.",
         "[placement_share](placement_share.md)"],
        ["power-law activity: 80% of the activations in 26% of the neurons (OPT-30B)", "**measured, differs**",
         (f"On {model}: the hottest {law['mean']['share_80']:.1%} of a layer's neurons carry 80% (mean over "
          "layers): SwiGLU activity is close to uniform." if law else "not run"), "[power_law](power_law.md)"],
        ["sparse FFN kernels that turn skipped neurons into time", "**measured**",
         (f"CPU: the sparse FFN op against the dense FFN at {min(r['s'] for r in eff['cpu']):.0%}-"
          f"{max(r['s'] for r in eff['cpu']):.0%} sparsity" if eff else "CPU: not run")
         + "; GPU: the suite's kernel table (sections Kernels, GPU).", "[kernel_efficiency](kernel_efficiency.md)"],
        ["activation predictors and accuracy near dense", "**measured**",
         "Perplexity of the oracle, predictor and threshold modes against the bytes they read, and the predictors' "
         "recall and size (sections Accuracy, Activity).",
         "[accuracy_curves](accuracy_curves.md), [predictor_sizes](predictor_sizes.md)"],
    ]
    out += table(["the paper's figure", "here", "what ran, or what it would take", "file"], rows)
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
    out = ["## Speed", "", f"### Every engine on the paper's protocol (measured on {ran_on('bench')})", ""]
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
        out += same_machine_runs("bench")
        out += same_command_elsewhere("bench", bench)
    out += [f"### Long prompts (measured on {ran_on('long_context')})", ""]
    long = load("long_context")
    if long is None:
        out += missing(COMMANDS["long_context"])
    else:
        out += [f"{machine_line(long['machine'])} {long['protocol']['max_new_tokens']} greedy output tokens, "
                f"{long['protocol']['rounds']} interleaved rounds; prefill tok/s / decode tok/s per prompt length:", ""]
        out += per_length(long, lambda r: f"{r['prefill_tok_s']:.0f} / {r['decode_tok_s']:.1f}")
        out += ["", source("long_context"), ""]
    out += [f"### Against sparsity and budget (measured on {ran_on('decode_speed')})", ""]
    decode = load("decode_speed")
    if decode is None:
        out += missing(COMMANDS["decode_speed"])
    else:
        if recorded("decode_speed").machine != recorded("bench").machine:
            out += [f"An older run on another machine than the main bench's ({ran_on('bench')}), with the code of its "
                    "date: compare its speeds within this table only.", ""]
        out += ["![decode speed](decode_speed.png)", ""]
        out += table(["engine", "setting", "FFN bytes read", "decode tok/s", "x dense"],
                     [[r["kind"], r["setting"], fmt(r["bytes"], ".3f"), f"{r['decode_tok_s']:.1f}",
                       f"{r['vs_dense']:.2f}"] for r in decode["rows"]])
        out += ["", source("decode_speed"), ""]
    out += ["### On GPUs (MODELLED, not measured; oracle predictor, upper bound)", ""]
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
            gpu_run = ("the recorded GPU suite run holds no fixed-list decode" if load("gpu_suite") else
                        "no GPU run is recorded in bench/results")
            out += ["", f"Measured against modelled: {gpu_run}"
                    + f", so the model's error is not measured yet (`{COMMANDS['gpu_suite']}` on a GPU machine records "
                    "one, then `" + COMMANDS["modelled_speed"] + "`)."]
        out += ["", source("modelled_speed"), ""]
    return out


RUNS_HEADING = "## Runs recorded on this machine"


def same_machine_runs(name: str) -> list[str]:
    """The section of ``name``.md, written by hand, that lists every recorded run of its command on its machine
    with their median and range: the JSON keeps the last run only, and the headline rule quotes the median of
    all of them, so the report shows that section beside the run its tables copy."""
    path = RESULTS / f"{name}.md"
    _, found, rest = (path.read_text() if path.is_file() else "").partition(RUNS_HEADING + "\n")
    if not found:
        return []
    anchor = RUNS_HEADING.lstrip("# ").lower().replace(" ", "-")
    body = rest.split("\n## ")[0].strip()
    return [f"The runs of this command recorded on this machine, their median and range (from [`{name}.md`]"
            f"({name}.md#{anchor})):", "", *body.splitlines(), ""]


def same_command_elsewhere(name: str, here: dict[str, Any]) -> list[str]:
    """Each engine's decode x dense in this run and in the same command's runs on other machines, so a reader
    sees the spread of the recorded runs beside the one shown (each a median of same-round ratios)."""
    others = other_machines(name)
    if not others:
        return []
    runs = [(name, here), *others]
    engines = list(dict.fromkeys(r["engine"] for _, data in runs for r in data["engines"]))
    by = {(path, r["engine"]): r for path, data in runs for r in data["engines"]}
    header = [f"[`{path}.md`]({path}.md) ({ran_on(path)})" for path, _ in runs]
    out = ["This run beside the same command's runs on other machines (decode x dense; another CPU and cache, "
           "and the code of each run's date):", ""]
    out += table(["engine", *header], [[e, *(fmt((by.get((path, e)) or {}).get("decode_vs_dense"), ".2f")
                                             for path, _ in runs)] for e in engines])
    return out + [""]


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
    sweep = "Hybrid against layer offload (synthetic activity, oracle predictor, upper bound)"
    for key, title in (("fixed_list", "Fixed-list sparse decode (no predictor)"), ("hybrid", sweep),
                       ("hybrid_int4", sweep),
                       ("modes", "The default model's engines (synthetic activity, oracle predictor, upper bound)")):
        part = suite.get(key)
        if not part:
            continue
        weights = f"; weights: {part['weights']}" if "weights" in part else ""
        weights += f"; weights format: {part['format']}" if "format" in part else ""
        out += ["", f"{title}, {part['model']}{weights}:", ""]
        out += [f"- {fact}" for fact in part.get("facts", [])] + ([""] if part.get("facts") else [])
        budgets = any("budget" in r for r in part["rows"])  # a budget sweep: x dense within each budget's rounds
        out += table(["GPU budget"] * budgets + ["engine", "decode tok/s", "x dense", "greedy agreement (prefix)",
                                                  "note"],
                     [[fmt(r.get("budget"), "g")] * budgets + [
                         r["engine"], fmt(r.get("tok_s"), ".1f"), fmt(r.get("vs_dense"), ".2f"),
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
    span = lambda pair: "-" if pair is None else f"{pair[0]:.2f}-{pair[1]:.2f}"
    out += table(["engine", "perplexity x float32", "decode tok/s", "x jpinfer float32", "range",
                  "x llama.cpp (speed)", "range", "x llama.cpp (perplexity)"],
                 [[r["engine"], fmt(r["ppl_ratio"], ".3f"), fmt(r["tok_s"], ".1f"), fmt(r["speedup"], ".2f"),
                   span(r.get("speedup_range")), fmt(r.get("x_llama_cpp"), ".2f"), span(peer_range(data, r)),
                   fmt(r.get("ppl_x_llama_cpp"), ".3f")] for r in rows])
    out += ["", peer_settings(data)]
    others = other_machines("quantized")
    if others:
        out += ["", "The same script on other machines (x llama.cpp, speed; each run's llama.cpp settings beside "
                "it):", ""]
        out += table(["run", *(r["engine"] for r in rows if "x_llama_cpp" in r), "llama.cpp"],
                     [[f"[`{path}.md`]({path}.md) ({ran_on(path)})",
                       *(fmt(next((o.get("x_llama_cpp") for o in other["rows"] if o["engine"] == r["engine"]),
                                  None), ".2f") for r in rows if "x_llama_cpp" in r),
                       peer_settings(other)] for path, other in others])
    return out + ["", source("quantized"), ""]


def peer_settings(data: dict[str, Any]) -> str:
    """How llama.cpp ran in a quantized run: with its weight repacking (its default) unless the run's notes say
    it could not."""
    return " ".join(data.get("peer_notes") or []) or "llama.cpp ran with its weight repacking (its default)."


def peer_range(data: dict[str, Any], row: dict[str, Any]) -> tuple[float, float] | None:
    """The range of a row's same-round decode ratios to its llama.cpp peer, from the run's per-round tok/s; the
    peer is the llama.cpp engine whose ratios' median is the recorded one (the run names no peer per row)."""
    rounds = data.get("tok_s_rounds") or {}
    mine = rounds.get(row["engine"])
    if mine is None or row.get("x_llama_cpp") is None:
        return None
    for peer, theirs in rounds.items():
        ratios = [a / b for a, b in zip(mine, theirs)]
        if (peer.startswith("llama.cpp") and len(theirs) == len(mine)
                and math.isclose(statistics.median(ratios), row["x_llama_cpp"], rel_tol=1e-9)):
            return min(ratios), max(ratios)
    return None


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


SECTIONS: list[Callable[[], list[str]]] = [setup, paper, accuracy, speed, serving, gpu, quantized_weights, cpu_7b,
                                          placement, kernels, activity]


def render() -> str:
    """REPORT.md's text from the files in ``RESULTS``."""
    lines = ["# jpinfer: report", "",
             "Generated by `python bench/report.py` from the files the scripts in `bench/` wrote into "
             "`bench/results/`: every number below is copied from one of them (named in each section, with the "
             "machine and date of its run; `INDEX.md` lists every file).", "",
             "How to read a figure: each table is one recorded run of the machine named with it, never the best "
             "of several (where a file records several runs of one machine, their median and range stand beside "
             "it: the headline rule of docs/bench.md); a speed-up 'x' is the median of same-round ratios over the "
             "run's interleaved rounds, "
             "with their range beside it where the file records the rounds; where the same script ran on other "
             "machines their figures stand beside it, named; a comparison with llama.cpp says how llama.cpp ran "
             "(its weight repacking on, its default, or off).", ""]
    for section in SECTIONS:
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    (RESULTS / "REPORT.md").write_text(render())
    print(RESULTS / "REPORT.md")


if __name__ == "__main__":
    main()
