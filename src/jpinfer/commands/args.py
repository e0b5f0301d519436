"""Command-line arguments shared by several subcommands (``jpinfer.commands`` and the bench's), so that each
option is spelled, checked and explained once."""

from __future__ import annotations

import argparse
from typing import Any

from jpinfer.config import WEIGHT_FORMATS
from jpinfer.modes.catalog import MODE_NAMES, get_mode

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def add_model_arguments(p: argparse.ArgumentParser, weights: bool = True) -> None:
    """--model, --dtype and (with ``weights``) --weights, for every command that loads a model."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype", default="float32", choices=DTYPE_CHOICES,
        help="weight dtype (default float32; on the CPU bfloat16 decodes 5-8x slower, see README)",
    )
    if weights:
        p.add_argument(
            "--weights", default="float", choices=WEIGHT_FORMATS,
            help="float (default: every tensor in --dtype), int8 (W8A8, quantized at load) or int4 (W4A8 in 4-bit "
                 "blocks of 32: a GGUF's own Q4_0/Q4_1, else quantized at load; the sparse layouts hold int8 copies "
                 "of the matrices they read by input rows or neuron columns); every mode runs each",
        )


def capacity_value(text: str) -> str | float | int:
    """--capacity: 'predicted', a quantile of the profile's active counts (has a '.') or one K for every layer."""
    if text == "predicted":
        return text
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'predicted', a quantile like 0.99 or an integer K, got {text!r}") from None


def add_mode_arguments(p: argparse.ArgumentParser, modes: bool = False) -> None:
    """The engine mode (``--mode``, or ``--modes`` for a bench) and what the sparse modes read."""
    choices = MODE_NAMES
    if modes:
        p.add_argument("--modes", nargs="+", choices=choices, default=None,
                       help="engine modes to compare, dense first (default: all of them when a pack is at hand: the "
                            "default model's, or --pack; dense alone otherwise)")
    else:
        p.add_argument("--mode", choices=choices, default="dense",
                       help="dense (default); sparse: predicted neurons only; hybrid: hot neurons on the accelerator; "
                            "threshold: training-free, small activations and inputs skipped (thresholds from "
                            "--profile)")
    p.add_argument("--pack", default=None,
                   help="pack directory (jpinfer prepare): the profile, predictors, placement and thresholds the mode "
                        "needs, where not given (default model: its pack in the cache, built on first use)")
    p.add_argument("--predictors", default=None, help="predictor directory (jpinfer train-predictors) for sparse modes")
    p.add_argument("--profile", default=None,
                   help="profile file (jpinfer profile) for capacities, placement and the threshold mode's thresholds")
    p.add_argument("--capacity", type=capacity_value, default="predicted",
                   help="most neurons per token and layer: 'predicted' (default: what the predictors pick on held-out "
                        "samples, 0.99 quantile), a quantile of the profile's active counts like 0.99, or K")
    p.add_argument("--thresholds", action="store_true",
                   help="hybrid: choose neurons by the profile's threshold-mode thresholds instead of predictors")
    p.add_argument("--gpu-budget", default=None,
                   help="hybrid: accelerator memory for the model, e.g. 6GB, 512MiB, or a fraction like 0.4")


def prepare_devices(modes: list[str]) -> None:
    """Without a GPU, two CPU devices play accelerator and host in the hybrid mode: JAX must be told
    before it starts its backends, so commands call this before anything touches a device."""
    if any(get_mode(mode).two_devices for mode in modes):
        import jax

        jax.config.update("jax_num_cpu_devices", 2)


def load_engine(args: argparse.Namespace, *, with_mode: bool = False) -> Any:
    """The ``jpinfer.Engine`` that ``add_model_arguments``' options name (with ``with_mode``, in the mode
    ``add_mode_arguments``' options name, the devices prepared for it): every command loads its model here."""
    from jpinfer.api import load

    if not with_mode:
        return load(args.model, dtype=args.dtype, weights=args.weights)
    prepare_devices([args.mode])
    return load(args.model, dtype=args.dtype, weights=args.weights, mode=args.mode, **mode_options(args))


def mode_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``jpinfer.load`` from ``add_mode_arguments``' options (without the mode)."""
    return dict(pack=args.pack, predictors=args.predictors, profile=args.profile, capacity=args.capacity,
                gpu_budget=args.gpu_budget, thresholds="profile" if args.thresholds else None)
