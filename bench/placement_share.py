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

Also imported by bench/modelled_speed.py (the measured inputs, the transplant, the ReLU skew).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import pathlib
import shlex
import sys
import time
from typing import Sequence

import numpy as np

import jpinfer
from jpinfer.bench.results import publish
from jpinfer.config import ModelConfig
from jpinfer.solver import (
    HardwareProfile,
    InfeasibleBudgetError,
    ModelSizes,
    Placement,
    model_sizes,
    preset,
    solve_placement,
    synthetic_frequencies,
)
from jpinfer.solver.cli import RUNS, SHAPES

GiB = 2**30
CONTEXT = 2048
# PowerInfer (Song et al., 2023): 80% of OPT-30B's activations come from the hottest 26% of its neurons.
RELU_HOT, RELU_SHARE = 0.26, 0.80
RELU_MEAN_ACTIVE = 0.1  # an assumption: the paper's skew figure fixes the shape of the curve, not its mean


# ----- inputs shared with bench/modelled_speed.py


@dataclasses.dataclass(frozen=True)
class Measured:
    """The default model and what was measured on it: per-neuron frequencies, predictor sizes."""

    cfg: ModelConfig
    weight_bytes: int  # the default model's float32 weights
    frequency: np.ndarray  # (n_layers, d_ff)
    source: str  # where the frequencies come from, for report headers
    predictor_bytes: tuple[int, ...]  # per layer, as stored (float32)
    predictor_source: str

    @property
    def predictor_fraction(self) -> float:
        """Predictor bytes over the model's weight bytes: how other shapes are given predictors."""
        return sum(self.predictor_bytes) / self.weight_bytes


def add_measured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", help="ActivationProfile .npz of the default model (default: the default pack's)")
    parser.add_argument("--predictor-bytes-fraction", type=float, default=None,
                        help="predictor bytes as a fraction of the weight bytes, for every shape (default: the "
                             "default pack's predictors; with --profile and without this option: none)")


def measured_inputs(profile_path: str | None, predictor_fraction: float | None) -> Measured:
    """The default model's measured frequencies (``profile_path`` or the default pack's profile, checked
    against the model) and predictor sizes (the pack's, or ``predictor_fraction`` of the weights)."""
    from jpinfer.models.params import nbytes

    model = jpinfer.load_model(None)
    cfg, weight_bytes = model.cfg, nbytes(model.weights)
    pack_predictors = None
    if profile_path:
        prof = jpinfer.ActivationProfile.load(profile_path, model)
        where = profile_path
    else:
        from jpinfer.pack import default_pack  # imported here: only this fallback needs the pack

        pack = default_pack()
        prof, pack_predictors, where = pack.profile, pack.predictors, "the default pack"
    del model
    corpus = prof.meta.get("corpus", {}).get("source", "?")
    target = prof.meta.get("calibration", {}).get("target")
    source = (f"{where}: {prof.n_tokens} tokens of {corpus}, score {prof.meta.get('score', '?')}"
              + (f" over per-layer thresholds for {target:.0%} sparsity" if target is not None else "")
              + f", {prof.frequency().mean():.1%} of the neurons active per token on average")
    if predictor_fraction is not None:
        per_layer = int(predictor_fraction * weight_bytes / cfg.n_layers)
        predictor = ((per_layer,) * cfg.n_layers,
                     f"{predictor_fraction:.2%} of the weight bytes (--predictor-bytes-fraction)")
    elif pack_predictors is not None:
        sizes = tuple(p.n_params * 4 for p in pack_predictors.layers)
        predictor = sizes, f"the default pack's predictors, {sum(sizes) / 2**20:.2f} MiB in float32"
    else:
        predictor = (0,) * cfg.n_layers, "none (--profile given without --predictor-bytes-fraction)"
    return Measured(cfg, weight_bytes, prof.frequency(), source, *predictor)


def transplant(frequency: np.ndarray | Sequence[np.ndarray], n_layers: int, n_neurons: int) -> list[np.ndarray]:
    """A measured skew at another model width and depth.

    Target layer j takes the source layer at the same relative depth (nearest); its neurons, hottest
    first, take the source layer's sorted frequency curve at the same relative rank (midpoints,
    linearly interpolated). The mean activity and the share carried by any top fraction are kept; neuron
    ids carry no meaning (the solver sorts by frequency), so the result is sorted hottest first.
    """
    source = [np.sort(np.asarray(f, np.float64))[::-1] for f in frequency]
    if not source or n_layers < 1 or n_neurons < 1:
        raise ValueError(f"need source layers and n_layers, n_neurons >= 1, got {len(source)}, {n_layers}, {n_neurons}")
    depth = np.rint(np.linspace(0, len(source) - 1, n_layers)).astype(int) if n_layers > 1 else np.zeros(1, int)
    out = []
    for layer in depth:
        curve = source[layer]
        rank = (np.arange(curve.size) + 0.5) / curve.size
        out.append(np.interp((np.arange(n_neurons) + 0.5) / n_neurons, rank, curve))
    return out


def hot_share(frequency: Sequence[np.ndarray], fraction: float = RELU_HOT) -> float:
    """Mean over layers of the activation mass carried by the hottest ``fraction`` of each layer's neurons."""
    shares = []
    for f in frequency:
        f = np.sort(np.asarray(f, np.float64))[::-1]
        shares.append(f[: max(1, round(fraction * f.size))].sum() / f.sum())
    return float(np.mean(shares))


@functools.lru_cache(maxsize=None)
def relu_skew(n_layers: int, n_neurons: int, mean_active: float = RELU_MEAN_ACTIVE, seed: int = 0) -> float:
    """The ``synthetic_frequencies`` exponent at which the hottest 26% of neurons carry 80% of the mass
    (mean over layers), found by bisection on at most 8 layers of the shape (the share depends on the
    width; over layers it only averages the law's +-15% spread)."""
    lo, hi = 0.2, 4.0
    for _ in range(14):  # the share rises with the exponent
        mid = (lo + hi) / 2
        share = hot_share(synthetic_frequencies(min(n_layers, 8), n_neurons, skew=mid, mean_active=mean_active,
                                                seed=seed))
        lo, hi = (mid, hi) if share < RELU_SHARE else (lo, mid)
    return (lo + hi) / 2


def relu_frequencies(n_layers: int, n_neurons: int, mean_active: float = RELU_MEAN_ACTIVE,
                     skew: float | None = None, seed: int = 0) -> list[np.ndarray]:
    """Zipf-like frequencies at the ReLU skew (``relu_skew`` of the shape unless ``skew`` is given)."""
    if skew is None:
        skew = relu_skew(n_layers, n_neurons, mean_active, seed)
    return synthetic_frequencies(n_layers, n_neurons, skew=skew, mean_active=mean_active, seed=seed)


def budget_hardware(name: str, budget: int) -> HardwareProfile:
    """Preset ``name`` with ``budget`` bytes as its whole memory (nothing reserved), as
    ``jpinfer.modes.build.choose_placement`` does."""
    base = preset(name)
    return dataclasses.replace(base.replace(accel_memory=budget, reserved=0), name=f"{name}, budget {budget} B")


def model_weight_bytes(sizes: ModelSizes) -> int:
    """The model's weights: everything on the accelerator but the KV cache and the predictors."""
    return everything_bytes(sizes) - sizes.kv_cache_bytes - sum(sizes.predictor_bytes)


def everything_bytes(sizes: ModelSizes) -> int:
    """The smallest budget that holds the whole model, its predictors and its KV cache."""
    return sizes.required_bytes + sizes.embed_bytes + sizes.lm_head_bytes + sizes.ffn_bytes


def minimum_budget(frequency: Sequence[np.ndarray], sizes: ModelSizes, hardware: str) -> int:
    """The smallest budget the strict dense policy accepts, as the solver states it."""
    try:
        solve_placement(frequency, sizes, budget_hardware(hardware, 1), method="greedy", dense_policy="strict")
    except InfeasibleBudgetError as error:
        return error.minimum_bytes
    return 1


def shape_sizes(cfg: ModelConfig, weight: float, kv: float, predictor_fraction: float,
                predictor_bytes: Sequence[int] | None = None) -> ModelSizes:
    """``model_sizes`` at ``CONTEXT`` with predictors: ``predictor_bytes`` per layer when given, else
    ``predictor_fraction`` of the shape's weight bytes spread over its layers."""
    if predictor_bytes is None:
        bare = model_sizes(cfg, weight_bytes=weight, kv_bytes=kv, context=CONTEXT)
        predictor_bytes = int(predictor_fraction * model_weight_bytes(bare) / cfg.n_layers)
    return model_sizes(cfg, weight_bytes=weight, kv_bytes=kv, context=CONTEXT, predictor_bytes=predictor_bytes)


def solve_runs(frequency: Sequence[np.ndarray], sizes: ModelSizes, hardware: HardwareProfile, runs: Sequence[str],
               time_limit: float) -> dict[str, Placement]:
    """One placement per run name of ``jpinfer.solver.cli.RUNS`` (mass, latency, greedy, layers)."""
    out = {}
    for run in runs:
        method, objective = RUNS[run]
        out[run] = solve_placement(frequency, sizes, hardware, method=method, objective=objective,
                                   dense_policy="strict", time_limit=time_limit)
    return out


def header_lines(title: str, argv: Sequence[str], script: str, presets: Sequence[str]) -> list[str]:
    """Title, command, date, versions, and what the modelled times rest on (the presets' numbers)."""
    import jax

    def describe(name: str) -> str:
        p = preset(name)
        return (f"{name} {p.accel_bandwidth / 1e9:.0f} GB/s, host {p.cpu_bandwidth / 1e9:.1f} GB/s, link "
                f"{p.link_bandwidth / 1e9:.2f} GB/s, sync {p.sync_cost * 1e6:.0f} us")

    return [
        f"# {title}",
        "",
        f"- command: `python bench/{script} {shlex.join(argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; jax {jax.__version__}; "
        "solver: cvxpy + HiGHS",
        "- times are MODELLED by the solver's cost model (src/jpinfer/solver/latency.py) from datasheet presets "
        "(src/jpinfer/solver/hardware.py): batch 1, memory-bound, no kernel launch costs; nothing here ran on a GPU",
        "- presets: " + "; ".join(describe(name) for name in presets),
    ]


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
