"""Thresholds of the training-free threshold mode: activation and input sparsity per layer.

``calibrate_sparsity(model, windows, activation=s_a, input=s_i)`` returns ``SparsityThresholds``:
per layer a threshold on |a_i| (activation sparsity: the down projection skips the neurons at or
under it) and one on |x_j| (input sparsity: gate and up skip the FFN input dimensions at or under
it), each calibrated for a target fraction skipped on calibration windows. Allocation:

- ``uniform``: every layer skips the target fraction (its quantile, from one histogram pass);
- ``greedy``: layers skip different fractions averaging the target, spent where a Fisher
  estimate of the loss increase on *held-out* windows is least (``calibration.greedy``), per
  kind.

They travel with the profile (``ActivationProfile.with_sparsity_thresholds``, stored in its
metadata, so its whole-file digest covers them) and feed ``jpinfer.load(mode="threshold")``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpinfer.activations import SMOOTH_KINDS
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.profiler import calibration

METHODS: tuple[str, ...] = ("uniform", "greedy")
KINDS: tuple[str, ...] = ("activation", "input")


@dataclasses.dataclass(frozen=True)
class SparsityThresholds:
    """Per-layer thresholds (float32 (n_layers,)) of the threshold mode; None for a kind that is off.

    ``activation``: on |a_i| (neurons); ``input``: on |x_j| (FFN input dimensions); an entry is
    skipped when its magnitude is at most the threshold. ``layer_sparsity`` holds, per kind, the
    fraction each layer skips on the calibration windows; ``target`` the asked mean fraction.
    """

    activation: np.ndarray | None
    input: np.ndarray | None
    target: dict[str, float]
    layer_sparsity: dict[str, np.ndarray]
    method: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.activation is None and self.input is None:
            raise ValueError("threshold sparsity needs activation or input thresholds (or both)")
        lengths = {len(v) for v in (self.activation, self.input) if v is not None}
        if len(lengths) != 1:
            raise ValueError("activation and input thresholds must have one entry per layer each")
        for kind in KINDS:
            values = getattr(self, kind)
            if values is not None and (not np.all(np.isfinite(values)) or np.any(np.asarray(values) < 0)):
                raise ValueError(f"{kind} thresholds must be finite and >= 0")

    @property
    def n_layers(self) -> int:
        return len(self.activation if self.activation is not None else self.input)

    def describe(self) -> str:
        """e.g. 'activation 50% + input 30% (uniform)'."""
        parts = [f"{kind} {self.target[kind]:.0%}" for kind in KINDS if getattr(self, kind) is not None]
        return f"{' + '.join(parts)} ({self.method})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; float32 thresholds survive the round trip exactly (a double holds every float32)."""
        as_list = lambda v: None if v is None else [float(t) for t in np.asarray(v, np.float32)]
        return {"activation": as_list(self.activation), "input": as_list(self.input), "target": dict(self.target),
                "layer_sparsity": {k: as_list(v) for k, v in self.layer_sparsity.items()}, "method": self.method,
                "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparsityThresholds":
        as_array = lambda v: None if v is None else np.asarray(v, np.float32)
        return cls(as_array(data["activation"]), as_array(data["input"]), dict(data["target"]),
                   {k: as_array(v) for k, v in data["layer_sparsity"].items()}, data["method"], data.get("meta", {}))


def _check_target(kind: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{kind} sparsity is the fraction skipped: give 0 <= s < 1 (or None: off), got {value!r}")
    return float(value)


def check_targets(activation: float | None, input: float | None, method: str, ffn_kind: str | None = None
                  ) -> dict[str, float | None]:
    """The targets per kind, checked (callers check before a model loads or a pass runs; with the
    model's ``ffn_kind`` also that an activation target suits it)."""
    targets = {"activation": _check_target("activation", activation), "input": _check_target("input", input)}
    if all(v is None for v in targets.values()):
        raise ValueError("give activation= and/or input= (fractions to skip)")
    if method not in METHODS:
        raise ValueError(f"unknown allocation method {method!r}; choose one of {', '.join(METHODS)}")
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
    "activation" of |a| by score "product", "input" of |x|); ``greedy`` reads each kind's
    ``sensitivities`` (``calibration.sensitivity`` on held-out windows)."""
    thresholds, fractions = {"activation": None, "input": None}, {}
    for kind, target in targets.items():
        if target is None:
            continue
        if method == "uniform":
            cal = calibration.uniform(hists[kind], target)
        else:
            cal = calibration.greedy(hists[kind], sensitivities[kind], target)
        thresholds[kind], fractions[kind] = cal.thresholds, cal.layer_sparsity
    return SparsityThresholds(thresholds["activation"], thresholds["input"],
                              {k: v for k, v in targets.items() if v is not None}, fractions, method,
                              {"calibration_tokens": hists["input"].n_tokens})


def histograms(model: ModelArg, windows: Any, *, batch_size: int = 4, progress: bool = False
               ) -> dict[str, calibration.ScoreHistogram]:
    """Per kind ("activation", "input") the histogram ``from_histograms`` reads, from one dense pass."""
    return dict(zip(KINDS, calibration.histograms(model, windows, batch_size=batch_size, progress=progress)))


def calibrate_sparsity(
    model: ModelArg,
    windows: Any,
    *,
    activation: float | None = None,
    input: float | None = None,
    method: str = "uniform",
    heldout: Any = None,
    batch_size: int = 4,
    progress: bool = False,
    hists: dict[str, calibration.ScoreHistogram] | None = None,
) -> SparsityThresholds:
    """Thresholds skipping the fraction ``activation`` of each layer's neurons and ``input`` of its
    FFN input dimensions (None: that kind off), calibrated on ``windows`` (token windows (n, T)),
    or on their ``hists`` (``histograms``) when already taken.
    ``method="greedy"`` also needs ``heldout`` windows (other text than the calibration's and the
    test's), on which it estimates each layer's loss increase per level."""
    check_targets(activation, input, method)
    if method == "greedy" and heldout is None:
        raise ValueError("method='greedy' measures the loss on held-out text: pass heldout= token windows")
    loaded = resolve_model(model)
    targets = check_targets(activation, input, method, loaded.cfg.ffn_kind)
    if hists is None:
        hists = histograms(loaded, windows, batch_size=batch_size, progress=progress)
    sensitivities = None
    if method == "greedy":
        sensitivities = {kind: calibration.sensitivity(loaded, heldout, hists[kind], progress=progress)
                         for kind, target in targets.items() if target is not None}
    return from_histograms(hists, targets, method, sensitivities)
