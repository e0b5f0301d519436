"""Accelerator share of FFN activation mass against the memory budget, per placement method.

Reproduces the PowerInfer paper's comparison of where the neuron load runs (Song et al., 2023): with
llama.cpp-style layer offload the GPU serves about 20% of it, with PowerInfer's neuron placement about
70%. Here the share is computed from activation frequencies and the solver's placements, not measured
on a GPU.

Protocol: for each memory budget, ``jpinfer.solver.solve_placement`` with method ``milp`` (objective
``mass``, PowerInfer's, and ``latency``), ``greedy`` (hottest neurons of the whole model) and
``layers`` (whole FFN blocks, last layers first, as llama.cpp's ``-ngl``); recorded: the
accelerator's share of the activation mass (``Placement.accel_share``) and the cost model's per-token
time (datasheet presets: MODELLED, not measured). Dense policy ``strict`` (embeddings, head,
attention, predictors and the KV cache stay on the accelerator, as in the hybrid engine), a
2048-token KV cache.
(a) The default model (SmolLM2-135M, float32) with its measured per-neuron frequencies, budgets as
    fractions of its weight bytes, from just above the dense minimum to 1.0 (and the budget that holds
    everything), hardware ``rtx4090`` with the budget as its memory (as ``choose_placement`` does).
(b) Llama-2-7B shapes in fp16 on the ``rtx4090`` and ``rtx2080ti`` presets, budgets from the minimum
    to the whole model (capped at the card's usable memory), with (i) a ReLU model's skew: 80% of the
    activations in the hottest 26% of neurons, as PowerInfer reports for OPT-30B (Song et al., 2023),
    through ``synthetic_frequencies`` with the exponent found by bisection and an ASSUMED mean of 10%
    of neurons active per token; (ii) the default model's measured skew transplanted to 11008 neurons
    per layer (``transplant``).

Frequencies: ``--profile PATH`` (an ``ActivationProfile`` .npz), else the default pack's profile.
Predictor bytes count against the budget: the default pack's predictors as stored, or
``--predictor-bytes-fraction`` of the weights, or none.

    python bench/placement_share.py --out bench/results/placement_share.md

The inputs it shares with bench/modelled_speed.py (the measured frequencies, the transplant, the
ReLU skew, sizes and budgets) live in ``jpinfer.bench.modelled``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

from jpinfer.bench.modelled import (
    CONTEXT,
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
    model_weight_bytes,
    relu_frequencies,
    relu_skew,
    shape_sizes,
    solve_runs,
    transplant,
)
from jpinfer.bench.results import publish
from jpinfer.solver import (
    ModelSizes,
    preset,
)
from jpinfer.solver.shapes import RUNS, SHAPES

# ----- this script


@dataclasses.dataclass
class Case:
    key: str
    title: str
    frequency: list[np.ndarray]
    sizes: ModelSizes
    hardware: str
    budgets: list[int]
    axis: str  # "fraction" (of the weight bytes) or "GiB"
    label: str  # the figure panel's title


def default_model_case(measured: Measured, points: int) -> Case:
    sizes = shape_sizes(measured.cfg, 4, 4, 0.0, measured.predictor_bytes)
    freqs = list(measured.frequency)
    total = model_weight_bytes(sizes)
    low = minimum_budget(freqs, sizes, "rtx4090") / total
    start = np.ceil(low * 100 + 0.5) / 100  # just above the minimum: a few neurons fit
    budgets = [int(f * total) for f in np.linspace(start, 1.0, points)]
    budgets.append(everything_bytes(sizes))
    title = (f"(a) {measured.cfg.name} float32, measured frequencies, rtx4090 preset (weights {total / 2**20:.0f} MiB; "
             f"dense minimum {low:.3f} of them; the last budget holds everything)")
    return Case("default", title, freqs, sizes, "rtx4090", budgets, "fraction",
                "(a) default model (SmolLM2-135M) float32\nmeasured frequencies, rtx4090 preset")


def llama_cases(measured: Measured, points: int) -> list[Case]:
    cfg = SHAPES["llama2-7b"]
    relu = relu_frequencies(cfg.n_layers, cfg.d_ff)
    moved = transplant(measured.frequency, cfg.n_layers, cfg.d_ff)
    sizes = shape_sizes(cfg, 2, 2, measured.predictor_fraction)
    cases = []
    for hw in ("rtx4090", "rtx2080ti"):
        low, full = minimum_budget(relu, sizes, hw), min(everything_bytes(sizes), preset(hw).budget)
        budgets = [int(b) for b in np.linspace(low + 64 * 2**20, full, points)]
        capped = " (capped at the card's usable memory)" if full < everything_bytes(sizes) else ""
        for key, label, freqs in (("relu", "ReLU skew (synthetic)", relu),
                                  ("measured", "measured skew, transplanted", moved)):
            title = (f"(b) Llama-2-7B shape fp16, {label}, {hw} preset; budgets {low / GiB:.2f}-{full / GiB:.2f} GiB"
                     f"{capped}, whole model {everything_bytes(sizes) / GiB:.2f} GiB")
            cases.append(Case(f"7b-{hw}-{key}", title, freqs, sizes, hw, budgets, "GiB",
                              f"(b) Llama-2-7B shape fp16\n{label}, {hw} preset"))
    return cases


def run_case(case: Case, time_limit: float) -> list[dict]:
    rows = []
    total = model_weight_bytes(case.sizes)
    for budget in case.budgets:
        placements = solve_runs(case.frequency, case.sizes, budget_hardware(case.hardware, budget), list(RUNS),
                                time_limit)
        rows.append(dict(budget_bytes=budget, budget_gib=budget / GiB, fraction=budget / total,
                         runs={run: p.summary() for run, p in placements.items()}))
    return rows


def table(case: Case, rows: list[dict]) -> list[str]:
    runs = list(RUNS)
    budget_col = "budget / weights" if case.axis == "fraction" else "budget GiB"
    lines = [
        "| " + " | ".join([budget_col, *(f"share {r}" for r in runs), *(f"modelled ms/token {r}" for r in runs),
                           "mass: status, gap", "latency: status, gap"]) + " |",
        "|" + "---:|" * (1 + 2 * len(runs)) + "---|---|",
    ]
    for row in rows:
        s = row["runs"]
        budget = f"{row['fraction']:.3f}" if case.axis == "fraction" else f"{row['budget_gib']:.2f}"
        solved = [f"{s[r]['status']}, {s[r]['gap']:.1e}" for r in ("mass", "latency")]
        lines.append("| " + " | ".join([budget, *(f"{s[r]['accel_share']:.3f}" for r in runs),
                                         *(f"{s[r]['per_token_time_ms']:.3f}" for r in runs), *solved]) + " |")
    return lines


def paper_point(rows: list[dict]) -> str:
    """The paper's comparison at this case's budget where layer offload holds closest to 20% of the mass."""
    row = min(rows, key=lambda r: abs(r["runs"]["layers"]["accel_share"] - 0.2))
    s = row["runs"]
    return (f"At {row['budget_gib']:.2f} GiB ({row['fraction']:.2f} of the weights), where layer offload holds "
            f"{s['layers']['accel_share']:.1%} of the activation mass (the budget here closest to 20%), the mass "
            f"placement holds {s['mass']['accel_share']:.1%}; modelled {s['mass']['per_token_time_ms']:.2f} (mass), "
            f"{s['latency']['per_token_time_ms']:.2f} (latency) against {s['layers']['per_token_time_ms']:.2f} "
            "ms/token (layers).")


def figure(cases: list[Case], results: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows_n = -(-(len(cases) + 1) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.8 * rows_n), dpi=110, squeeze=False)
    flat = list(axes.flat)
    styles = {"mass": "-o", "latency": "--s", "greedy": ":^", "layers": "-x"}
    for ax, case in zip(flat, cases):
        rows = results[case.key]
        x = [r["fraction"] if case.axis == "fraction" else r["budget_gib"] for r in rows]
        for run in RUNS:
            ax.plot(x, [r["runs"][run]["accel_share"] for r in rows], styles[run], ms=4, label=run)
        ax.set_xlabel("budget / weight bytes" if case.axis == "fraction" else "accelerator budget (GiB)")
        ax.set_ylabel("accelerator share of activation mass")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(case.label, fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = flat[0].get_legend_handles_labels()
    for ax in flat[len(cases):]:
        ax.axis("off")
    flat[len(cases)].legend(handles, ["milp, objective mass", "milp, objective latency", "greedy",
                                      "layers (layer offload)"], loc="center", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measured_arguments(ap)
    ap.add_argument("--points", type=int, default=10, help="budgets of the default model (plus one holding everything)")
    ap.add_argument("--points-7b", type=int, default=9, help="budgets per Llama-2-7B case")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per MILP solve")
    ap.add_argument("--out", help="markdown file; its .json and placement_share.png are written beside it")
    args = ap.parse_args()
    start = time.perf_counter()
    measured = measured_inputs(args.profile, args.predictor_bytes_fraction)
    cases = [default_model_case(measured, args.points), *llama_cases(measured, args.points_7b)]
    relu, moved, seven = cases[1].frequency, cases[2].frequency, SHAPES["llama2-7b"]
    lines = header_lines("Accelerator share of FFN activation mass against the memory budget (modelled)",
                         sys.argv[1:], "placement_share.py", ("rtx4090", "rtx2080ti"))
    lines += [
        f"- measured frequencies: {measured.source}; hottest 26% of neurons carry {hot_share(measured.frequency):.1%} "
        f"of the activations (mean over layers)",
        f"- transplanted to the 7B shape (per layer by relative depth, sorted curve by relative rank): hottest 26% "
        f"carry {hot_share(moved):.1%}",
        f"- ReLU skew: synthetic_frequencies with exponent {relu_skew(seven.n_layers, seven.d_ff):.3f} "
        f"(bisected so that the hottest 26% carry 80%, PowerInfer's OPT-30B figure, Song et al., 2023), mean active "
        f"{RELU_MEAN_ACTIVE:.0%} of the neurons per token (an assumption, +-15% per layer): hottest 26% carry "
        f"{hot_share(relu):.1%}",
        f"- predictors (their bytes count against the budget): {measured.predictor_source}",
        f"- dense policy strict, KV cache of {CONTEXT} tokens (fp32 for (a), fp16 for (b)); per MILP solve "
        f"{args.time_limit:g} s time limit, 0.1% gap asked",
        "- the PowerInfer paper reports the GPU serving about 20% of the neuron load with llama.cpp's layer offload "
        "and about 70% with its placement (Song et al., 2023); compare the `layers` and `mass` columns",
        "- the `latency` objective may hold less mass than `mass` and still be modelled faster: a layer split across "
        "the devices pays two hidden-state copies and a sync, so where a layer's FFN takes little time whole layers "
        "can win; with everything fitting it may leave the coldest neurons on the CPU to run beside the GPU",
        "",
    ]
    png = pathlib.Path(args.out).with_suffix(".png") if args.out else None
    if png:
        png.parent.mkdir(parents=True, exist_ok=True)
        lines += [f"![share against budget]({png.name})", ""]
    results: dict[str, list[dict]] = {}
    for case in cases:
        t0 = time.perf_counter()
        results[case.key] = run_case(case, args.time_limit)
        lines += [f"## {case.title}", "", *table(case, results[case.key]), "", paper_point(results[case.key]),
                  f"({time.perf_counter() - t0:.0f} s for {4 * len(case.budgets)} solves)", ""]
        print(f"[{time.perf_counter() - start:5.0f} s] {case.key} done", file=sys.stderr, flush=True)
    lines.append(f"Total {time.perf_counter() - start:.0f} s.")
    if png:
        figure(cases, results, png)
    data = dict(argv=sys.argv[1:], frequencies=measured.source, predictors=measured.predictor_source,
                relu_mean_active=RELU_MEAN_ACTIVE, context=CONTEXT,
                cases=[dict(key=c.key, title=c.title, hardware=c.hardware, rows=results[c.key]) for c in cases])
    publish("\n".join(lines) + "\n", args.out, data)


if __name__ == "__main__":
    main()
