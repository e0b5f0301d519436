"""Thresholds of the training-free threshold mode: activation and input sparsity per layer.

``calibrate_sparsity(model, windows, activation=s_a, input=s_i, attention=s_q)`` returns
``SparsityThresholds``: per layer a threshold on |a_i| (activation sparsity: the down projection skips
the neurons at or under it), one on |x_j| (input sparsity: gate and up skip the FFN input dimensions at
or under it) and, model-wide (TEAL's form, Liu et al. 2024), one on the attention's q|k|v input ("qkv")
and one on its output product's input ("o"), each calibrated for a target fraction skipped on
calibration windows; and one threshold on the head's input (``head``: the final hidden states, one head for
the whole model, so always the target's quantile). Allocation:

- ``uniform``: every layer skips the target fraction (its quantile, from one histogram pass);
- ``greedy`` (``greedy_thresholds``): layers skip different fractions averaging the target, spent where a Fisher
  estimate of the loss increase on *held-out* windows is least (``calibration.greedy``), per kind;
- ``model_wide_greedy``: one target for the fraction of all the layers' weight bytes skipped, spread over every
  (layer, kind) pair by the same estimates per byte skipped (``model_wide_thresholds``, with
  ``calibration.greedy_levels``: TEAL's greedy over layers and matrices, Liu et al. 2024, with Fisher estimates in
  place of its measured errors), or over kinds by measured loss curves (``kind_curves_thresholds``).

Both greedy forms end with a measured choice (``measured_choice``): the candidates' held-out losses
(``calibration.held_out_loss``, the threshold mode's skipping as a zeroing forward) decide, uniform among them, so
a greedy allocation is never worse than uniform on its held-out windows. Why: the Fisher estimates are second
order and taken one (layer, kind) at a time; they cannot see a loss that goes *down* (20% input sparsity on the
default model's attention lowered its perplexity), and on that model the Fisher model-wide allocation lost to
uniform at equal bytes (``bench/results/model_wide.md``).

They travel with the profile (``ActivationProfile.with_sparsity_thresholds``, stored in its
metadata, so its whole-file digest covers them) and feed ``jpinfer.load(mode="threshold")``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jpinfer.activations import SMOOTH_KINDS
from jpinfer.config import ModelConfig
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.profiler import calibration, passes

METHODS: tuple[str, ...] = ("uniform", "greedy")
FFN_KINDS: tuple[str, ...] = ("activation", "input")
ATTENTION_KINDS: tuple[str, ...] = ("qkv", "o")  # the inputs of the attention's two products
KINDS: tuple[str, ...] = FFN_KINDS + ATTENTION_KINDS  # per layer
HEAD = calibration.HEAD  # one threshold, on the head's input
MODEL_WIDE = "model-wide"  # the target key of ``model_wide_thresholds``


@dataclasses.dataclass(frozen=True)
class SparsityThresholds:
    """Per-layer thresholds (float32 (n_layers,)) of the threshold mode; None for a kind that is off.

    ``activation``: on |a_i| (neurons); ``input``: on |x_j| (FFN input dimensions); ``qkv`` and ``o``: on
    the inputs of the attention's q|k|v and output products; ``head``: one float32 threshold on the head's
    input (the final hidden states); an entry is skipped when its magnitude is at most the threshold.
    ``layer_sparsity`` holds, per kind, the fraction each layer skips on the calibration windows (the head's:
    one entry); ``target`` the asked mean fraction.
    """

    activation: np.ndarray | None
    input: np.ndarray | None
    target: dict[str, float]
    layer_sparsity: dict[str, np.ndarray]
    method: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    qkv: np.ndarray | None = None
    o: np.ndarray | None = None
    head: float | None = None

    def __post_init__(self) -> None:
        given = [getattr(self, kind) for kind in KINDS if getattr(self, kind) is not None]
        if not given and self.head is None:
            raise ValueError(f"threshold sparsity needs thresholds of at least one kind ({', '.join(KINDS)}, {HEAD})")
        if len({len(v) for v in given}) > 1:
            raise ValueError("every kind's thresholds must have one entry per layer")
        for kind in KINDS:
            values = getattr(self, kind)
            if values is not None and (not np.all(np.isfinite(values)) or np.any(np.asarray(values) < 0)):
                raise ValueError(f"{kind} thresholds must be finite and >= 0")
        if self.head is not None and not (np.isfinite(self.head) and self.head >= 0):
            raise ValueError(f"the head's threshold must be finite and >= 0, got {self.head!r}")

    @property
    def n_layers(self) -> int | None:
        """Layers the per-layer thresholds are for (None: the head's threshold only)."""
        return next((len(getattr(self, kind)) for kind in KINDS if getattr(self, kind) is not None), None)

    def fits(self, n_layers: int) -> bool:
        """Whether these thresholds serve a model of ``n_layers`` layers (the head's alone serve any)."""
        return self.n_layers in (None, n_layers)

    def describe(self) -> str:
        """e.g. 'activation 50% + input 30% + qkv 30% + o 30% + head 10% (uniform)', 'model-wide 40% over
        activation, input, qkv, o (greedy)'."""
        kinds = [kind for kind in (*KINDS, HEAD) if getattr(self, kind) is not None]
        if MODEL_WIDE in self.target:
            head = f" + {HEAD} {self.target[HEAD]:.0%}" if HEAD in self.target else ""
            return (f"{MODEL_WIDE} {self.target[MODEL_WIDE]:.0%} over {', '.join(k for k in kinds if k != HEAD)}"
                    f"{head} ({self.method})")
        parts = [f"{kind} {self.target[kind]:.0%}" if kind in self.target else kind for kind in kinds]
        return f"{' + '.join(parts)} ({self.method})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; float32 thresholds survive the round trip exactly (a double holds every float32)."""
        as_list = lambda v: None if v is None else [float(t) for t in np.asarray(v, np.float32)]
        return {kind: as_list(getattr(self, kind)) for kind in KINDS} | {
            HEAD: None if self.head is None else float(np.float32(self.head)),
            "target": dict(self.target), "layer_sparsity": {k: as_list(v) for k, v in self.layer_sparsity.items()},
            "method": self.method, "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparsityThresholds":
        """``to_dict``'s record (one written before the attention kinds or the head's existed has none of them)."""
        as_array = lambda v: None if v is None else np.asarray(v, np.float32)
        return cls(as_array(data["activation"]), as_array(data["input"]), dict(data["target"]),
                   {k: as_array(v) for k, v in data["layer_sparsity"].items()}, data["method"], data.get("meta", {}),
                   as_array(data.get("qkv")), as_array(data.get("o")), data.get(HEAD))


def _check_target(kind: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{kind} sparsity is the fraction skipped: give 0 <= s < 1 (or None: off), got {value!r}")
    return float(value)


def check_targets(activation: float | None, input: float | None, method: str, ffn_kind: str | None = None, *,
                  attention: float | None = None, head: float | None = None) -> dict[str, float | None]:
    """The targets per kind, checked (callers check before a model loads or a pass runs; with the
    model's ``ffn_kind`` also that an activation target suits it). ``attention`` is the fraction of the
    inputs of both attention products ("qkv" and "o") skipped, ``head`` of the head's inputs."""
    attention = _check_target("attention", attention)
    targets = {"activation": _check_target("activation", activation), "input": _check_target("input", input),
               "qkv": attention, "o": attention, HEAD: _check_target(HEAD, head)}
    if all(v is None for v in targets.values()):
        raise ValueError("give activation=, input=, attention= and/or head= (fractions to skip)")
    if method not in METHODS:
        raise ValueError(f"unknown allocation method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "greedy" and all(targets[kind] is None for kind in KINDS):
        raise ValueError("greedy allocation spreads per-layer kinds over layers: give activation=, input= and/or "
                         "attention= with it (the head's one threshold has nothing to allocate)")
    if ffn_kind not in (None, *SMOOTH_KINDS) and targets["activation"]:
        raise ValueError(f"{ffn_kind} neurons are exactly zero when inactive: give activation=0.0 "
                         "(threshold 0 skips exactly those), not a fraction to calibrate")
    return targets


def from_histograms(
    hists: dict[str, calibration.ScoreHistogram],
    targets: dict[str, float | None],
    method: str,
    sensitivities: dict[str, calibration.Sensitivity] | None = None,
) -> SparsityThresholds:
    """Thresholds for ``targets`` (per kind, None: off) from the kinds' histograms (``histograms``:
    "activation" of |a| by score "product", "input", "qkv" and "o" of their products' |x|, "head" of the head's);
    ``greedy`` reads each per-layer kind's ``sensitivities`` (``calibration.sensitivity`` on held-out windows)."""
    thresholds, fractions = dict.fromkeys(KINDS), {}
    for kind, target in targets.items():
        if target is None or kind == HEAD:
            continue
        if method == "uniform":
            cal = calibration.uniform(hists[kind], target)
        else:
            cal = calibration.greedy(hists[kind], sensitivities[kind], target)
        thresholds[kind], fractions[kind] = cal.thresholds, cal.layer_sparsity
    head, head_fraction = _head_part(hists, targets.get(HEAD))
    return SparsityThresholds(thresholds["activation"], thresholds["input"],
                              {k: v for k, v in targets.items() if v is not None}, fractions | head_fraction,
                              method, {"calibration_tokens": hists["input"].n_tokens}, thresholds["qkv"],
                              thresholds["o"], head)


def _head_part(hists: dict[str, calibration.ScoreHistogram], target: float | None
               ) -> tuple[float | None, dict[str, np.ndarray]]:
    """(the head's threshold for ``target``: its quantile, one head, nothing to allocate; ``layer_sparsity``'s
    entry for it, the fraction skipped on the calibration windows); (None, {}) for no target."""
    if target is None:
        return None, {}
    if HEAD not in hists:
        raise ValueError("head sparsity needs the head's input histogram: take the histograms again (histograms())")
    cal = calibration.uniform(hists[HEAD], target)
    return float(cal.thresholds[0]), {HEAD: cal.layer_sparsity}


def with_head(thresholds: SparsityThresholds, hists: dict[str, calibration.ScoreHistogram], target: float | None
              ) -> SparsityThresholds:
    """``thresholds`` with the head skipping the fraction ``target`` of its inputs (None: as they are)."""
    if target is None:
        return thresholds
    head, head_fraction = _head_part(hists, target)
    return dataclasses.replace(thresholds, head=head, target=thresholds.target | {HEAD: target},
                               layer_sparsity=thresholds.layer_sparsity | head_fraction)


def matrix_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Per kind, the weights of the matrix a layer reads by the rows that kind skips (the same in every layer)."""
    return {"activation": cfg.d_model * cfg.d_ff, "input": (2 if cfg.has_gate else 1) * cfg.d_ff * cfg.d_model,
            "qkv": (cfg.q_dim + 2 * cfg.kv_dim) * cfg.d_model, "o": cfg.d_model * cfg.q_dim}


def model_wide_kinds(ffn_kind: str) -> tuple[str, ...]:
    """The kinds a model-wide target spreads over: all, but activation sparsity only where neurons have no exact
    zeros (ReLU kinds skip exactly those at threshold 0, not a fraction to trade)."""
    return KINDS if ffn_kind in SMOOTH_KINDS else FFN_KINDS[1:] + ATTENTION_KINDS


def model_wide_thresholds(
    hists: dict[str, calibration.ScoreHistogram],
    sensitivities: dict[str, calibration.Sensitivity],
    cfg: ModelConfig,
    target: float,
    kinds: tuple[str, ...] | None = None,
) -> SparsityThresholds:
    """Thresholds skipping the fraction ``target`` of the bytes of every matrix a kind reads by rows
    (``matrix_sizes``, all layers), spread over (layer, kind) pairs where the held-out ``sensitivities``
    (one per kind) estimate the least loss per byte skipped; over ``kinds`` (default ``model_wide_kinds``)."""
    target = _check_target(MODEL_WIDE, target)
    kinds = kinds or model_wide_kinds(cfg.ffn_kind)
    sizes = matrix_sizes(cfg)
    levels = sensitivities[kinds[0]].levels
    if any(not np.array_equal(sensitivities[kind].levels, levels) for kind in kinds):
        raise ValueError("model-wide allocation compares costs at the same levels for every kind")
    cost = np.concatenate([sensitivities[kind].cost for kind in kinds])
    weight = np.concatenate([np.full(cfg.n_layers, sizes[kind], np.float64) for kind in kinds])
    s = calibration.greedy_levels(cost, levels, weight, target).reshape(len(kinds), cfg.n_layers)
    thresholds = {kind: hists[kind].thresholds(row) for kind, row in zip(kinds, s)}
    return SparsityThresholds(thresholds.get("activation"), thresholds.get("input"), {MODEL_WIDE: target},
                              dict(zip(kinds, s)), "greedy", {"calibration_tokens": hists["input"].n_tokens},
                              thresholds.get("qkv"), thresholds.get("o"))


def skipped_thresholds(th: SparsityThresholds) -> np.ndarray:
    """(n_layers, 4) thresholds in ``KINDS`` order, -1 for a kind that is off: ``calibration.held_out_loss``'s."""
    return np.stack([np.full(th.n_layers, -1.0) if getattr(th, kind) is None else getattr(th, kind)
                     for kind in KINDS], 1).astype(np.float32)


def measured_choice(model: ModelArg, heldout: Any, candidates: dict[str, SparsityThresholds], *,
                    progress: bool = False) -> SparsityThresholds:
    """The candidate allocation with the least loss on ``heldout`` (``calibration.held_out_loss``), as method
    "greedy"; its ``meta`` names the one kept ("allocation") and holds every candidate's loss."""
    losses = {name: calibration.held_out_loss(model, heldout, skipped_thresholds(th))
              for name, th in tqdm(candidates.items(), desc="held-out losses", disable=not progress)}
    best = min(losses, key=losses.get)
    return dataclasses.replace(candidates[best], method="greedy",
                               meta=candidates[best].meta | {"allocation": best, "held_out_loss": losses})


def greedy_thresholds(model: ModelArg, hists: dict[str, calibration.ScoreHistogram], targets: dict[str, float | None],
                      heldout: Any, *, progress: bool = False) -> SparsityThresholds:
    """``method="greedy"``: per kind the Fisher allocation over layers (``from_histograms``), unless the uniform
    one loses less on ``heldout`` (measured: the estimates cannot see a loss that goes down, and the per-layer
    costs are taken alone): so never worse than uniform on those windows."""
    loaded = resolve_model(model)
    sensitivities = {kind: calibration.sensitivity(loaded, heldout, hists[kind], progress=progress)
                     for kind, target in targets.items() if target is not None and kind != HEAD}
    candidates = {"fisher": from_histograms(hists, targets, "greedy", sensitivities),
                  "uniform": from_histograms(hists, targets, "uniform")}
    return measured_choice(loaded, heldout, candidates, progress=progress)


CURVE_WINDOWS = 4  # held-out windows each point of a kind's measured loss curve takes (one pass a point)


def kind_curves_thresholds(model: ModelArg, hists: dict[str, calibration.ScoreHistogram], target: float,
                           heldout: Any, *, kinds: tuple[str, ...] | None = None, progress: bool = False
                           ) -> SparsityThresholds:
    """Model-wide ``target`` spread over ``kinds`` (default ``model_wide_kinds``), each kind skipping one
    fraction in every layer, by measured costs: each kind alone at levels 0.1, 0.2, ... (its loss over dense on
    the first ``CURVE_WINDOWS`` held-out windows), then ``calibration.greedy_levels`` over kinds per byte."""
    loaded = resolve_model(model)
    cfg = loaded.cfg
    target = _check_target(MODEL_WIDE, target)
    kinds = kinds or model_wide_kinds(cfg.ffn_kind)
    levels = np.round(np.arange(0.0, min(max(2 * target, 0.1), 0.9) + 1e-9, 0.1), 3)
    if levels[-1] < target:
        levels = np.append(levels, target)
    windows = passes.as_tokens(heldout, cfg.vocab_size)[:CURVE_WINDOWS]
    off = np.full((cfg.n_layers, len(KINDS)), -1.0, np.float32)
    with tqdm(total=1 + len(kinds) * (len(levels) - 1), desc="loss curves", disable=not progress) as bar:
        dense = calibration.held_out_loss(loaded, windows, off)
        bar.update()
        cost = np.zeros((len(kinds), len(levels)))
        for k, kind in enumerate(kinds):
            for j, level in enumerate(levels[1:], 1):
                thresholds = off.copy()
                thresholds[:, KINDS.index(kind)] = hists[kind].thresholds(np.full(cfg.n_layers, level))
                cost[k, j] = calibration.held_out_loss(loaded, windows, thresholds) - dense
                bar.update()
    sizes = matrix_sizes(cfg)
    s = calibration.greedy_levels(cost, levels, np.array([sizes[kind] for kind in kinds], np.float64), target)
    fractions = {kind: np.full(cfg.n_layers, level) for kind, level in zip(kinds, s)}
    thresholds = {kind: hists[kind].thresholds(fractions[kind]) for kind in kinds}
    return SparsityThresholds(thresholds.get("activation"), thresholds.get("input"), {MODEL_WIDE: target},
                              fractions, "greedy", {"calibration_tokens": hists["input"].n_tokens},
                              thresholds.get("qkv"), thresholds.get("o"))


def model_wide_greedy(model: ModelArg, hists: dict[str, calibration.ScoreHistogram], target: float, heldout: Any,
                      *, kinds: tuple[str, ...] | None = None,
                      sensitivities: dict[str, calibration.Sensitivity] | None = None, progress: bool = False
                      ) -> SparsityThresholds:
    """``model_wide=``: of three allocations of the byte ``target`` over ``kinds`` (default ``model_wide_kinds``)
    the one with the least loss on ``heldout``: the Fisher one over (layer, kind) pairs (``model_wide_thresholds``;
    ``sensitivities`` when already taken), the measured one over kinds (``kind_curves_thresholds``) and uniform
    (every matrix the target). So it is never worse than uniform on those windows."""
    loaded = resolve_model(model)
    kinds = kinds or model_wide_kinds(loaded.cfg.ffn_kind)
    if sensitivities is None:
        sensitivities = {kind: calibration.sensitivity(loaded, heldout, hists[kind], progress=progress)
                         for kind in kinds}
    uniform = from_histograms(hists, dict.fromkeys(kinds, target), "uniform")
    candidates = {"fisher": model_wide_thresholds(hists, sensitivities, loaded.cfg, target, kinds),
                  "kind curves": kind_curves_thresholds(loaded, hists, target, heldout, kinds=kinds, progress=progress),
                  "uniform": dataclasses.replace(uniform, target={MODEL_WIDE: target})}
    return measured_choice(loaded, heldout, candidates, progress=progress)


def histograms(model: ModelArg, windows: Any, *, batch_size: int = 4, progress: bool = False
               ) -> dict[str, calibration.ScoreHistogram]:
    """Per kind (``KINDS`` and ``HEAD``) the histogram ``from_histograms`` reads, from one dense pass."""
    return dict(zip((*KINDS, HEAD), calibration.histograms(model, windows, batch_size=batch_size, progress=progress)))


def calibrate_sparsity(
    model: ModelArg,
    windows: Any,
    *,
    activation: float | None = None,
    input: float | None = None,
    attention: float | None = None,
    model_wide: float | None = None,
    head: float | None = None,
    method: str = "uniform",
    heldout: Any = None,
    batch_size: int = 4,
    progress: bool = False,
    hists: dict[str, calibration.ScoreHistogram] | None = None,
) -> SparsityThresholds:
    """Thresholds skipping the fraction ``activation`` of each layer's neurons, ``input`` of its
    FFN input dimensions and ``attention`` of the inputs of its attention's q|k|v and output products
    (None: that kind off), calibrated on ``windows`` (token windows (n, T)),
    or on their ``hists`` (``histograms``) when already taken.
    ``method="greedy"`` also needs ``heldout`` windows (other text than the calibration's and the
    test's), on which it estimates each layer's loss increase per level. ``model_wide`` instead of the
    per-kind targets: that fraction of the bytes of every matrix read by rows, spread over layers and kinds
    by the same held-out estimates (``model_wide_thresholds``; needs ``heldout``). ``head``: the fraction of the
    head's inputs skipped (with per-kind or model-wide targets, or alone; its quantile, whatever the method)."""
    if model_wide is not None:
        return _calibrate_model_wide(model, windows, model_wide, (activation, input, attention), head, heldout,
                                     batch_size, progress, hists)
    check_targets(activation, input, method, attention=attention, head=head)
    if method == "greedy" and heldout is None:
        raise ValueError("method='greedy' measures the loss on held-out text: pass heldout= token windows")
    loaded = resolve_model(model)
    targets = check_targets(activation, input, method, loaded.cfg.ffn_kind, attention=attention, head=head)
    if hists is None:
        hists = histograms(loaded, windows, batch_size=batch_size, progress=progress)
    if method == "greedy":
        return greedy_thresholds(loaded, hists, targets, heldout, progress=progress)
    return from_histograms(hists, targets, method)


def check_model_wide(target: float, per_kind: tuple[float | None, ...], head: float | None = None) -> float:
    """A model-wide target, checked: a fraction, given without ``per_kind`` targets (it spreads over every kind);
    and the ``head``'s target that may go with it."""
    if any(t is not None for t in per_kind):
        raise ValueError("a model-wide target spreads over every kind: give it without the per-kind targets")
    _check_target(HEAD, head)
    return _check_target(MODEL_WIDE, target)


@dataclasses.dataclass(frozen=True)
class SparsityTargets:
    """The threshold mode's targets a profile calibrates (``collect.profile``; fractions skipped, None: that
    kind off): ``activation`` of each layer's neurons, ``input`` of its FFN input dimensions, ``attention`` of
    the inputs of its q|k|v and output products, spread over layers by ``allocation`` (uniform or greedy); or
    ``model_wide`` instead of those three (that fraction of the bytes of every matrix read by rows, spread by
    held-out loss estimates: allocated greedily); and ``head``, of the head's inputs. Checked when made, so a bad
    target fails before a model loads; all None (the default): no threshold mode thresholds."""

    activation: float | None = None
    input: float | None = None
    attention: float | None = None
    model_wide: float | None = None
    head: float | None = None
    allocation: str = "uniform"

    def __post_init__(self) -> None:
        if self.model_wide is not None:
            check_model_wide(self.model_wide, self.per_kind, self.head)
        elif self.on:
            check_targets(self.activation, self.input, self.allocation, attention=self.attention, head=self.head)

    @property
    def per_kind(self) -> tuple[float | None, float | None, float | None]:
        return self.activation, self.input, self.attention

    @property
    def on(self) -> bool:
        """True when any target is given (the profile then calibrates the threshold mode's thresholds)."""
        return any(t is not None for t in (*self.per_kind, self.model_wide, self.head))

    @property
    def method(self) -> str:
        """How the targets spread over layers: a model-wide target is held out like greedy allocation."""
        return "greedy" if self.model_wide is not None else self.allocation

    def check(self, ffn_kind: str) -> None:
        """Raise ``ValueError`` when the targets do not suit a model of ``ffn_kind`` (an activation fraction
        where inactive neurons are exact zeros)."""
        if self.on and self.model_wide is None:
            check_targets(self.activation, self.input, self.allocation, ffn_kind, attention=self.attention,
                          head=self.head)


def _calibrate_model_wide(model: ModelArg, windows: Any, target: float, per_kind: tuple, head: float | None,
                          heldout: Any, batch_size: int, progress: bool,
                          hists: dict[str, calibration.ScoreHistogram] | None) -> SparsityThresholds:
    check_model_wide(target, per_kind, head)
    if heldout is None:
        raise ValueError("model_wide= measures the loss on held-out text: pass heldout= token windows")
    loaded = resolve_model(model)
    if hists is None:
        hists = histograms(loaded, windows, batch_size=batch_size, progress=progress)
    return with_head(model_wide_greedy(loaded, hists, target, heldout, progress=progress), hists, head)
