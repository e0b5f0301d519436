"""jpinfer profile: count how often each FFN neuron fires over a corpus and save the profile."""

from __future__ import annotations

import argparse

from jpinfer.commands.args import add_model_arguments, load_engine


def add_arguments(p: argparse.ArgumentParser, command: str = "profile") -> None:
    add_model_arguments(p)
    p.add_argument(
        "--corpus", default="wikitext2-valid",
        help="bundled name (wikitext2-valid, wikitext2-test, chatgpt-prompts), a local text/JSON/CSV file, "
             "or a datasets name (default wikitext2-valid)",
    )
    p.add_argument("--fields", nargs="+", default=None, help="text columns of a JSON/CSV/datasets corpus")
    p.add_argument("--n-tokens", type=int, default=131072, help="tokens to profile (default 131072)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument(
        "--sparsity", type=float, default=0.5,
        help="SwiGLU-like models (no exact zeros): target fraction of inactive neurons the thresholds are "
             "calibrated for (default 0.5)",
    )
    p.add_argument("--samples", type=int, default=0, help="also keep this many predictor training samples per layer")
    p.add_argument("--activation-sparsity", type=float, default=None,
                   help="threshold mode: also calibrate thresholds skipping this fraction of each layer's neurons")
    p.add_argument("--input-sparsity", type=float, default=None,
                   help="threshold mode: also calibrate thresholds skipping this fraction of each FFN input")
    p.add_argument("--attention-sparsity", type=float, default=None,
                   help="threshold mode: also calibrate thresholds skipping this fraction of the inputs of each "
                        "attention's q|k|v and output products (model-wide sparsity)")
    p.add_argument("--model-wide-sparsity", type=float, default=None,
                   help="threshold mode: instead of the per-kind fractions, calibrate thresholds skipping this "
                        "fraction of the bytes of every matrix read by rows (FFN and attention), spread over layers "
                        "and matrices where a held-out loss estimate says it hurts least")
    p.add_argument("--head-sparsity", type=float, default=None,
                   help="threshold mode: also calibrate a threshold skipping this fraction of the head's inputs")
    p.add_argument("--allocation", choices=("uniform", "greedy"), default="uniform",
                   help="threshold mode: the same fraction in every layer (default), or greedy: spent where a "
                        "held-out loss estimate says it hurts least")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where to write the profile (.npz)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from jpinfer.profiler import Corpus, ProfileSettings, SparsityTargets, profile

    targets = SparsityTargets(  # checked before the model loads
        activation=args.activation_sparsity, input=args.input_sparsity, attention=args.attention_sparsity,
        model_wide=args.model_wide_sparsity, head=args.head_sparsity, allocation=args.allocation)
    settings = ProfileSettings(n_tokens=args.n_tokens, window=args.window, seed=args.seed, sparsity=args.sparsity,
                               n_samples=args.samples, batch_size=args.batch_size)
    engine = load_engine(args)
    prof = profile(engine, Corpus.of(args.corpus, args.fields), settings, targets=targets, progress=args.progress)
    path = prof.save(args.out)
    sparsity = prof.sparsity()
    capacity = prof.capacity(0.99)
    print(f"profiled {prof.n_tokens} tokens of {prof.meta['corpus'].get('source', args.corpus)} "
          f"through {engine.cfg.name} ({prof.n_layers} layers x {prof.d_ff} neurons)")
    print(f"sparsity per token: mean {np.mean(sparsity):.3f} (layers {np.min(sparsity):.3f}..{np.max(sparsity):.3f}); "
          f"99th-percentile active neurons per layer: {int(np.min(capacity))}..{int(np.max(capacity))}")
    if prof.meta.get("sparsity_thresholds"):
        print(f"threshold mode: {prof.sparsity_thresholds().describe()} (jpinfer generate --mode threshold "
              f"--profile {path})")
    if prof.meta.get("samples"):
        print(f"predictor samples: {prof.meta['samples']}")
    print(f"saved {path}")
    return 0
