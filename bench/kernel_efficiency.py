"""Kernel efficiency against sparsity: the sparse FFN op against the dense FFN, on the CPU and on a GPU.

Efficiency = speedup over dense x (1 - s): 1.0 means the sparse op reads the (1 - s) share of the weights
it needs as fast as the dense FFN reads all of them; below 1.0 each byte costs it more than it costs dense.

CPU protocol (measured by this script, float32): for the layer shapes in ``--shapes``, one FFN layer a call,
timed by ``jpinfer.bench.kernels.bench_shape`` (the table of ``jpinfer bench-kernels``): the decoder's dense
FFN against ``sparse_ffn`` (backend auto: the native fused kernel on the CPU, the chunked XLA loop where the
native library is unavailable; the table says which ran) over random lists of
(1 - s) * d_ff neurons, calls cycling through copies of the layer and through several lists so that every
call reads from memory, the ops alternating in ``--rounds`` rounds of 3 calls, the fastest call counting
(``bench_shape`` also times the first sparse FFN, ``before``: its numbers are in the JSON only); and the same
ops with enough layers of their own weights chained in one jit to pass the caches (``bench_chained``), as a
decode step runs them: a lone call of a small op carries all of a call's fixed costs, a chain spreads them over its
layers (the default model's layer is small enough for that to show at high sparsity). The
whole set runs ``--repeats`` times, shapes interleaved within each repeat and a new seed per repeat; since
the machine is shared and the ratios move with its load, the recorded efficiency is the median of the
repeats' same-run efficiencies (their range beside it), with the load average before, at each repeat and
after.

GPU: nothing is timed here. The accelerator table recorded on a GPU machine by
``python -m jpinfer.bench --kernels --tokens 1 4 --out bench/results/gpu_kernels.md`` (its data in
``gpu_kernels.json`` beside it: per layer shape, 32 layers chained in one jit, bfloat16) is read when present and its
efficiency per kernel variant plotted and listed; otherwise the figure and the table say so, and point to the GPU
suite's kernel table (``bench/results/gpu_suite.md``) where that record exists.

Writes the markdown table to ``--out``, its data beside it (.json) and the figure (.png); the default run
takes about 1.5-4 minutes on a 2-core machine (most of it the 7B layer):

    python bench/kernel_efficiency.py --out bench/results/kernel_efficiency.md
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import sys
import time
from typing import Any

import jax

from jpinfer.bench import protocol
from jpinfer.bench.kernels import SHAPES, bench_chained, bench_shape
from jpinfer.bench.machine import matvec_read_bandwidth
from jpinfer.bench.results import command_line, publish
from jpinfer.native import native_available

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPARSITIES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
GPU_COMMAND = "python -m jpinfer.bench --kernels --tokens 1 4 --out bench/results/gpu_kernels.md"
GPU_JSON = ROOT / "bench" / "results" / "gpu_kernels.json"
GPU_SUITE = ROOT / "bench" / "results" / "gpu_suite.md"  # the GPU suite's record (python -m jpinfer.bench gpu)


def gpu_missing(suite: pathlib.Path = GPU_SUITE) -> str:
    """What the GPU panel and section say without the accelerator table: where the GPU's kernel figures are (the GPU
    suite's record ``suite``, when there is one), or the command that measures them."""
    if suite.exists():
        return (f"no table of this script's form is recorded; the GPU suite's kernel part has the figures measured on "
                f"a GPU (bench/results/{suite.name}); `{GPU_COMMAND}` records this one")
    return f"not measured yet; on a GPU machine run `{GPU_COMMAND}`, then this script again"
MEANING = ("efficiency = speedup over dense x (1 - s): 1.0 = the sparse op moves its bytes as fast as the dense FFN "
           "moves all of the layer's; 0.5 = each byte it reads costs it twice as long")


def gpu_series(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The efficiency curves of a recorded accelerator table (``chain_kernels``' JSON, ``tables`` of rows).

    One series per (layer shape, tokens, sparse variant), in the table's order: ``points`` are
    (sparsity, efficiency) pairs sorted by sparsity, efficiency None where that variant failed to run.
    Dense, the reference every efficiency is taken against, is not a series.
    """
    series: dict[tuple[str, int, str], list[tuple[float, float | None]]] = {}
    for table in data["tables"]:
        for row in table["rows"]:
            if row["op"] == "dense":
                continue
            point = (float(row["s"]), None if "error" in row else float(row["efficiency"]))
            series.setdefault((table["shape"], int(table["tokens"]), row["op"]), []).append(point)
    return [dict(shape=shape, tokens=tokens, variant=variant, points=sorted(points, key=lambda p: p[0]))
            for (shape, tokens, variant), points in series.items()]


def load_gpu(path: pathlib.Path) -> dict[str, Any] | None:
    """The recorded accelerator table at ``path`` with its series, or None when no GPU run was recorded there."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if "tables" not in data:
        raise ValueError(f"{path} is not an accelerator table (written by `{GPU_COMMAND}`): it has no 'tables'")
    return dict(source=_shown(path), device=data.get("device", "?"), dtype=data.get("dtype", "?"),
                layers=data.get("layers", "?"), jax=data.get("jax", "?"), series=gpu_series(data))


def cpu_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, layers a call, sparsity), in first-seen order: medians over the repeats of ``bench_shape``'s and
    ``bench_chained``'s rows, and the range of the efficiency. Each efficiency is a same-run ratio, so the median is
    taken of ratios, not of times."""
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["shape"], row["layers"], row["s"]), []).append(row)
    out = []
    for (shape, layers, s), group in groups.items():
        eff = [r["efficiency"] for r in group]
        med = lambda key: statistics.median(r[key] for r in group)
        out.append(dict(shape=shape, layers=layers, s=s, k=group[0]["k"], repeats=len(group), dense_ms=med("dense_ms"),
                        sparse_ms=med("sparse_ms"), speedup=med("speedup"), efficiency=statistics.median(eff),
                        efficiency_min=min(eff), efficiency_max=max(eff)))
    return out


def figure(cpu: list[dict[str, Any]], gpu: dict[str, Any] | None, path: pathlib.Path, cpu_title: str) -> None:
    """Two panels, efficiency against sparsity: the CPU shapes (median, bars: range over repeats) and the GPU
    variants (or a note that the GPU is not measured yet, with the command that measures it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cpu, ax_gpu) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    for shape, layers in dict.fromkeys((r["shape"], r["layers"]) for r in cpu):
        rows = [r for r in cpu if (r["shape"], r["layers"]) == (shape, layers)]
        s = [r["s"] for r in rows]
        eff = [r["efficiency"] for r in rows]
        spread = [[e - r["efficiency_min"] for e, r in zip(eff, rows)],
                  [r["efficiency_max"] - e for e, r in zip(eff, rows)]]
        ax_cpu.errorbar(s, eff, yerr=spread, marker="o", capsize=3, ls="-" if layers == 1 else "--",
                        label=f"{shape}, " + ("one layer a call" if layers == 1 else f"{layers} layers in one jit"))
    ax_cpu.set_title(cpu_title, fontsize=9)
    if gpu is None:
        ax_gpu.text(0.5, 0.5, "GPU: " + gpu_missing().replace("; ", "\n\n"),
                    ha="center", va="center", fontsize=8, transform=ax_gpu.transAxes, wrap=True)
        ax_gpu.set_title("GPU", fontsize=9)
    else:
        shapes = {sr["shape"] for sr in gpu["series"]}
        styles = {t: ls for t, ls in zip(sorted({sr["tokens"] for sr in gpu["series"]}), ["-", "--", ":", "-."] * 4)}
        colors = {}
        for sr in gpu["series"]:
            color = colors.setdefault(sr["variant"], f"C{len(colors)}")
            label = sr["variant"] + f", {sr['tokens']} token(s)" + (f", {sr['shape']}" if len(shapes) > 1 else "")
            ax_gpu.plot([p[0] for p in sr["points"]], [float("nan") if p[1] is None else p[1] for p in sr["points"]],
                        marker="o", ls=styles[sr["tokens"]], color=color, label=label)
        ax_gpu.set_title(f"GPU: {gpu['device']}, {gpu['dtype']}, {gpu['layers']} layers chained in one jit\n"
                         f"(from {gpu['source']})", fontsize=9)
        ax_gpu.legend(fontsize=7)
    ticks = sorted({r["s"] for r in cpu} | {p[0] for sr in (gpu or {}).get("series", []) for p in sr["points"]})
    for ax in (ax_cpu, ax_gpu):
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xlabel("sparsity s (fraction of FFN neurons skipped)")
        ax.set_ylabel("efficiency = speedup over dense x (1 - s)")
        ax.set_xticks(ticks)
        ax.set_xlim(ticks[0] - 0.03, ticks[-1] + 0.03)
        ax.set_ylim(0, max(1.1, ax.get_ylim()[1]))  # the dense line at 1.0 always in view
        ax.grid(alpha=0.3)
    ax_cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def gpu_markdown(gpu: dict[str, Any] | None, suite: pathlib.Path = GPU_SUITE) -> list[str]:
    """The GPU section: one line per series, efficiency per sparsity; or where the GPU's figures are
    (``gpu_missing``)."""
    if gpu is None:
        return ["## GPU", "", f"GPU: {gpu_missing(suite)}.", ""]
    sparsities = sorted({p[0] for sr in gpu["series"] for p in sr["points"]})
    lines = ["## GPU (recorded, not measured by this script)", "",
             f"From `{gpu['source']}` (its run's date and command: the .md beside it): {gpu['device']}, jax "
             f"{gpu['jax']}, {gpu['layers']} layers chained in one jit, {gpu['dtype']}, dense and every sparse variant "
             "in the same run. Its protocol differs from the CPU's (chained layers, not one; its own rounds), so "
             "compare variants within it, not with the CPU rows.", "",
             "| layer | tokens | variant | " + " | ".join(f"s={s:.2f}" for s in sparsities) + " |",
             "|---|---|---|" + "---|" * len(sparsities)]
    for sr in gpu["series"]:
        at = dict(sr["points"])
        cells = ["" if s not in at else "failed" if at[s] is None else f"{at[s]:.2f}" for s in sparsities]
        lines.append(f"| {sr['shape']} | {sr['tokens']} | {sr['variant']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the repository when inside it (recorded pages name no machine's directories)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["7b", "smollm2"])
    ap.add_argument("--sparsity", nargs="+", type=float, default=list(SPARSITIES))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every shape; the median counts")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of 3 calls per op (fastest counts)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first repeat (repeat r uses seed + r)")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="keep weights in XLA's own buffers (4 KiB pages) instead of huge pages")
    ap.add_argument("--gpu-json", type=pathlib.Path, default=GPU_JSON,
                    help="the recorded accelerator table's JSON (default: bench/results/gpu_kernels.json)")
    ap.add_argument("--out", help="markdown file; its data (.json) and the figure (.png) are written beside it")
    args = ap.parse_args()
    bad = [s for s in args.sparsity if not 0 <= s < 1]
    if bad or args.repeats < 1 or args.rounds < 1:
        raise SystemExit(f"--sparsity must lie in [0, 1) (got {bad}); --repeats and --rounds must be >= 1")

    start = time.perf_counter()
    load_before = protocol.load_average()
    gpu = load_gpu(args.gpu_json)  # a bad file fails now, not after minutes of timing
    bandwidth = matvec_read_bandwidth()
    rows, repeat_loads = [], []

    def shape(key: str):  # one repeat of a shape, lone calls then a chain (each warms its ops: protocol.fastest)
        def run(r: int) -> list[dict[str, Any]]:
            lone = bench_shape(SHAPES[key], args.sparsity, "auto", args.rounds, bandwidth, args.seed + r,
                               args.huge_pages)
            chain = bench_chained(SHAPES[key], args.sparsity, args.rounds, args.seed + r, args.huge_pages)
            return [dict(row, repeat=r) for row in lone + chain]
        return run

    def done(r: int, key: str, run: protocol.Run) -> None:
        rows.extend(run.result)
        print(f"repeat {r + 1}/{args.repeats}, {SHAPES[key].name}: efficiency (layers a call: s: efficiency) "
              + ", ".join(f"{row['layers']}: {row['s']}: {row['efficiency']:.2f}" for row in run.result)
              + f" ({run.seconds:.0f} s, load {protocol.load_average()[0]:.2f})", flush=True)

    protocol.interleaved_rounds({key: shape(key) for key in args.shapes}, args.repeats,
                                warm={key: (lambda: None) for key in args.shapes},
                                before_round=lambda r, so_far: repeat_loads.append(protocol.load_average()[0]) or True,
                                after_run=done)
    load_after = protocol.load_average()
    seconds = time.perf_counter() - start
    cpu = cpu_summary(rows)

    command = shlex.join(["python", "bench/kernel_efficiency.py", *sys.argv[1:]])
    cpu_name = f"{protocol.cpu_name()}, {os.cpu_count()} cores"
    pages = "huge pages" if args.huge_pages else "4 KiB pages"
    backend = ("the native fused kernel" if native_available()
               else "the chunked XLA loop, the native library unavailable")
    lines = [
        "# Kernel efficiency against sparsity: the sparse FFN op against the dense FFN",
        "",
        f"- {command_line(command)}",
        f"- {protocol.machine_line(protocol.machine(load_before))}",
        f"- weights in {pages}; run took {seconds:.0f} s",
        f"- load average (1 min): {load_before[0]:.2f} before (5 min: {load_before[1]:.2f}), "
        + ", ".join(f"{v:.2f}" for v in repeat_loads) + f" at the start of each repeat, {load_after[0]:.2f} after "
        f"(5 min: {load_after[1]:.2f}); the machine is shared, so only same-run ratios mean much",
        f"- {MEANING}",
        "",
        "## CPU (measured in this run, float32)",
        "",
        f"`jpinfer.bench.kernels.bench_shape` (the table of `jpinfer bench-kernels`): the decoder's dense FFN "
        f"against `sparse_ffn` (backend auto: {backend}) over random lists of (1 - s) * d_ff neurons, on "
        f"cold caches, one layer a call (`layers` 1); `bench_chained`: the same two ops over enough layers of their "
        "own weights chained in one jit to pass the caches, as a decode step runs them (`layers` > 1, times per "
        f"call of the chain). The ops alternate in {args.rounds} rounds of 3 calls, the fastest call counts. "
        f"{args.repeats} repeat(s), shapes interleaved (the order rotating), seed {args.seed} + repeat. Columns: "
        "medians over the repeats; `range` = the "
        f"lowest and highest efficiency of the repeats. Matrix-vector read bandwidth measured at the start: "
        f"{bandwidth / 1e9:.1f} GB/s.",
        "",
        "| layer | layers a call | s | K | dense ms | sparse ms | speedup | efficiency | range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cpu:
        lines.append(f"| {c['shape']} | {c['layers']} | {c['s']:.2f} | {c['k']} | {c['dense_ms']:.2f} | "
                     f"{c['sparse_ms']:.3f} | {c['speedup']:.2f} | {c['efficiency']:.2f} | "
                     f"{c['efficiency_min']:.2f}-{c['efficiency_max']:.2f} |")
    lines += ["", *gpu_markdown(gpu)]
    if args.out:
        png = pathlib.Path(args.out).with_suffix(".png")
        figure(cpu, gpu, png, f"CPU: {cpu_name}, float32\nmedian of {args.repeats} repeat(s); bars: range")
        lines += [f"![efficiency against sparsity]({png.name})", ""]
    publish("\n".join(lines).rstrip() + "\n", args.out, dict(
        command=command, jax=jax.__version__, processor=cpu_name, huge_pages=args.huge_pages, rounds=args.rounds,
        repeats=args.repeats, seed=args.seed, seconds=seconds, read_bandwidth=bandwidth,
        load=dict(before=load_before, repeats=repeat_loads, after=load_after),
        cpu=cpu, cpu_rows=rows, gpu=gpu))


if __name__ == "__main__":
    main()
