"""A model's trained predictors and their on-disk form (orbax-checkpoint, versioned, verified).

A predictor set is tied to what it was trained on: the model (its weight fingerprint) and
the profile whose thresholds defined "active" (``profile_fingerprint``). Loading it for
another model or profile is a ``PredictorMismatchError``.

On disk, a directory: ``arrays/`` (an orbax PyTree checkpoint of every layer's arrays) and
``predictors.json`` (format, version, metadata, a blake2b digest of every array, the size and
xxh3-128 digest of every file orbax wrote, and a checksum of its own content). All of it is
checked on every load: predictors are small (a few percent of the model) and a flipped bit
in a weight would otherwise be a silently wrong prediction, never an error; the file digests
catch damage orbax would read past (a truncated data file whose lost part it never reads).
Written into a temporary sibling directory and renamed (``artifacts.atomic_write``), so an
interrupted save leaves no half-written predictor set under the final name, and the temporaries
of killed saves are removed by the next save beside them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jpinfer import artifacts
from jpinfer.errors import ArtifactError
from jpinfer.models.identity import mismatch_message, model_fingerprint
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.predictor.mlp import PredictorWeights
from jpinfer.profiler import ActivationProfile

FORMAT = "jpinfer-predictors"
VERSION = 1
META = "predictors.json"
ARRAYS = "arrays"


class PredictorError(ArtifactError):
    """A predictor directory that cannot be used: missing, damaged, or of another format version."""


class PredictorMismatchError(PredictorError):
    """Predictors trained for another model or another profile than the one given."""


def profile_fingerprint(profile: ActivationProfile) -> str:
    """Hex digest of what a profile means for predictors: its model, thresholds and counts."""
    h = hashlib.blake2b(digest_size=16)
    h.update(profile.model_fingerprint.encode())
    h.update(np.ascontiguousarray(profile.thresholds, np.float32).tobytes())
    h.update(np.ascontiguousarray(profile.counts, np.int64).tobytes())
    return h.hexdigest()


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes() + str(array.dtype).encode(),
                           digest_size=16).hexdigest()


@dataclasses.dataclass
class Predictors:
    """One ``PredictorWeights`` per layer and what they were trained on (``meta``:
    ``model_fingerprint``, ``profile_fingerprint``, ``recall`` target, per-layer scores, ...)."""

    layers: list[PredictorWeights]
    meta: dict[str, Any]

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.layers]

    @property
    def n_params(self) -> int:
        return sum(p.n_params for p in self.layers)

    def check_model(self, model: ModelArg) -> None:
        """Raise PredictorMismatchError unless these predictors were trained for ``model``, saying what
        differs and what to run."""
        loaded = resolve_model(model)
        if model_fingerprint(loaded.cfg, loaded.weights) != self.meta["model_fingerprint"]:
            recorded = {"name": self.meta.get("model_name")} | self.meta.get("model", {})
            raise PredictorMismatchError(mismatch_message("these predictors were trained", recorded,
                                                          self.meta["model_fingerprint"], loaded,
                                                          "jpinfer train-predictors"))

    def check_profile(self, profile: ActivationProfile) -> None:
        """Raise PredictorMismatchError unless these predictors were trained on ``profile``'s labels."""
        if profile_fingerprint(profile) != self.meta["profile_fingerprint"]:
            raise PredictorMismatchError(
                "these predictors were trained on another profile (other thresholds or counts): "
                "train them again on this profile"
            )

    # ----- files
    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the directory ``path`` (replacing an older one); returns it."""
        import orbax.checkpoint as ocp

        path = pathlib.Path(path).absolute()
        tree = {str(i): p.arrays() for i, p in enumerate(self.layers)}
        digests = {layer: {k: _digest(v) for k, v in arrays.items()} for layer, arrays in tree.items()}
        header = {"format": FORMAT, "version": VERSION, "n_layers": len(self.layers), "digests": digests,
                  "meta": self.meta}
        try:
            with artifacts.atomic_write(path, directory=True) as tmp:
                ocp.PyTreeCheckpointer().save(tmp / ARRAYS, tree)
                # read back before publishing: orbax writes on background threads, so a write that failed
                # there (a full disk) becomes an error here instead of a published, damaged checkpoint
                _check_digests(tmp, header, _read_arrays(tmp, header))
                header["files"] = artifacts.directory_records(tmp)  # orbax's files: damage found before orbax reads
                (tmp / META).write_text(artifacts.json_with_checksum(header))
        except Exception as e:  # OSError, or what orbax and tensorstore raise for a failed write
            # (a full disk: ValueError)
            raise PredictorError(f"{path}: cannot write the predictors ({type(e).__name__}: {e})") from None
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelArg | None = None,
             profile: ActivationProfile | None = None) -> "Predictors":
        """Read and verify a predictor directory; with ``model``/``profile``, check it was trained for them."""
        path = pathlib.Path(path).absolute()
        header = _read_header(path)
        tree = _read_arrays(path, header)
        _check_digests(path, header, tree)
        layers = [PredictorWeights(**{k: jnp.asarray(v) for k, v in tree[str(i)].items()})
                  for i in range(header["n_layers"])]
        predictors = cls(layers, header["meta"])
        if model is not None:
            predictors.check_model(model)
        if profile is not None:
            predictors.check_profile(profile)
        return predictors


def _read_header(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_dir():
        raise PredictorError(f"{path}: no such predictor directory")
    try:
        header = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise PredictorError(f"{path}: not a jpinfer predictor directory (no {META}): train again") from None
    except (OSError, ValueError) as e:
        raise PredictorError(f"{path}/{META}: damaged ({e}): train again") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PredictorError(f"{path}: not a jpinfer predictor directory")
    if header.get("version") != VERSION:
        raise PredictorError(
            f"{path}: predictor format version {header.get('version')}, this jpinfer reads {VERSION}: train again"
        )
    try:  # both absent from directories written before they were added: their array digests still hold
        if "checksum" in header:
            artifacts.check_json_checksum(path / META, header)
        artifacts.check_files(path, header.get("files", {}))
    except artifacts.Damaged as damage:
        raise PredictorError(f"{damage}: train again") from None
    return header


def _check_digests(path: pathlib.Path, header: dict[str, Any], tree: dict[str, dict[str, np.ndarray]]) -> None:
    for i in range(header["n_layers"]):
        for name, digest in header["digests"][str(i)].items():
            if _digest(tree[str(i)][name]) != digest:
                raise PredictorError(f"{path}: layer {i} array {name!r} is damaged (checksum mismatch): train again")


def _read_arrays(path: pathlib.Path, header: dict[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    import orbax.checkpoint as ocp

    try:
        tree = ocp.PyTreeCheckpointer().restore(path / ARRAYS)
    except Exception as e:  # orbax and tensorstore raise many types for a damaged checkpoint
        raise PredictorError(f"{path}/{ARRAYS}: damaged predictor checkpoint ({type(e).__name__}): "
                             "train again") from None
    expected = {str(i): set(header["digests"][str(i)]) for i in range(header["n_layers"])}
    if not isinstance(tree, dict) or {k: set(v) for k, v in tree.items()} != expected:
        raise PredictorError(f"{path}/{ARRAYS}: layers or arrays missing from the checkpoint: train again")
    return {layer: {k: np.asarray(v) for k, v in arrays.items()} for layer, arrays in tree.items()}
