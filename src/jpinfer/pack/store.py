"""A pack on disk: one directory, a manifest and one artifact per stage, verified when read.

    DIR/pack.json         the manifest: format, version, the model (name, fingerprint, weights format, FFN
                          kind, dtype, source: ``models.identity.model_record``),
                          the settings, and per finished stage its key, inputs, files (size and digest),
                          seconds; ``complete`` once every stage is in; a checksum of itself
    DIR/calibration.npz   calibration histograms (|a| by neuron, |x| by FFN and attention-product input dimension,
                          and of the head's inputs)
    DIR/profile.npz       the ActivationProfile (its own whole-file digest)
    DIR/thresholds.json   the threshold mode's SparsityThresholds
    DIR/predictors/       the Predictors (orbax checkpoint + verified metadata)
    DIR/placement/        the Placement (placement.json + placement.npz)

The manifest is the commit point: a stage counts as done once the manifest, rewritten atomically
after the stage's artifact was written, lists it; ``complete`` turns true only after the last
stage. So an interrupted ``prepare`` leaves a pack that ``Pack.load`` refuses as incomplete, and
the next ``prepare`` resumes after the last finished stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import numpy as np

from jpinfer import artifacts
from jpinfer.errors import ArtifactError
from jpinfer.models.identity import mismatch_message, model_fingerprint
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.pack.settings import STAGES, PackSettings, stage_keys
from jpinfer.predictor.store import Predictors
from jpinfer.profiler import ActivationProfile, SparsityThresholds
from jpinfer.profiler.calibration import ATTENTION, HEAD, INPUT, ScoreHistogram
from jpinfer.solver import Placement

FORMAT = "jpinfer-pack"
VERSION = 2  # 2: packs of int8 and int4 models too; the manifest records the model's weights format
MANIFEST = "pack.json"
FILES = {"calibration": "calibration.npz", "profile": "profile.npz", "thresholds": "thresholds.json",
         "predictors": "predictors", "placement": "placement"}
REMAKE = "run jpinfer prepare again (jpinfer.prepare(...)): it redoes what is missing or damaged"


class PackError(ArtifactError):
    """A pack directory that cannot be used: missing, damaged, incomplete, or another format version."""


class PackMismatchError(PackError):
    """A pack prepared for another model than the one given."""


class PackIncompleteError(PackError):
    """A pack whose preparation has not finished (interrupted, or still running)."""


def read_manifest(path: pathlib.Path) -> dict[str, Any]:
    """The verified manifest of the pack at ``path`` (format, version, checksum); PackError otherwise."""
    if not path.is_dir():
        raise PackError(f"{path}: no such pack directory (make one with jpinfer prepare --out {path})")
    try:
        manifest = artifacts.read_json(path / MANIFEST)
        if manifest.get("format") != FORMAT:
            raise PackError(f"{path}: not a jpinfer pack ({MANIFEST} is of format {manifest.get('format')!r})")
        version = manifest.get("version")
        if version != VERSION:
            newer = isinstance(version, int) and version > VERSION
            raise PackError(f"{path}: pack format version {version}, this jpinfer reads {VERSION}"
                            f"{' (written by a newer jpinfer)' if newer else ''}: {REMAKE}")
        artifacts.check_json_checksum(path / MANIFEST, manifest)
    except artifacts.Damaged as damage:
        missing = not (path / MANIFEST).exists()
        raise PackError(f"{path}: not a jpinfer pack (no {MANIFEST})" if missing else f"{damage}: {REMAKE}") from None
    return manifest


def pack_problem(path: pathlib.Path) -> str | None:
    """Why the pack directory ``path`` is of no use to this jpinfer (None: it may be; a damaged or
    incomplete pack is not a problem here, since ``prepare`` finishes or redoes it): another format version."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") == VERSION:
        return None
    return f"pack format version {manifest.get('version')}, this jpinfer reads {VERSION}"


def write_manifest(path: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically (the pack's commit point)."""
    with artifacts.atomic_write(path / MANIFEST) as tmp:
        tmp.write_text(artifacts.json_with_checksum({k: v for k, v in manifest.items() if k != "checksum"}))


def stage_files(path: pathlib.Path, stage: str) -> dict[str, dict[str, Any]]:
    """Size and digest of every file of a stage's artifact, keyed by path relative to the pack."""
    target = path / FILES[stage]
    if target.is_dir():
        return {f"{FILES[stage]}/{name}": record for name, record in artifacts.directory_records(target).items()}
    return {FILES[stage]: artifacts.file_record(target)}


def check_stage(path: pathlib.Path, entry: dict[str, Any]) -> None:
    """``artifacts.Damaged`` unless every file the manifest recorded for a stage is there, unchanged."""
    artifacts.check_files(path, entry["files"])


def save_histograms(path: pathlib.Path, hists: dict[str, ScoreHistogram]) -> None:
    with artifacts.atomic_write(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **{kind: hist.counts for kind, hist in hists.items()},
                            score=np.array(hists["activation"].score), n_tokens=np.int64(hists["input"].n_tokens))


def load_histograms(path: pathlib.Path) -> dict[str, ScoreHistogram]:
    """The calibration stage's histograms (the file was verified against the manifest first; one written before
    the attention's histograms existed has "activation" and "input" only, before the head's no "head")."""
    with np.load(path, allow_pickle=False) as f:
        n = int(f["n_tokens"])
        hists = {"activation": ScoreHistogram(f["activation"], str(f["score"]), n)}
        return hists | {kind: ScoreHistogram(f[kind], kind, n) for kind in (INPUT, *ATTENTION, HEAD) if kind in f.files}


def read_thresholds(path: pathlib.Path) -> SparsityThresholds:
    """The thresholds stage's SparsityThresholds (``artifacts.Damaged`` when the file is not as written)."""
    record = artifacts.read_json(path)
    artifacts.check_json_checksum(path, record)
    return SparsityThresholds.from_dict(record)


@dataclasses.dataclass
class Pack:
    """A prepared pack: the profile (carrying the threshold mode's thresholds, so
    ``jpinfer.load(mode="threshold", profile=pack.profile)`` works), the predictors and the
    placement, with the manifest they were recorded in. ``ran``: the stages the ``prepare`` call
    that returned this pack computed (the rest were reused); empty for a loaded pack."""

    path: pathlib.Path
    manifest: dict[str, Any]
    profile: ActivationProfile
    thresholds: SparsityThresholds
    predictors: Predictors
    placement: Placement
    ran: tuple[str, ...] = ()

    @property
    def settings(self) -> PackSettings:
        return PackSettings.from_dict(self.manifest["settings"])

    @property
    def model_fingerprint(self) -> str:
        return self.manifest["model"]["fingerprint"]

    @property
    def dtype(self) -> str:
        """The dtype the placement was sized for."""
        return self.manifest["model"]["dtype"]

    @property
    def weights(self) -> str:
        """The weights format of the model it was prepared for ("float", "int8", "int4")."""
        return self.manifest["model"]["weights"]

    def calibration_histograms(self) -> dict[str, ScoreHistogram]:
        """The calibration stage's histograms ("activation": |a|, "input": |x|, and with ``attention_sparsity``
        "qkv" and "o": the attention products' |x|), from which
        ``profiler.sparsity.from_histograms`` gives the threshold mode's thresholds for any target
        without another pass over the text (the file verified again: it is read after ``load``)."""
        try:
            check_stage(self.path, self.manifest["stages"]["calibration"])
        except artifacts.Damaged as damage:
            raise PackError(f"{damage}: {REMAKE}") from None
        return load_histograms(self.path / FILES["calibration"])

    def check_model(self, model: ModelArg) -> None:
        """PackMismatchError unless this pack was prepared for ``model`` (its weight fingerprint)."""
        check_model(self.path, self.manifest, model)

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelArg | None = None) -> "Pack":
        """Read and verify a pack; with ``model``, check it was prepared for that model. A missing,
        damaged, incomplete, other-version or foreign pack is a PackError saying so and what to do."""
        path = pathlib.Path(path).expanduser().absolute()
        manifest = read_manifest(path)
        if not manifest.get("complete"):
            done = [s for s in STAGES if s in manifest.get("stages", {})]
            raise PackIncompleteError(f"{path}: an unfinished pack (stages done: {', '.join(done) or 'none'}; "
                                      f"interrupted, or prepare is still running): {REMAKE} to finish it")
        if model is not None:
            check_model(path, manifest, model)
        check_keys(path, manifest)
        try:
            for stage in STAGES:
                check_stage(path, manifest["stages"][stage])
            thresholds = read_thresholds(path / FILES["thresholds"])
            profile = ActivationProfile.load(path / FILES["profile"]).with_sparsity_thresholds(thresholds)
            predictors = Predictors.load(path / FILES["predictors"])
            placement = Placement.load(path / FILES["placement"])
        except (artifacts.Damaged, ArtifactError, KeyError, TypeError, ValueError) as err:
            raise PackError(f"{err}: {REMAKE}") from None
        return cls(path, manifest, profile, thresholds, predictors, placement)


def check_model(path: pathlib.Path, manifest: dict[str, Any], model: ModelArg) -> None:
    """PackMismatchError unless the pack at ``path`` was prepared for ``model`` (its weight fingerprint),
    saying what differs (the model, or its weights format, ...) and what to run."""
    loaded = resolve_model(model)
    recorded = manifest["model"]
    if recorded["fingerprint"] != model_fingerprint(loaded.cfg, loaded.weights):
        raise PackMismatchError(mismatch_message(f"{path}: a pack prepared", recorded, recorded["fingerprint"], loaded,
                                                 "jpinfer prepare"))


def check_keys(path: pathlib.Path, manifest: dict[str, Any]) -> None:
    """PackError unless every stage was computed from the settings the manifest records, by the stage
    versions of this jpinfer (a stage changed since: its key differs)."""
    model = manifest["model"]
    keys = stage_keys(PackSettings.from_dict(manifest["settings"]), model["ffn_kind"], model["dtype"],
                      model["weights"], model["fingerprint"])
    stale = [s for s in STAGES if manifest["stages"][s]["key"] != keys[s]]
    if stale:
        raise PackError(f"{path}: stages {', '.join(stale)} were made by another version of jpinfer's pack stages: "
                        f"{REMAKE} (it redoes only those)")
