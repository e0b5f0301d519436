"""What the modelled-speed benches share (bench/placement_share.py, bench/modelled_speed.py): the
default model's measured activation frequencies and predictor sizes (``measured_inputs``), a measured
skew carried to other shapes (``transplant``), a ReLU model's skew (``relu_frequencies``: 80% of the
activations in 26% of the neurons, PowerInfer's OPT-30B figure, Song et al., 2023), the model sizes
and budgets the placement solver is given, one placement per run name, and the reports' header.
Nothing here runs a model on a GPU: times come from the solver's cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
from typing import Sequence

import numpy as np

from jpinfer.bench.protocol import machine, machine_line
from jpinfer.bench.results import command_line
from jpinfer.config import ModelConfig
from jpinfer.models.loading import load_model
from jpinfer.models.params import nbytes
from jpinfer.profiler import ActivationProfile
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
from jpinfer.solver.shapes import RUNS

GiB = 2**30
CONTEXT = 2048
# PowerInfer (Song et al., 2023): 80% of OPT-30B's activations come from the hottest 26% of its neurons.
RELU_HOT, RELU_SHARE = 0.26, 0.80
RELU_MEAN_ACTIVE = 0.1  # an assumption: the paper's skew figure fixes the shape of the curve, not its mean


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
    model = load_model(None)
    cfg, weight_bytes = model.cfg, nbytes(model.weights)
    pack_predictors = None
    if profile_path:
        prof = ActivationProfile.load(profile_path, model)
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
    ``jpinfer.modes.placement.choose_placement`` does."""
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
    """One placement per run name of ``jpinfer.solver.shapes.RUNS`` (mass, latency, greedy, layers)."""
    out = {}
    for run in runs:
        method, objective = RUNS[run]
        out[run] = solve_placement(frequency, sizes, hardware, method=method, objective=objective,
                                   dense_policy="strict", time_limit=time_limit)
    return out


def header_lines(title: str, argv: Sequence[str], script: str, presets: Sequence[str]) -> list[str]:
    """Title, command, the machine line, and what the modelled times rest on (the presets' numbers)."""
    def describe(name: str) -> str:
        p = preset(name)
        return (f"{name} {p.accel_bandwidth / 1e9:.0f} GB/s, host {p.cpu_bandwidth / 1e9:.1f} GB/s, link "
                f"{p.link_bandwidth / 1e9:.2f} GB/s, sync {p.sync_cost * 1e6:.0f} us")

    return [
        f"# {title}",
        "",
        f"- {command_line(f'python bench/{script} {shlex.join(argv)}')}",
        f"- {machine_line(machine())}",
        "- solver: cvxpy + HiGHS",
        "- times are MODELLED by the solver's cost model (src/jpinfer/solver/latency.py) from datasheet presets "
        "(src/jpinfer/solver/hardware.py): batch 1, memory-bound, no kernel launch costs; nothing here ran on a GPU",
        "- presets: " + "; ".join(describe(name) for name in presets),
    ]
