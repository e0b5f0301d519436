"""What a pack is prepared with, and which stage reads what.

A pack is made in five stages (``STAGES``, in order), each a function of some settings and of
the stages before it:

    calibration  histograms of |a| and |x| over calibration windows  (one dense pass)
    profile      activity counts and predictor samples, at thresholds for ``sparsity``
    thresholds   the threshold mode's per-layer thresholds (from the calibration histograms)
    predictors   one predictor per layer, trained on the profile's samples
    placement    the hot neurons for ``gpu_budget`` (from the profile and the predictors' sizes)

A stage's key is a digest of its inputs (``stage_inputs``) and of the keys of the stages it reads,
so a changed setting invalidates exactly the stages that depend on it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jpinfer import artifacts
from jpinfer.activations import SMOOTH_KINDS
from jpinfer.errors import JpinferError
from jpinfer.modes.placement import parse_budget
from jpinfer.profiler.sparsity import check_model_wide, check_targets

# Bump a stage's version when what it computes changes; its key (and those after it) change with it.
STAGE_VERSIONS = {"calibration": 1, "profile": 1, "thresholds": 1, "predictors": 1, "placement": 1}
STAGES = tuple(STAGE_VERSIONS)
DEPENDS = {"calibration": (), "profile": ("calibration",), "thresholds": ("calibration",),
           "predictors": ("profile",), "placement": ("profile", "predictors")}
OBJECTIVES = ("mass", "latency")


AUTO = "auto"  # a per-kind target the weights format decides (``PackSettings.threshold_targets``)
AUTO_TARGET = 0.25
HEAD_AUTO_TARGET = 0.2


@dataclasses.dataclass(frozen=True)
class PackSettings:
    """Settings of ``jpinfer.prepare``. The defaults build the default model's pack in about
    five minutes on two CPU cores (``bench/results/REPORT.md``, setup).

    corpus / fields / window / seed: the text (as ``jpinfer.profile``); ``calibration_tokens`` of it
    calibrate the thresholds (twice as many are tokenized: greedy allocation holds out the second half),
    ``n_tokens`` are profiled, keeping ``n_samples`` predictor samples per layer.
    sparsity: SwiGLU-like models' (no exact zeros) activity thresholds (what "active" means for the profile and the
    predictors), calibrated for this fraction of inactive neurons per layer.
    threshold_sparsity / input_sparsity / attention_sparsity / allocation: the threshold mode's targets
    (``threshold_sparsity`` None: ``sparsity`` on SwiGLU-like models, exact zeros on ReLU kinds; input and
    attention None: that kind off; attention: the inputs of the q|k|v and output products). Input and attention
    default to "auto": a quarter of the inputs of every product skipped (``AUTO_TARGET``) where the weights are
    float or int8, off for int4. Why: on the default model the quarter with half the neurons reads 0.75 of the
    weight bytes at the perplexity of half the neurons alone (1.016x dense; the attention's quarter lowers it,
    ``bench/results/model_wide.md``); but int4 reads the matrices it skips rows of as int8 copies (1 byte a
    weight against the 4-bit blocks' 0.5625): 1.065 of dense int4's bytes, 0.83x dense int4 against 0.96x for
    half the neurons alone (``bench/results/model_wide_int4.md``, 2-core Intel Xeon, 2026-12-06).
    head_sparsity: the fraction of the head's inputs skipped (None: off); "auto" (default): ``HEAD_AUTO_TARGET``
    with float weights, off with int8 and int4. A given fraction serves every format (an int8 head, int4's too, is
    then read through its input-major copy: ``modes.engines.threshold_engine``), but on the default model in int8
    the fifth took the threshold mode's perplexity from 1.034x to 1.049x dense int8 (16 WikiText-2 windows), at
    the edge of the 1.05x the mode is held to, for 4-5% of step time; int4 measured no faster
    (``bench/results/experiments/threshold_int8_head.md``). Why 0.2: the head is a fifth of the default model's
    weight bytes; beside the quarters above, a fifth of its inputs takes the bytes read from 0.750 to 0.708 of
    dense at 1.026x perplexity (1.016x without), a tenth 0.729 at 1.017x, three tenths 0.687 at 1.051x, past the
    1.05x the threshold mode is held to
    (``bench/results/model_wide_head.md``, 2-core Intel Xeon, 2026-12-06); the main bench's threshold row decoded at
    1.35x dense float32 with it (``bench/results/machines/xeon/bench.md``, same day, 14:34 UTC).
    model_wide_sparsity instead of the per-kind targets (left at their defaults, which it replaces): the fraction
    of the bytes of every matrix read by rows skipped, spread over layers and kinds (``profiler.sparsity.
    model_wide_greedy``; greedy, held out like greedy allocation).
    ranks / predictor_budget / recall / strong_recall / max_epochs: predictor training
    (``jpinfer.train_predictors``; ranks None = adaptive widths under the budget, compared by proxy
    trainings on ``search_samples`` samples for ``search_epochs`` epochs).
    gpu_budget / hardware / objective / context: the placement (``jpinfer.load``'s ``gpu_budget``:
    "6GB", "512MiB", bytes or a fraction of the weights; a hardware preset name or "measure";
    objective "mass" or "latency"; tokens of KV cache kept on the accelerator). The placement also
    depends on the dtype the model was loaded in (bytes per neuron), the others do not.
    """

    corpus: str = "wikitext2-valid"
    fields: tuple[str, ...] = ()
    window: int = 512
    seed: int = 0
    calibration_tokens: int = 8192
    n_tokens: int = 32768
    n_samples: int = 16384
    sparsity: float = 0.5
    threshold_sparsity: float | None = None
    input_sparsity: float | str | None = AUTO
    attention_sparsity: float | str | None = AUTO
    model_wide_sparsity: float | None = None
    head_sparsity: float | str | None = AUTO
    allocation: str = "uniform"
    ranks: int | None = None
    search_samples: int = 8192
    search_epochs: int = 2
    predictor_budget: float = 0.1
    recall: float = 0.99
    strong_recall: float = 0.999
    max_epochs: int = 8
    gpu_budget: str = "0.75"
    hardware: str = "rtx4090"
    objective: str = "mass"
    context: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "gpu_budget", str(self.gpu_budget))
        for name in ("window", "calibration_tokens", "n_tokens", "n_samples", "search_samples", "search_epochs",
                     "max_epochs", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise JpinferError(f"pack setting {name} must be an integer >= 1, got {value!r}")
        if self.n_tokens < self.window or self.calibration_tokens < self.window:
            raise JpinferError(f"n_tokens ({self.n_tokens}) and calibration_tokens ({self.calibration_tokens}) must "
                               f"hold at least one window of {self.window} tokens")
        if not 0.0 <= self.sparsity < 1.0:
            raise JpinferError(f"sparsity is the fraction of inactive neurons: give 0 <= s < 1, got {self.sparsity!r}")
        try:
            targets = self._targets("float")
            check_targets(targets["activation"], targets["input"], self.allocation, attention=targets["attention"],
                          head=targets["head"])
            if self.model_wide_sparsity is not None:  # it replaces the per-kind targets: none moved off its default
                default = {f.name: f.default for f in dataclasses.fields(self)}
                moved = tuple(name for name in ("threshold_sparsity", "input_sparsity", "attention_sparsity")
                              if getattr(self, name) != default[name])
                check_model_wide(self.model_wide_sparsity, moved)
        except ValueError as e:
            raise JpinferError(f"threshold mode settings: {e}") from None
        if self.ranks is not None and (not isinstance(self.ranks, int) or self.ranks < 1):
            raise JpinferError(f"ranks must be None (adaptive) or an integer >= 1, got {self.ranks!r}")
        for name in ("predictor_budget", "recall", "strong_recall"):
            if not 0 < getattr(self, name) <= 1:
                raise JpinferError(f"{name} must lie in (0, 1], got {getattr(self, name)!r}")
        parse_budget(self.gpu_budget, 1)  # its syntax, before any model loads (the bytes need the model)
        if self.objective not in OBJECTIVES:
            raise JpinferError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        from jpinfer.solver import PRESETS

        if self.hardware != "measure" and self.hardware not in PRESETS:
            raise JpinferError(f"hardware must be a preset ({', '.join(PRESETS)}) or 'measure', got {self.hardware!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"fields": list(self.fields)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PackSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise JpinferError(f"unknown pack settings {sorted(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def _targets(self, weights: str) -> dict[str, Any]:
        """Activation (SwiGLU-like models), input, attention and head targets, "auto" resolved for ``weights``."""
        def resolve(name: str, auto: float | None) -> float | None:
            value = getattr(self, name)
            if isinstance(value, str):
                if value != AUTO:
                    raise ValueError(f"{name} is a fraction, None (off) or {AUTO!r}, got {value!r}")
                return auto
            return value

        rows = None if weights == "int4" else AUTO_TARGET
        return {"activation": self.sparsity if self.threshold_sparsity is None else self.threshold_sparsity,
                "input": resolve("input_sparsity", rows), "attention": resolve("attention_sparsity", rows),
                "head": resolve("head_sparsity", HEAD_AUTO_TARGET if weights == "float" else None)}

    def threshold_targets(self, ffn_kind: str, weights: str) -> dict[str, Any]:
        """The threshold mode's targets for a model of ``ffn_kind`` (ReLU kinds skip exact zeros) with ``weights``
        ("float", "int8", "int4": what "auto" means). "attention" and "head" only when on: the record (and the
        thresholds stage's key) of a pack without them stays what it was."""
        targets = self._targets(weights)
        head = {} if targets["head"] is None else {"head": targets["head"]}
        if self.model_wide_sparsity is not None:
            return {"model_wide": self.model_wide_sparsity} | head
        activation = targets["activation"] if ffn_kind in SMOOTH_KINDS else 0.0
        attention = {} if targets["attention"] is None else {"attention": targets["attention"]}
        return {"activation": activation, "input": targets["input"], "allocation": self.allocation} | attention | head


def stage_inputs(settings: PackSettings, ffn_kind: str, dtype: str, weights: str) -> dict[str, dict[str, Any]]:
    """Per stage, the settings it reads (resolved: what the stage computes with) for a model of
    ``ffn_kind`` loaded in ``dtype`` with ``weights`` (its format)."""
    text = {"corpus": settings.corpus, "fields": list(settings.fields), "window": settings.window,
            "seed": settings.seed}
    return {
        "calibration": text | {"calibration_tokens": settings.calibration_tokens},
        "profile": text | {"n_tokens": settings.n_tokens, "n_samples": settings.n_samples,
                           "sparsity": settings.sparsity if ffn_kind in SMOOTH_KINDS else None},
        "thresholds": settings.threshold_targets(ffn_kind, weights),
        "predictors": {"recall": settings.recall, "strong_recall": settings.strong_recall,
                       "max_epochs": settings.max_epochs} | (
            {"ranks": settings.ranks} if settings.ranks is not None else
            {"ranks": "adaptive", "budget": settings.predictor_budget, "search_samples": settings.search_samples,
             "search_epochs": settings.search_epochs}),
        "placement": {"gpu_budget": settings.gpu_budget, "hardware": settings.hardware,
                      "objective": settings.objective, "context": settings.context, "dtype": dtype},
    }


def stage_keys(settings: PackSettings, ffn_kind: str, dtype: str, weights: str, model_fingerprint: str
               ) -> dict[str, str]:
    """Per stage, the digest of the model, its inputs, its version and the keys of the stages it reads."""
    inputs = stage_inputs(settings, ffn_kind, dtype, weights)
    keys: dict[str, str] = {}
    for stage in STAGES:
        record = [stage, STAGE_VERSIONS[stage], model_fingerprint, inputs[stage], [keys[d] for d in DEPENDS[stage]]]
        keys[stage] = artifacts.digest(json.dumps(record, sort_keys=True).encode())
    return keys

