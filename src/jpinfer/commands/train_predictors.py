"""jpinfer train-predictors: train every layer's activation predictor and save them."""

from __future__ import annotations

import argparse

from jpinfer.commands.args import add_model_arguments, load_engine


def add_arguments(p: argparse.ArgumentParser, command: str = "train-predictors") -> None:
    add_model_arguments(p)
    p.add_argument("--profile", default=None,
                   help="a profile saved with predictor samples (jpinfer profile --samples N); "
                        "default: profile the model now (WikiText-2 valid, 50%% sparsity)")
    p.add_argument("--samples", type=int, default=65536,
                   help="predictor samples per layer when profiling now (default 65536)")
    p.add_argument("--recall", type=float, default=0.99,
                   help="held-out recall each layer's cut-off is chosen for (default 0.99)")
    p.add_argument("--budget", type=float, default=0.10,
                   help="total predictor parameters as a fraction of the model's (default 0.10)")
    p.add_argument("--rank", type=int, default=None, help="one width for every layer (default: adaptive per layer)")
    p.add_argument("--epochs", type=int, default=8, help="most training epochs per layer (default 8)")
    p.add_argument("--out", default=None, help="directory to write (default: under $JPINFER_CACHE/predictors)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from jpinfer.cache import cache_dir
    from jpinfer.predictor import TrainConfig, profile_fingerprint, train_predictors
    from jpinfer.predictor.fit import model_params
    from jpinfer.profiler import ActivationProfile, ProfileSettings, profile

    config = TrainConfig(recall=args.recall, max_epochs=args.epochs)
    engine = load_engine(args)
    if args.profile is not None:
        prof = ActivationProfile.load(args.profile, engine)
    else:
        prof = profile(engine, settings=ProfileSettings(n_samples=args.samples), progress=args.progress)
    predictors = train_predictors(engine, prof, ranks=args.rank, budget=args.budget, config=config,
                                          progress=args.progress)
    out = args.out or cache_dir("predictors") / (f"{predictors.meta['model_fingerprint'][:16]}-"
                                                 f"{profile_fingerprint(prof)[:16]}")
    path = predictors.save(out)
    scores = predictors.meta["held_out_scores"]
    predicted = np.array([s["predicted"] for s in scores])
    print(f"trained {len(predictors.layers)} predictors for {engine.cfg.name} in {predictors.meta['seconds']:.0f} s: "
          f"{predictors.n_params:,} parameters ({predictors.n_params / model_params(engine):.1%} of the model)")
    print(f"widths {min(predictors.ranks)}..{max(predictors.ranks)}; at held-out recall {config.recall} "
          f"a layer computes {predicted.mean():.1%} of its neurons on average "
          f"(layers {predicted.min():.1%}..{predicted.max():.1%}), "
          f"{np.mean([s['active'] for s in scores]):.1%} are truly active")
    print(f"saved {path}")
    return 0
