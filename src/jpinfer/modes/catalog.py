"""The engine modes, one object each: what a mode needs, how it takes it from a pack, how it checks
its arguments and how it builds its engine. ``jpinfer.load(mode=...)`` is a lookup here and a build.

- ``dense``: the reference decoder.
- ``sparse``: every neuron on one device; the predictor picks each token's neurons.
- ``hybrid``: the placement's hot neurons on the accelerator, the cold ones on the CPU device, the
  predictor deciding within each part. Given ``thresholds`` instead of predictors it is the named
  variant ``hybrid (threshold)``: the threshold mode split by the placement.
- ``threshold``: training-free activation and input sparsity with calibrated thresholds.

Adding a mode is adding one ``Mode`` subclass and its entry in ``MODES``. Building imports the
engines (and through them the predictor package, Flax) only when a sparse mode is built: choosing
and checking a mode loads nothing heavy, so a bad argument fails before a model loads.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from jpinfer.config import WEIGHT_FORMATS
from jpinfer.errors import JpinferError
from jpinfer.models.loading import LoadedModel
from jpinfer.runtime.engine import Engine


@dataclasses.dataclass(frozen=True)
class ModeInputs:
    """What a mode may be given (``jpinfer.load``'s mode arguments); paths are read at build time.

    predictors: ``Predictors`` or its directory; profile: ``ActivationProfile`` or its file;
    placement: ``solver.Placement`` or one boolean mask per layer (True = accelerator); gpu_budget:
    "6GB", "512MiB", bytes or a fraction of the weights; thresholds: ``profiler.SparsityThresholds``
    or "profile" (the profile's); capacity: see ``ffn.capacity.layer_capacities``.
    """

    predictors: Any = None
    profile: Any = None
    placement: Any = None
    gpu_budget: Any = None
    thresholds: Any = None
    capacity: Any = "predicted"

    def names_no_artifact(self) -> bool:
        """True when nothing names where the mode's profile, predictors or placement come from (so the
        default model may take its default pack)."""
        return (self.predictors is None and self.profile is None and self.placement is None
                and self.thresholds in (None, "profile"))


class Mode:
    """One engine mode. Subclasses set the class attributes and override what differs."""

    name: str = ""
    label: str = ""  # how results name it (the name, or the variant)
    uses_pack: bool = True  # takes what it needs from a pack
    two_devices: bool = False  # runs over an accelerator and the host (two simulated CPU devices without a GPU)

    def variant_for(self, thresholds: Any) -> Mode:
        """The mode that runs when ``thresholds`` are given (itself unless a variant handles them)."""
        return self

    def check(self, inputs: ModeInputs) -> None:
        """Raise ``JpinferError`` when ``inputs`` lack what the mode needs (before anything loads)."""

    def from_pack(self, pack: Any, dtype: Any, inputs: ModeInputs) -> ModeInputs:
        """``inputs`` with what they leave out taken from ``pack`` (a ``pack.Pack``: the caller
        checks it is the model's); ``dtype`` is the model's (a name or a dtype)."""
        return inputs

    def build(self, model: LoadedModel, inputs: ModeInputs, *, devices: tuple[Any, Any] | None = None,
              hardware: Any = None) -> Engine:
        """The engine of this mode for ``model``; ``devices`` (accelerator, host) and ``hardware`` (a
        measured ``solver.HardwareProfile`` for the placement) matter to the hybrid only."""
        raise NotImplementedError


class Dense(Mode):
    name = label = "dense"
    uses_pack = False

    def build(self, model, inputs, *, devices=None, hardware=None):
        return Engine(model)


def _read_profile(model: LoadedModel, profile: Any) -> Any:
    """The profile object (read from its file when a path is given), checked to be the model's."""
    from jpinfer.profiler import ActivationProfile

    if isinstance(profile, (str, pathlib.Path)):
        return ActivationProfile.load(profile, model)
    if profile is not None:
        profile.check_model(model)
    return profile


class _Predicted(Mode):
    """A mode whose neurons the predictors choose."""

    def check(self, inputs):
        if inputs.predictors is None:
            raise JpinferError(f"mode {self.name!r} needs predictors (jpinfer train-predictors, then predictors=PATH), "
                               "or mode 'threshold' (training-free)")
        if inputs.thresholds is not None:
            raise JpinferError(f"mode {self.name!r} chooses neurons with predictors: drop thresholds= "
                               "(or use mode 'threshold')")

    def from_pack(self, pack, dtype, inputs):
        return dataclasses.replace(inputs, profile=_given(inputs.profile, pack.profile),
                                   predictors=_given(inputs.predictors, pack.predictors))

    def _prepared(self, model: LoadedModel, inputs: ModeInputs) -> tuple[Any, Any, tuple[int, ...]]:
        """(predictors, profile, per-layer capacities), read and checked against the model."""
        from jpinfer.ffn.capacity import layer_capacities
        from jpinfer.predictor.store import Predictors

        profile = _read_profile(model, inputs.profile)
        predictors = inputs.predictors
        if isinstance(predictors, (str, pathlib.Path)):
            predictors = Predictors.load(predictors, model, profile)
        predictors.check_model(model)
        if profile is not None:
            predictors.check_profile(profile)
        return predictors, profile, layer_capacities(model.cfg, inputs.capacity, profile, predictors)


class _Thresholded(Mode):
    """A mode whose neurons and input dimensions calibrated thresholds choose (no predictors). Its layouts hold
    float or int8 rows (``sparse.threshold_layout``; int4: int8 copies of the two matrices it reads by rows, made
    from the 4-bit blocks, which cannot be read by input rows)."""

    def check(self, inputs):
        if inputs.predictors is not None:
            raise JpinferError("threshold sparsity needs no predictors: drop predictors= (or use mode 'sparse')")
        if inputs.profile is None and (inputs.thresholds is None or isinstance(inputs.thresholds, str)):
            raise JpinferError("threshold sparsity needs thresholds: a profile carrying them (profile=PATH, made by "
                               "jpinfer profile --activation-sparsity S) or thresholds=SparsityThresholds")
        if isinstance(inputs.thresholds, str) and inputs.thresholds != "profile":
            raise JpinferError(f"thresholds must be a SparsityThresholds or 'profile' (the profile's), "
                               f"got {inputs.thresholds!r}")

    def from_pack(self, pack, dtype, inputs):
        return dataclasses.replace(inputs, profile=_given(inputs.profile, pack.profile))

    def _prepared(self, model: LoadedModel, inputs: ModeInputs) -> tuple[Any, Any]:
        """(thresholds, profile): the given thresholds, or (None or "profile") the profile's."""
        profile = _read_profile(model, inputs.profile)
        thresholds = inputs.thresholds
        if thresholds is None or isinstance(thresholds, str):
            thresholds = profile.sparsity_thresholds()
        if not thresholds.fits(model.cfg.n_layers):
            raise JpinferError(f"got thresholds for {thresholds.n_layers} layers; the model has {model.cfg.n_layers}")
        return thresholds, profile


class _Split(Mode):
    """Hot neurons on the accelerator, cold on the host: a placement, or a budget and a profile to solve one.
    Mixed in before how the neurons are chosen (``_Predicted`` or ``_Thresholded``), whose checks and pack
    arguments come first (``super()``)."""

    two_devices = True

    def check(self, inputs):
        super().check(inputs)
        if inputs.placement is None and (inputs.gpu_budget is None or inputs.profile is None):
            raise JpinferError("mode 'hybrid' needs a placement, or gpu_budget=... and the profile to solve one")
        if inputs.placement is not None and inputs.gpu_budget is not None:
            raise JpinferError("give either placement or gpu_budget, not both")

    def from_pack(self, pack, dtype, inputs):
        """The pack's placement unless a placement or budget is given; when it was sized for another
        dtype (bytes per neuron) the placement is solved again for this one under the pack's budget."""
        inputs = super().from_pack(pack, dtype, inputs)
        if inputs.placement is not None or inputs.gpu_budget is not None:
            return inputs
        import jax.numpy as jnp

        if pack.dtype == jnp.dtype(dtype).name:
            return dataclasses.replace(inputs, placement=pack.placement)
        return dataclasses.replace(inputs, gpu_budget=pack.settings.gpu_budget)

    @staticmethod
    def _masks(model: LoadedModel, profile: Any, predictors: Any, inputs: ModeInputs, hardware: Any) -> list:
        from jpinfer.modes.placement import placement_masks

        return placement_masks(model, profile, predictors, inputs.gpu_budget, inputs.placement, hardware)


class Sparse(_Predicted):
    name = label = "sparse"

    def build(self, model, inputs, *, devices=None, hardware=None):
        from jpinfer.modes.engines import sparse_engine

        predictors, _, ks = self._prepared(model, inputs)
        return sparse_engine(model, predictors, ks)


class HybridThreshold(_Split, _Thresholded):
    name, label = "hybrid", "hybrid (threshold)"

    def build(self, model, inputs, *, devices=None, hardware=None):
        from jpinfer.modes.engines import hybrid_engine

        thresholds, profile = self._prepared(model, inputs)
        masks = self._masks(model, profile, None, inputs, hardware)
        return hybrid_engine(model, None, masks, None, devices, thresholds=thresholds)


class Hybrid(_Split, _Predicted):
    name = label = "hybrid"

    def variant_for(self, thresholds):
        return HYBRID_THRESHOLD if thresholds is not None else self

    def build(self, model, inputs, *, devices=None, hardware=None):
        from jpinfer.ffn.capacity import part_capacities
        from jpinfer.modes.engines import hybrid_engine

        predictors, profile, ks = self._prepared(model, inputs)
        masks = self._masks(model, profile, predictors, inputs, hardware)
        frequency = None if profile is None else profile.frequency()
        return hybrid_engine(model, predictors, masks, part_capacities(ks, masks, frequency), devices)


class Threshold(_Thresholded):
    name = label = "threshold"

    def build(self, model, inputs, *, devices=None, hardware=None):
        from jpinfer.modes.engines import threshold_engine

        return threshold_engine(model, self._prepared(model, inputs)[0])


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


HYBRID_THRESHOLD = HybridThreshold()
MODES: dict[str, Mode] = {mode.name: mode for mode in (Dense(), Sparse(), Hybrid(), Threshold())}
MODE_NAMES: tuple[str, ...] = tuple(MODES)  # jpinfer.load(mode=...), the CLI's --mode choices
REFERENCE_MODE = "dense"  # what benchmarks compare every other mode with


def get_mode(name: str, *, thresholds: Any = None, weights: str = "float") -> Mode:
    """The mode called ``name`` (its variant for ``thresholds`` where it has one); a ``JpinferError`` when the
    name or the weights format (``config.WEIGHT_FORMATS``: every mode runs each) is unknown, before a model loads."""
    if name not in MODES:
        raise JpinferError(f"unknown mode {name!r}; choose one of {', '.join(MODE_NAMES)}")
    if weights not in WEIGHT_FORMATS:
        raise JpinferError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return MODES[name].variant_for(thresholds)
