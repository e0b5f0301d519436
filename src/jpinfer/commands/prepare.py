"""jpinfer prepare: profile, thresholds, predictors and placement of a model, written as one pack."""

from __future__ import annotations

import argparse

from jpinfer.commands.args import add_model_arguments, load_engine
from jpinfer.pack.settings import AUTO, AUTO_TARGET, HEAD_AUTO_TARGET, OBJECTIVES, PackSettings

DEFAULTS = PackSettings()


def target(text: str) -> float | str | None:
    """A per-kind target on the command line: a fraction, "off" (None: the kind reads its matrices whole) or
    "auto" (the weights format decides: ``PackSettings``)."""
    word = text.strip().lower()
    return None if word == "off" else AUTO if word == AUTO else float(text)


def add_arguments(p: argparse.ArgumentParser, command: str = "prepare") -> None:
    add_model_arguments(p)
    p.add_argument("--out", default=None,
                   help="pack directory (default: $JPINFER_CACHE/packs/MODEL-WEIGHTS-FINGERPRINT, where jpinfer load "
                        "and bench look for the default model's pack of each weights format); an int8 or int4 model "
                        "is profiled, calibrated and given predictors and a placement as quantized")
    text = p.add_argument_group("text")
    text.add_argument("--corpus", default=DEFAULTS.corpus,
                      help="bundled name (wikitext2-valid, wikitext2-test, chatgpt-prompts), a local text/JSON/CSV "
                           f"file, or a datasets name (default {DEFAULTS.corpus})")
    text.add_argument("--fields", nargs="+", default=[], help="text columns of a JSON/CSV/datasets corpus")
    text.add_argument("--n-tokens", type=int, default=DEFAULTS.n_tokens,
                      help=f"tokens to profile ({DEFAULTS.n_tokens})")
    text.add_argument("--calibration-tokens", type=int, default=DEFAULTS.calibration_tokens,
                      help=f"tokens the thresholds are calibrated on ({DEFAULTS.calibration_tokens})")
    text.add_argument("--samples", type=int, default=DEFAULTS.n_samples,
                      help=f"predictor samples per layer ({DEFAULTS.n_samples})")
    text.add_argument("--window", type=int, default=DEFAULTS.window)
    text.add_argument("--seed", type=int, default=DEFAULTS.seed)
    sparsity = p.add_argument_group("sparsity")
    sparsity.add_argument("--sparsity", type=float, default=DEFAULTS.sparsity,
                          help="SwiGLU-like models: fraction of inactive neurons per layer the activity thresholds are "
                               f"calibrated for (default {DEFAULTS.sparsity}); also the threshold mode's activation "
                               "sparsity unless --threshold-sparsity is given")
    sparsity.add_argument("--threshold-sparsity", type=float, default=None,
                          help="threshold mode: fraction of neurons skipped (default: --sparsity)")
    auto = f"default auto: {AUTO_TARGET} with float or int8 weights, off with int4"
    sparsity.add_argument("--input-sparsity", type=target, default=DEFAULTS.input_sparsity,
                          help=f"threshold mode: fraction of FFN input dimensions skipped, or off ({auto})")
    sparsity.add_argument("--attention-sparsity", type=target, default=DEFAULTS.attention_sparsity,
                          help="threshold mode: fraction of the inputs of the attention's q|k|v and output products "
                               f"skipped, or off ({auto})")
    sparsity.add_argument("--model-wide-sparsity", type=float, default=None,
                          help="threshold mode: fraction of the bytes of every matrix read by rows skipped (FFN and "
                               "attention), spread over layers and matrices by a held-out loss estimate; instead of "
                               "the per-kind fractions")
    sparsity.add_argument("--head-sparsity", type=target, default=DEFAULTS.head_sparsity,
                          help="threshold mode: fraction of the head's inputs skipped, or off (default auto: "
                               f"{HEAD_AUTO_TARGET} with float weights, off with int8 and int4)")
    sparsity.add_argument("--allocation", choices=("uniform", "greedy"), default=DEFAULTS.allocation,
                          help="threshold mode: the same fraction in every layer, or greedy (held-out loss estimate)")
    predictors = p.add_argument_group("predictors")
    predictors.add_argument("--rank", type=int, default=None, help="one width for every layer (default: adaptive)")
    predictors.add_argument("--predictor-budget", type=float, default=DEFAULTS.predictor_budget,
                            help="predictor parameters as a fraction of the model's (adaptive widths)")
    predictors.add_argument("--search-samples", type=int, default=DEFAULTS.search_samples,
                            help=f"samples of the proxy trainings that compare widths ({DEFAULTS.search_samples})")
    predictors.add_argument("--search-epochs", type=int, default=DEFAULTS.search_epochs,
                            help=f"epochs of each proxy training ({DEFAULTS.search_epochs})")
    predictors.add_argument("--recall", type=float, default=DEFAULTS.recall,
                            help=f"held-out recall of each layer's cut-off ({DEFAULTS.recall})")
    predictors.add_argument("--strong-recall", type=float, default=DEFAULTS.strong_recall,
                            help=f"held-out recall of the largest activations ({DEFAULTS.strong_recall})")
    predictors.add_argument("--epochs", type=int, default=DEFAULTS.max_epochs, help="most epochs per layer")
    placement = p.add_argument_group("placement")
    placement.add_argument("--gpu-budget", default=DEFAULTS.gpu_budget,
                           help="accelerator memory for the model: 6GB, 512MiB, bytes, or a fraction of the weights "
                                f"(default {DEFAULTS.gpu_budget})")
    placement.add_argument("--hardware", default=DEFAULTS.hardware,
                           help="a preset (rtx4090, rtx2080ti, a100-80gb, h200) or 'measure' (this machine)")
    placement.add_argument("--objective", choices=OBJECTIVES, default=DEFAULTS.objective,
                           help="mass: most activations on the accelerator (PowerInfer's); "
                                "latency: least modelled time")
    placement.add_argument("--context", type=int, default=DEFAULTS.context, help="KV cache tokens on the accelerator")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from jpinfer.modes import MODE_NAMES, REFERENCE_MODE
    from jpinfer.pack import prepare

    settings = PackSettings(  # checked before the model loads
        corpus=args.corpus, fields=tuple(args.fields), window=args.window, seed=args.seed,
        calibration_tokens=args.calibration_tokens, n_tokens=args.n_tokens, n_samples=args.samples,
        sparsity=args.sparsity, threshold_sparsity=args.threshold_sparsity, input_sparsity=args.input_sparsity,
        attention_sparsity=args.attention_sparsity, model_wide_sparsity=args.model_wide_sparsity,
        head_sparsity=args.head_sparsity,
        allocation=args.allocation, ranks=args.rank, search_samples=args.search_samples,
        search_epochs=args.search_epochs, predictor_budget=args.predictor_budget, recall=args.recall,
        strong_recall=args.strong_recall, max_epochs=args.epochs, gpu_budget=args.gpu_budget,
        hardware=args.hardware, objective=args.objective, context=args.context,
    )
    model = load_engine(args).model  # int8: SmoothQuant's migration first
    pack = prepare(model, args.out, settings, progress=args.progress)
    placement, scores = pack.placement, pack.predictors.meta["held_out_scores"]
    computed = sum(s["predicted"] for s in scores) / len(scores)
    print(f"pack of {model.cfg.name}: {pack.path}")
    print(f"stages run: {', '.join(pack.ran) or 'none (all reused)'}")
    print(f"predictors: {pack.predictors.n_params:,} parameters, a token computes {computed:.1%} of each layer's "
          f"neurons on held-out samples (recall {pack.settings.recall})")
    print(f"threshold mode: {pack.thresholds.describe()}")
    print(f"placement: {sum(a.size for a in placement.accel_ids):,} of {model.cfg.n_layers * model.cfg.d_ff:,} neurons "
          f"on the accelerator, {placement.accel_share:.1%} of the activations, "
          f"{placement.memory_used / 2**20:.0f} MiB of {placement.budget_bytes / 2**20:.0f} MiB")
    modes = "|".join(m for m in MODE_NAMES if m != REFERENCE_MODE)
    weights = "" if args.weights == "float" else f" --weights {args.weights}"
    print(f"use it: jpinfer generate PROMPT --mode {modes}{weights} --pack {pack.path}")
    return 0
