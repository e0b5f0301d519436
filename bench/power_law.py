"""Power law of neuron activity: how few neurons carry most activations (default model).

Profiles ``--n-tokens`` of WikiText-2 valid (random windows, seed 0) at a uniform target
sparsity, saves the profile under $JPINFER_CACHE/profiles/ (or, with ``--pack [DIR]``, reads the
profile of a pack: the default model's when no directory is given), and writes a PNG of the
cumulative activation share against the fraction of neurons (hottest first) for a few
layers, plus a markdown table (its rows also as JSON): per layer, the fraction of neurons
carrying 50/80/90% of all activations, the mean skipped fraction, and the 99th-percentile
active count.

    python bench/power_law.py --pack --out-dir bench/results
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import jpinfer  # noqa: E402
from jpinfer.bench.protocol import machine, machine_line  # noqa: E402
from jpinfer.bench.results import command_line, publish  # noqa: E402
from jpinfer.cache import cache_dir  # noqa: E402
from jpinfer.profiler import ActivationProfile, ProfileSettings, profile  # noqa: E402

SHARES = (0.5, 0.8, 0.9)


def figure(prof: ActivationProfile, layers: list[int], path: pathlib.Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
    for layer in layers:
        x, y = prof.cumulative_share(layer)
        ax.plot(np.concatenate([[0], x]), np.concatenate([[0], y]), label=f"layer {layer}")
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="all neurons equally often")
    ax.set_xlabel("fraction of FFN neurons (hottest first)")
    ax.set_ylabel("cumulative share of activations")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-tokens", type=int, default=131072)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--n-samples", type=int, default=4096, help="predictor samples per layer (0: none)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--layers", default="0,7,15,22,29")
    ap.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("bench/results"))
    ap.add_argument("--reuse", action="store_true", help="redraw from the saved profile of an earlier run")
    ap.add_argument("--pack", nargs="?", const="default", default=None,
                    help="read the profile of this pack directory (no value: the default model's pack) instead")
    args = ap.parse_args()

    saved = cache_dir("profiles") / f"smollm2-135m-wikitext2-valid-{args.n_tokens}-s{args.sparsity}.npz"
    if args.pack:
        from jpinfer.pack import pack_for

        pack = pack_for(None, None if args.pack == "default" else args.pack)
        prof, saved = pack.profile, pack.path / "profile.npz"
        settings = pack.settings
        args.sparsity, args.window, args.n_samples = settings.sparsity, settings.window, settings.n_samples
    elif args.reuse and saved.is_file():
        prof = ActivationProfile.load(saved)
    else:
        settings = ProfileSettings(n_tokens=args.n_tokens, window=args.window, sparsity=args.sparsity,
                                   n_samples=args.n_samples, batch_size=args.batch_size)
        prof = profile(jpinfer.load(), "wikitext2-valid", settings, progress=True)
        prof.save(saved)

    layers = [int(v) for v in args.layers.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / "power_law.png"
    figure(prof, layers, png, f"SmolLM2-135M-Instruct, {prof.n_tokens} tokens of WikiText-2 valid\n"
                              f"active: |silu(g)*u| over thresholds for {args.sparsity:.0%} sparsity")

    share = np.stack([prof.neurons_for_share(s) for s in SHARES], 1)
    sec = prof.meta["seconds"]
    calibration_tokens = prof.meta["calibration"].get("calibration_tokens")
    where = (f"the pack `{saved.parent.name}` (`$JPINFER_CACHE/packs/`, not in the repo; calibrated on "
             f"{pack.settings.calibration_tokens} tokens of its own windows)" if args.pack
             else f"`$JPINFER_CACHE/profiles/{saved.name}` (not in the repo)")
    lines = [
        "# Power law of FFN neuron activity (SmolLM2-135M-Instruct, float32)",
        "",
        command_line(f"python bench/power_law.py {' '.join(a for a in sys.argv[1:] if a != '--reuse')}")
        + (" (this page redrawn from its saved profile with `--reuse`)" if args.reuse else ""),
        "",
        machine_line(machine()),
        "",
        f"Profile: {prof.n_tokens} tokens ({prof.meta['corpus']['n_windows']} random windows of {args.window}, "
        f"seed 0) of WikiText-2 valid; active = |silu(g)*u| over a per-layer threshold calibrated (uniform) for "
        f"{args.sparsity:.0%} sparsity" + (f" on the first {calibration_tokens} tokens" if calibration_tokens else "")
        + f"; {args.n_samples} predictor samples per layer. Profile: {where}.",
        "",
        f"Time on a shared 2-core CPU (other jobs running): calibration {sec['calibration']:.0f} s, profiling pass "
        f"{sec['pass']:.0f} s ({prof.n_tokens / sec['pass']:.0f} tok/s). Dense-prefill comparison: profile_speed.md.",
        "",
        f"![cumulative share]({png.name})",
        "",
        "Fraction of neurons (hottest first) carrying 50/80/90% of all activations; if every neuron fired "
        "equally often these would be 0.50/0.80/0.90. `skipped` is the mean fraction of neurons inactive per "
        "token; `K99` the active count not exceeded on 99% of tokens (of 1536).",
        "",
        "| layer | 50% | 80% | 90% | skipped | K99 |",
        "|---|---|---|---|---|---|",
    ]
    k99 = prof.capacity(0.99)
    sparsity = prof.sparsity()
    for layer in range(prof.n_layers):
        a, b, c = share[layer]
        lines.append(f"| {layer} | {a:.3f} | {b:.3f} | {c:.3f} | {sparsity[layer]:.3f} | {k99[layer]} |")
    lines.append(f"| mean | {share[:, 0].mean():.3f} | {share[:, 1].mean():.3f} | {share[:, 2].mean():.3f} | "
                 f"{sparsity.mean():.3f} | {k99.mean():.0f} |")
    rows = [{"layer": layer, "share_50": float(share[layer, 0]), "share_80": float(share[layer, 1]),
             "share_90": float(share[layer, 2]), "skipped": float(sparsity[layer]), "k99": int(k99[layer])}
            for layer in range(prof.n_layers)]
    publish("\n".join(lines) + "\n", args.out_dir / "power_law.md",
            {"n_tokens": prof.n_tokens, "sparsity": args.sparsity, "rows": rows,
             "mean": {key: float(np.mean([r[key] for r in rows])) for key in ("share_50", "share_80", "share_90",
                                                                               "skipped", "k99")}})


if __name__ == "__main__":
    main()
