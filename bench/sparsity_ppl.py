"""Oracle-sparse perplexity on WikiText-2 test against FFN sparsity (default model).

Protocol: the first ``--test-windows`` windows of ``--window`` tokens of the raw WikiText-2
test file (tokenised as one text, no BOS); thresholds calibrated on the first
``--calib-windows`` windows of WikiText-2 valid; the greedy allocation's sensitivity is
measured on the last ``--heldout-windows`` windows of valid (disjoint from calibration).
Neurons whose score is at most the layer threshold are zeroed (dense compute otherwise).

    python bench/sparsity_ppl.py --out bench/results/sparsity_ppl.md
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

import jpinfer
from jpinfer.bench.accuracy import wikitext_windows
from jpinfer.bench.protocol import TEST_WINDOWS, load_average, machine, machine_line
from jpinfer.bench.results import command_line, publish
from jpinfer.cache import cache_dir
from jpinfer.ffn import perplexity
from jpinfer.profiler import ScoreHistogram, Sensitivity, greedy, score_histogram, sensitivity, token_windows, uniform

SPARSITIES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
CHECK_WINDOWS = 64  # CHECK was measured on the first 64 windows of 512 tokens; it applies to that run only
CHECK = {  # the same protocol measured earlier by an independent script, before the profiler existed
    ("dense", 0.0): 26.15, ("uniform", 0.3): 26.26, ("uniform", 0.5): 26.75, ("uniform", 0.6): 27.66,
    ("uniform", 0.7): 29.84, ("uniform", 0.8): 35.9, ("uniform", 0.9): 77.8, ("cats", 0.5): 33.0,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--test-windows", type=int, default=TEST_WINDOWS)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="markdown file for the table")
    args = ap.parse_args()

    t_start, load_before = time.perf_counter(), load_average()
    engine = jpinfer.load()
    w = args.window
    test = wikitext_windows(engine.tokenizer, args.test_windows, w)
    valid = token_windows("wikitext2-valid", engine.tokenizer, window=w).tokens
    calib, heldout = valid[: args.calib_windows], valid[-args.heldout_windows :]
    if args.calib_windows + args.heldout_windows > len(valid):
        sys.exit("calibration and held-out windows overlap: ask for fewer")

    key = f"{w}-{args.test_windows}-{args.calib_windows}-{args.heldout_windows}"
    store = cache_dir("bench") / f"sparsity_ppl-{key}"
    store.mkdir(parents=True, exist_ok=True)
    hist, hist_gate = histograms(engine, calib, store, args.batch_size)
    rows_path = store / "rows.json"
    rows: list[dict] = json.loads(rows_path.read_text()) if rows_path.is_file() else []  # resume after a crash

    check = independent_check(args)

    def measure(method: str, s: float, cal=None) -> None:
        if any(r["method"] == method and r["sparsity"] == s for r in rows):
            return
        t = time.perf_counter()
        ppl = perplexity(engine, test, cal, batch_size=args.batch_size, progress=True)
        row = {"method": method, "sparsity": s, "ppl": ppl, "seconds": time.perf_counter() - t,
               "layer_sparsity": None if cal is None else [round(float(v), 4) for v in cal.layer_sparsity],
               "check": check.get((method, s))}
        rows.append(row)
        rows_path.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), flush=True)

    measure("dense", 0.0)
    measure("cats", 0.5, uniform(hist_gate, 0.5))
    for s in SPARSITIES[1:]:
        measure("uniform", s, uniform(hist, s))
    measure("uniform+greedy", 0.0, uniform(hist, 0.0))  # s = 0: both allocations are threshold 0
    sens, sens_s = held_out_sensitivity(engine, heldout, hist, store)
    for s in SPARSITIES[1:]:
        measure("greedy", s, greedy(hist, sens, s))

    if args.out:
        write_markdown(args, rows, check, sens, sens_s, time.perf_counter() - t_start, load_before)


def histograms(engine, calib, store: pathlib.Path, batch_size: int) -> tuple[ScoreHistogram, ScoreHistogram]:
    """Score histograms by |silu(g)*u| and by |silu(g)|, kept in ``store`` so that a rerun only measures."""
    path = store / "histograms.npz"
    if path.is_file():
        f = np.load(path)
        n = int(f["n_tokens"])
        return ScoreHistogram(f["product"], "product", n), ScoreHistogram(f["gate"], "gate", n)
    hist = score_histogram(engine, calib, batch_size=batch_size, progress=True)
    hist_gate = score_histogram(engine, calib, score="gate", batch_size=batch_size, progress=True)
    np.savez(path, product=hist.counts, gate=hist_gate.counts, n_tokens=hist.n_tokens)
    return hist, hist_gate


def held_out_sensitivity(engine, heldout, hist, store: pathlib.Path) -> tuple[Sensitivity, float]:
    """The greedy allocation's sensitivity and the seconds it took, kept in ``store``."""
    path = store / "sensitivity.npz"
    if path.is_file():
        f = np.load(path)
        return Sensitivity(f["levels"], f["cost"], int(f["n_tokens"]), f["first_order"]), float(f["seconds"])
    t = time.perf_counter()
    sens = sensitivity(engine, heldout, hist, progress=True)
    seconds = time.perf_counter() - t
    np.savez(path, levels=sens.levels, cost=sens.cost, n_tokens=sens.n_tokens, first_order=sens.first_order,
             seconds=seconds)
    return sens, seconds


def independent_check(args) -> dict:
    """CHECK where this run scores the windows it was measured on, else nothing to compare with."""
    return CHECK if (args.test_windows, args.window) == (CHECK_WINDOWS, 512) else {}


def write_markdown(args, rows, check: dict, sens, sens_s, total_s, load_before) -> None:
    by = {(r["method"], r["sparsity"]): r for r in rows}
    cmd = "python bench/sparsity_ppl.py " + " ".join(sys.argv[1:])
    lines = [
        "# Oracle-sparse perplexity vs FFN sparsity (SmolLM2-135M-Instruct, default model, float32)",
        "",
        command_line(cmd),
        "",
        machine_line(machine(load_before)),
        "",
        f"WikiText-2 test, first {args.test_windows} windows of {args.window} tokens (raw file text tokenised as one "
        f"document, no BOS, {args.window - 1} predictions per window). Thresholds on |silu(g)*u| calibrated on the "
        f"first {args.calib_windows} windows of WikiText-2 valid; the greedy allocation's Fisher sensitivity "
        f"measured on the last {args.heldout_windows} windows of valid ({sens.n_tokens} tokens, {sens_s:.0f} s). "
        "Sparsity = fraction of FFN neurons zeroed per token on the calibration data (mean over layers).",
        "",
        *(["| s | uniform | greedy | check (uniform, earlier measurement) |", "|---|---|---|---|"] if check else
          ["| s | uniform | greedy |", "|---|---|---|"]),
    ]
    for s in SPARSITIES:
        if s == 0:
            u = g = by[("uniform+greedy", 0.0)]["ppl"]
        else:
            u, g = by[("uniform", s)]["ppl"], by[("greedy", s)]["ppl"]
        earlier = check.get(("dense", 0.0) if s == 0 else ("uniform", s), "-")
        lines.append(f"| {s:.1f} | {u:.2f} | {g:.2f} |" + (f" {earlier} |" if check else ""))
    dense_check, cats_check = ((f" (check {check[('dense', 0.0)]})", f" (check {check[('cats', 0.5)]})") if check
                               else ("", ""))
    lines += [
        "",
        f"Dense: {by[('dense', 0.0)]['ppl']:.2f}{dense_check}. CATS (|silu(g)| alone) at 50%: "
        f"{by[('cats', 0.5)]['ppl']:.2f}{cats_check}.",
        "",
        "Greedy per-layer sparsity (layer 0 first):",
        "",
    ]
    for s in SPARSITIES[1:]:
        lines.append(f"- s={s}: " + " ".join(f"{v:.2f}" for v in by[("greedy", s)]["layer_sparsity"]))
    lines += ["", f"Total wall time {total_s / 60:.0f} min.", ""]
    publish("\n".join(lines), args.out, rows)


if __name__ == "__main__":
    main()
