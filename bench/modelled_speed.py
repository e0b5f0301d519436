"""Modelled hybrid decode speed on GPUs this machine lacks: jpinfer's placement against the baselines.

Nothing here runs on a GPU: every time is the placement solver's cost model (src/jpinfer/solver/
latency.py: batch 1, memory-bound, datasheet presets of src/jpinfer/solver/hardware.py, no kernel
launch costs), fed with activation frequencies measured on the default model.

Protocol: per model shape, frequency set and preset (``rtx4090`` with its desktop host, ``a100-80gb``,
``h200``), the budget is the preset's memory less its reserve (what a user of that card gets). Modelled
per-token time and tok/s of jpinfer's placement (``milp``, objective ``latency``), the ``greedy``
placement and layer offload (``layers``, as llama.cpp's ``-ngl``), and, when everything fits, the
dense model all on the GPU (every neuron read: the model's bytes over the GPU's bandwidth, by the same
cost model). Shapes: the default model (float32 and bf16), Llama-2 7B / 13B / 70B in fp16 and 70B at
4.5 bits per weight; frequencies: the default model's measured ones (transplanted to the larger shapes
by ``jpinfer.bench.modelled.transplant``) and a ReLU model's skew (80% of activations in 26% of neurons,
PowerInfer's OPT-30B figure, Song et al., 2023; 10% active per token ASSUMED), as in
bench/placement_share.py. Dense policy strict, 2048-token KV cache. A figure: modelled tok/s against
the GPU budget for 7B fp16 on the ``rtx4090`` preset (both skews), and against activation sparsity at
a 12 GiB budget (ReLU skew). Where a GPU suite run is recorded (bench/results/gpu_suite.json, from
``python -m jpinfer.bench gpu --out bench/results``), its fixed-list decode speeds sit next to the modelled
ones with the model's error.

    python bench/modelled_speed.py --out bench/results/modelled_speed.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time

import numpy as np

from jpinfer.bench.layer_offload import LLAMA2_7B, TINY  # the shapes the GPU suite's fixed-list decode measures
from jpinfer.bench.modelled import (
    RELU_MEAN_ACTIVE,
    GiB,
    Measured,
    add_measured_arguments,
    budget_hardware,
    everything_bytes,
    header_lines,
    hot_share,
    measured_inputs,
    minimum_budget,
    relu_frequencies,
    relu_skew,
    shape_sizes,
    solve_runs,
    transplant,
)
from jpinfer.bench.results import publish
from jpinfer.config import ModelConfig
from jpinfer.runtime.generation import MIN_PROMPT_BUCKET, attend_length, generation_shapes
from jpinfer.solver import InfeasibleBudgetError, ModelSizes, model_sizes, preset, solve_placement
from jpinfer.solver.shapes import SHAPES

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PRESETS = ("rtx4090", "a100-80gb", "h200")
RUNS = ("latency", "greedy", "layers")  # names of jpinfer.solver.shapes.RUNS
RUN_LABELS = {"latency": "jpinfer (milp, latency)", "greedy": "greedy", "layers": "layer offload"}
# Llama-2-13B: hidden 5120, FFN 13824, 40 layers of 40 heads of 128 (Touvron et al., 2023; the released
# config.json); the other dimensions as the 7B shape.
LLAMA2_13B = dataclasses.replace(SHAPES["llama2-7b"], d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                                 d_ff=13824, name="llama2-13b-shape")
SPARSITY_BUDGET = 12 * GiB
MEAN_ACTIVE = (0.5, 0.35, 0.2, 0.1, 0.05, 0.02)
# device_kind substrings of the cards that have a preset; an A100 only in its 80 GB form
DEVICE_PRESETS = (("H200", "h200"), ("A100", "a100-80gb"), ("4090", "rtx4090"), ("2080 Ti", "rtx2080ti"))


@dataclasses.dataclass(frozen=True)
class Shape:
    key: str
    label: str
    cfg: ModelConfig
    weight_bytes: float
    kv_bytes: float
    default_model: bool = False  # frequencies measured on it directly; predictors as the pack stores them


def shapes(measured: Measured) -> list[Shape]:
    return [
        Shape("default-f32", f"default model ({measured.cfg.name}) float32", measured.cfg, 4, 4, True),
        Shape("default-bf16", f"default model ({measured.cfg.name}) bf16", measured.cfg, 2, 2, True),
        Shape("7b", "Llama-2-7B shape fp16", SHAPES["llama2-7b"], 2, 2),
        Shape("13b", "Llama-2-13B shape fp16", LLAMA2_13B, 2, 2),
        Shape("70b", "Llama-2-70B shape fp16", SHAPES["llama2-70b"], 2, 2),
        Shape("70b-q", "Llama-2-70B shape, 4.5 bits per weight (q4_0-sized)", SHAPES["llama2-70b"], 0.5625, 2),
    ]


def sizes_of(shape: Shape, measured: Measured) -> ModelSizes:
    pred = measured.predictor_bytes if shape.default_model else None
    return shape_sizes(shape.cfg, shape.weight_bytes, shape.kv_bytes, measured.predictor_fraction, pred)


def frequencies(shape: Shape, skew: str, measured: Measured) -> list[np.ndarray]:
    cfg = shape.cfg
    if skew == "relu":
        return relu_frequencies(cfg.n_layers, cfg.d_ff)
    return list(measured.frequency) if shape.default_model else transplant(measured.frequency, cfg.n_layers, cfg.d_ff)


def dense_seconds(sizes: ModelSizes, hardware: str) -> float:
    """Modelled time of the dense model all on the accelerator: every neuron active, a budget holding all."""
    ones = [np.ones(sizes.n_neurons)] * sizes.n_layers
    return solve_placement(ones, sizes, budget_hardware(hardware, everything_bytes(sizes)), method="greedy",
                           dense_policy="strict").per_token_time


def speed_row(freqs: list[np.ndarray], sizes: ModelSizes, hardware: str, time_limit: float) -> dict:
    """One (shape, skew, preset) row: the preset's own budget, every method, the dense time when it fits."""
    hw = preset(hardware)
    need = everything_bytes(sizes)
    row = dict(preset=hardware, budget_gib=hw.budget / GiB, need_gib=need / GiB, fits=need <= hw.budget,
               dense_ms=1e3 * dense_seconds(sizes, hardware) if need <= hw.budget else None)
    try:
        placements = solve_runs(freqs, sizes, hw, RUNS, time_limit)
    except InfeasibleBudgetError as error:
        return row | dict(minimum_gib=error.minimum_bytes / GiB, runs=None)
    return row | dict(runs={run: p.summary() for run, p in placements.items()})


def tok_s(ms: float | None) -> str:
    return "-" if ms is None else f"{1e3 / ms:.1f}"


def ms_tok_s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f} ({1e3 / ms:.1f})"


def speed_table(rows: list[dict]) -> list[str]:
    methods = [f"{RUN_LABELS[run]}: modelled ms/token (tok/s)" for run in RUNS]
    lines = [
        "| skew | preset | GPU budget GiB | whole model GiB | fits | " + " | ".join(methods)
        + " | dense, all on GPU: modelled ms/token (tok/s) | jpinfer share | jpinfer / layer offload speed "
        "| jpinfer: status, gap |",
        "|---|---|---:|---:|---|" + "---:|" * (len(RUNS) + 3) + "---|",
    ]
    for r in rows:
        head = [r["skew"], r["preset"], f"{r['budget_gib']:.1f}", f"{r['need_gib']:.2f}", "yes" if r["fits"] else "no"]
        if r["runs"] is None:
            why = f"does not fit: the strict dense part needs {r['minimum_gib']:.1f} GiB"
            lines.append("| " + " | ".join(head + [why] + ["-"] * (len(RUNS) + 3)) + " |")
            continue
        s = r["runs"]
        ms = {run: s[run]["per_token_time_ms"] for run in RUNS}
        lines.append("| " + " | ".join(head + [
            *(ms_tok_s(ms[run]) for run in RUNS), ms_tok_s(r["dense_ms"]), f"{s['latency']['accel_share']:.3f}",
            f"{ms['layers'] / ms['latency']:.2f}x", f"{s['latency']['status']}, {s['latency']['gap']:.1e}",
        ]) + " |")
    return lines


def budget_sweep(freqs: list[np.ndarray], sizes: ModelSizes, hardware: str, points: int,
                 time_limit: float) -> list[dict]:
    """Modelled speeds from the dense minimum to the budget holding everything, on ``hardware``'s bandwidths."""
    low, high = minimum_budget(freqs, sizes, hardware), everything_bytes(sizes)
    out = []
    for budget in np.linspace(low + 64 * 2**20, high, points).astype(int):
        placements = solve_runs(freqs, sizes, budget_hardware(hardware, int(budget)), RUNS, time_limit)
        out.append(dict(budget_gib=budget / GiB, ms={run: 1e3 * p.per_token_time for run, p in placements.items()}))
    return out


def sparsity_sweep(sizes: ModelSizes, hardware: str, time_limit: float) -> tuple[float, list[dict]]:
    """Modelled speeds at ``SPARSITY_BUDGET`` for mean activity ``MEAN_ACTIVE`` at the ReLU exponent (fixed at
    its 10%-active value: at 50% active the hottest 26% cannot carry 80%, since no neuron fires more than always)."""
    skew = relu_skew(sizes.n_layers, sizes.n_neurons)
    out = []
    for mean in MEAN_ACTIVE:
        freqs = relu_frequencies(sizes.n_layers, sizes.n_neurons, mean, skew)
        placements = solve_runs(freqs, sizes, budget_hardware(hardware, SPARSITY_BUDGET), RUNS, time_limit)
        out.append(dict(mean_active=mean, hot26=hot_share(freqs),
                        ms={run: 1e3 * p.per_token_time for run, p in placements.items()}))
    return skew, out


# ----- measured against modelled


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A measured decode speed next to the cost model's time for the same configuration."""

    source: str
    configuration: str
    measured_tok_s: float
    modelled_s: float

    @property
    def measured_ms(self) -> float:
        return 1e3 / self.measured_tok_s

    @property
    def modelled_ms(self) -> float:
        return 1e3 * self.modelled_s

    @property
    def error(self) -> float:
        """(modelled - measured) / measured time: negative when the model is optimistic."""
        return self.modelled_s * self.measured_tok_s - 1


def device_preset(device_kind: str) -> str | None:
    """The preset of a JAX device kind ("NVIDIA H200" -> "h200"), None when no preset matches."""
    for part, name in DEVICE_PRESETS:
        if part in device_kind and (name != "a100-80gb" or "80GB" in device_kind.replace(" ", "")):
            return name
    return None


def fixed_list_seconds(cfg: ModelConfig, dtype_bytes: int, kv_slots: int, hardware: str, active: int) -> float:
    """Modelled step of ``cfg`` all on the accelerator computing ``active`` neurons per layer (a fixed list:
    every neuron at frequency active / d_ff), with a ``kv_slots``-position KV cache."""
    sizes = model_sizes(cfg, weight_bytes=dtype_bytes, kv_bytes=dtype_bytes, vector_bytes=dtype_bytes,
                        context=kv_slots)
    freqs = [np.full(cfg.d_ff, active / cfg.d_ff)] * cfg.n_layers
    return solve_placement(freqs, sizes, budget_hardware(hardware, everything_bytes(sizes)), method="greedy",
                           dense_policy="strict").per_token_time


def gpu_decode_comparisons(record: dict, source: str = "gpu_suite.json") -> tuple[list[Comparison], str]:
    """The GPU suite's fixed-list decode (``gpu_suite.json``'s ``fixed_list``: device, model, new_tokens, dtype,
    median tok/s per engine "dense" or "sparse s=S (K=K)")
    as comparisons with the modelled step on the device's preset, and a note
    (why nothing is compared, or the preset used)."""
    name = device_preset(record["device"])
    if name is None:
        return [], f"{source}: no preset for device {record['device']!r}; not compared"
    cfg = {c.name: c for c in (LLAMA2_7B, TINY)}.get(record["model"])
    if cfg is None:
        return [], f"{source}: unknown model {record['model']!r}; not compared"
    dtype_bytes = {"bfloat16": 2, "float32": 4}[record.get("dtype", "float32" if cfg is TINY else "bfloat16")]
    # the cache slots the run's last step attends over (the rung ``attend_length`` picks in the cache the Engine
    # allocates), which the cost model reads as the KV cache
    positions = MIN_PROMPT_BUCKET + record["new_tokens"]
    kv_slots = attend_length(positions, generation_shapes(MIN_PROMPT_BUCKET, record["new_tokens"], cfg.max_position)[1])
    out = []
    for engine, tps in record["median"].items():
        if engine == "dense":
            active = cfg.d_ff
        elif match := re.fullmatch(r"sparse s=\S+ \(K=(\d+)\)", engine):
            active = int(match.group(1))
        else:
            continue
        seconds = fixed_list_seconds(cfg, dtype_bytes, kv_slots, name, active)
        out.append(Comparison(source, f"{cfg.name}, {engine}, all on {record['device']}", tps, seconds))
    return out, f"{source}: {record['device']} modelled with the {name} preset, attention over {kv_slots} cache slots"


def measured_section(results: pathlib.Path) -> tuple[list[str], list[dict]]:
    lines = ["## Measured against modelled", ""]
    record = results / "gpu_suite.json"
    fixed = json.loads(record.read_text()).get("fixed_list") if record.is_file() else None
    rows: list[Comparison] = []
    if fixed:
        rows, note = gpu_decode_comparisons(fixed, record.name)
        lines += [f"- {note}"]
    else:
        where = record.relative_to(ROOT) if record.is_relative_to(ROOT) else record
        state = "holds no fixed-list decode" if record.is_file() else "is absent"
        lines += [f"- No GPU run is recorded ({where} {state}): on a GPU machine run "
                  "`PYTHONPATH=src python -m jpinfer.bench gpu --out bench/results`, then this script again."]
    lines += ["- The GPU suite's hybrid rows are not compared: a hybrid comparison also needs the GPU host's measured "
              "CPU bandwidth (`jpinfer.solver.measure_hardware`), which no preset has"]
    if rows:
        lines += ["", "| configuration | measured ms/token | modelled ms/token | model error (time) |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {c.configuration} | {c.measured_ms:.3f} | {c.modelled_ms:.3f} | {c.error:+.1%} |" for c in rows]
    data = [dict(dataclasses.asdict(c), measured_ms=c.measured_ms, modelled_ms=c.modelled_ms, error=c.error)
            for c in rows]
    return lines + [""], data


# ----- figure and report


def figure(sweeps: dict[str, list[dict]], sparsity: list[dict], dense: tuple[float, float], path: pathlib.Path) -> None:
    """``dense``: (GiB, ms) of the dense model all on the GPU, marked on the budget panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"latency": "-o", "greedy": ":^", "layers": "-x"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    titles = {"relu": "ReLU skew (synthetic, 10% active)", "measured": "measured skew (default model, transplanted)"}
    for ax, (skew, rows) in zip(axes, sweeps.items()):
        for run in RUNS:
            ax.plot([r["budget_gib"] for r in rows], [1e3 / r["ms"][run] for r in rows], styles[run], ms=4,
                    label=RUN_LABELS[run])
        ax.plot([dense[0]], [1e3 / dense[1]], "k*", ms=9, label="dense, all on the GPU")
        ax.set_xlabel("GPU memory budget (GiB)")
        ax.set_title(f"Llama-2-7B fp16, rtx4090 preset\n{titles[skew]}", fontsize=9)
    ax = axes[2]
    for run in RUNS:
        ax.plot([1 - r["mean_active"] for r in sparsity], [1e3 / r["ms"][run] for r in sparsity], styles[run], ms=4,
                label=RUN_LABELS[run])
    ax.set_xlabel("activation sparsity (1 - mean fraction of neurons active)")
    ax.set_title(f"Llama-2-7B fp16, rtx4090 preset, {SPARSITY_BUDGET / GiB:.0f} GiB budget\n"
                 "ReLU skew's exponent, mean activity varied", fontsize=9)
    for ax in axes:
        ax.set_ylabel("modelled decode tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep_table(rows: list[dict], first: str, key: str, fmt: str) -> list[str]:
    lines = [f"| {first} | " + " | ".join(f"modelled tok/s {RUN_LABELS[r]}" for r in RUNS) + " |",
             "|---:|" + "---:|" * len(RUNS)]
    return lines + [f"| {format(r[key], fmt)} | " + " | ".join(tok_s(r["ms"][run]) for run in RUNS) + " |"
                    for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measured_arguments(ap)
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per MILP solve")
    ap.add_argument("--points", type=int, default=8, help="budgets in the figure's budget sweep")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS,
                    help="directory holding a recorded GPU suite run (gpu_suite.json)")
    ap.add_argument("--out", help="markdown file; its .json and modelled_speed.png are written beside it")
    args = ap.parse_args()
    start = time.perf_counter()
    log = lambda what: print(f"[{time.perf_counter() - start:5.0f} s] {what}", file=sys.stderr, flush=True)
    measured = measured_inputs(args.profile, args.predictor_bytes_fraction)
    lines = header_lines("Modelled hybrid decode speed (no GPU run: cost model only)", sys.argv[1:],
                         "modelled_speed.py", PRESETS)
    lines += [
        f"- measured frequencies: {measured.source} (hottest 26% of neurons carry {hot_share(measured.frequency):.1%} "
        "of the activations); for the Llama shapes transplanted per layer by relative depth, the sorted curve by "
        "relative rank",
        "- ReLU skew: synthetic_frequencies with the exponent at which the hottest 26% carry 80% (PowerInfer's "
        f"OPT-30B figure, Song et al., 2023), mean active {RELU_MEAN_ACTIVE:.0%} per token (an assumption)",
        f"- predictors (bytes on the GPU): {measured.predictor_source}; for the Llama shapes the same fraction of "
        f"their weight bytes ({measured.predictor_fraction:.2%}, an assumption)",
        "- budget: the preset's memory less its 1 GiB reserve; dense policy strict (embeddings, head, attention, "
        "predictors and a 2048-token KV cache on the GPU); MILP per solve: "
        f"{args.time_limit:g} s limit, 0.1% gap asked",
        "- `fits`: the whole model, predictors and KV cache fit the budget; then every neuron could live on the GPU, "
        "and the latency objective may still leave the coldest on the CPU where the cost model predicts that "
        "running them there in parallel is faster",
        "- the cost model has no kernel launch or host dispatch cost: for the 135M default model its times are a "
        "floor, far below what a runtime reaches",
        "",
    ]
    png = pathlib.Path(args.out).with_suffix(".png") if args.out else None
    if png:
        png.parent.mkdir(parents=True, exist_ok=True)
        lines += [f"![modelled speed]({png.name})", ""]
    cases = []
    for shape in shapes(measured):
        sizes = sizes_of(shape, measured)
        rows = []
        for skew in ("measured", "relu"):
            freqs = frequencies(shape, skew, measured)
            for hardware in PRESETS:
                rows.append(dict(skew=skew, **speed_row(freqs, sizes, hardware, args.time_limit)))
        overlap = [r for r in rows if r["fits"] and r["runs"] and r["runs"]["latency"]["accel_share"] < 1]
        cases.append(dict(key=shape.key, title=shape.label, rows=rows))
        lines += [f"## {shape.label} (modelled)", "", *speed_table(rows), ""]
        if overlap:
            lines += ["Where it fits yet jpinfer's share is below 1, the latency objective leaves the coldest "
                      "neurons on the CPU to run beside the GPU (the cost model's max(GPU, CPU + copies + sync) per "
                      "layer).", ""]
        log(f"{shape.key} done")

    seven = next(shape for shape in shapes(measured) if shape.key == "7b")
    sizes7 = sizes_of(seven, measured)
    sweeps = {skew: budget_sweep(frequencies(seven, skew, measured), sizes7, "rtx4090", args.points, args.time_limit)
              for skew in ("relu", "measured")}
    log("budget sweeps done")
    skew, sparsity = sparsity_sweep(sizes7, "rtx4090", args.time_limit)
    log("sparsity sweep done")
    lines += ["## Llama-2-7B fp16 on the rtx4090 preset: modelled tok/s against the GPU budget", ""]
    for name, rows in sweeps.items():
        lines += [f"{name} skew:", "", *sweep_table(rows, "budget GiB", "budget_gib", ".2f"), ""]
    lines += [f"## Llama-2-7B fp16, rtx4090 preset, {SPARSITY_BUDGET / GiB:.0f} GiB: modelled tok/s against activation "
              f"sparsity (ReLU exponent {skew:.3f} at every mean; hot26 = share of the hottest 26%)", "",
              *sweep_table([r | dict(label=f"{r['mean_active']:.2f} (hot26 {r['hot26']:.2f})") for r in sparsity],
                           "mean active", "label", ""), ""]
    comparison, compared = measured_section(args.results)
    lines += comparison
    lines.append(f"Total {time.perf_counter() - start:.0f} s.")
    if png:
        figure(sweeps, sparsity, (everything_bytes(sizes7) / GiB, 1e3 * dense_seconds(sizes7, "rtx4090")), png)
    data = dict(argv=sys.argv[1:], frequencies=measured.source, predictors=measured.predictor_source,
                predictor_fraction=measured.predictor_fraction, relu_mean_active=RELU_MEAN_ACTIVE, cases=cases,
                budget_sweeps=sweeps, sparsity_sweep=dict(skew=skew, budget_gib=SPARSITY_BUDGET / GiB, rows=sparsity),
                measured_vs_modelled=compared)
    publish("\n".join(lines) + "\n", args.out, data)


if __name__ == "__main__":
    main()
