"""ActivationProfile: what the profiler measured, and its versioned file format.

Everything here has a fixed size for a given model (counts per neuron, a histogram of
active neurons per token, one threshold per layer), whatever the corpus length.
A profile remembers a fingerprint of the model's weights and what it was (``meta["model"]``:
``models.identity.model_record``); loading it for another model is a ``ProfileMismatchError``
saying what differs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import zipfile
from typing import Any

import numpy as np

from jpinfer import artifacts
from jpinfer.errors import ArtifactError
from jpinfer.models.identity import mismatch_message, model_fingerprint
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.profiler.samples import SAMPLES_REMAKE, PredictorSamples, SamplesError
from jpinfer.profiler.sparsity import SparsityThresholds

FORMAT = "jpinfer-activation-profile"
VERSION = 3  # 2: fingerprints of the fused (out, in) weight layout; 3: a digest of the whole file


REMAKE = "profile again (jpinfer.profile(...).save(path), or jpinfer profile --out path)"


class ProfileError(ArtifactError):
    """A profile file that cannot be read or written (missing, damaged, another format or
    version); the message names the file and says to profile again."""


class ProfileMismatchError(ProfileError):
    """A profile made for a different model than the one given."""


@dataclasses.dataclass
class ActivationProfile:
    """Per-layer neuron activity of a model over a corpus.

    ``counts[l, i]``: tokens on which neuron i of layer l was active; ``n_tokens``: tokens
    seen; ``active_hist[l, k]``: tokens on which exactly k neurons of layer l were active;
    ``thresholds[l]``: a neuron is active when its score exceeds it (0 for ReLU kinds,
    where active means non-zero). ``meta`` records the corpus, score, calibration, the
    directory of predictor samples (if any) and the threshold mode's thresholds (if calibrated).
    """

    model_name: str
    model_fingerprint: str
    ffn_kind: str
    counts: np.ndarray
    n_tokens: int
    active_hist: np.ndarray
    thresholds: np.ndarray
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def d_ff(self) -> int:
        return self.counts.shape[1]

    def frequency(self) -> np.ndarray:
        """(n_layers, d_ff) fraction of tokens on which each neuron was active."""
        return self.counts / max(self.n_tokens, 1)

    def sparsity(self) -> np.ndarray:
        """(n_layers,) mean fraction of neurons skipped per token."""
        return 1.0 - self.counts.sum(1) / (max(self.n_tokens, 1) * self.d_ff)

    def capacity(self, quantile: float = 0.99, multiple: int = 1) -> np.ndarray:
        """(n_layers,) the smallest active count K with P(active count <= K) >= quantile,
        rounded up to ``multiple`` (a static per-layer capacity for the runtime)."""
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must lie in (0, 1], got {quantile}")
        cdf = np.cumsum(self.active_hist, 1) / np.maximum(self.active_hist.sum(1, keepdims=True), 1)
        k = (cdf < quantile - 1e-12).sum(1)
        return np.minimum(-(-k // multiple) * multiple, self.d_ff)

    def cumulative_share(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(fraction of neurons, share of all activations) with neurons sorted hottest first."""
        c = np.sort(self.counts[layer])[::-1].astype(np.float64)
        share = np.cumsum(c) / max(c.sum(), 1.0)
        return np.arange(1, self.d_ff + 1) / self.d_ff, share

    def neurons_for_share(self, share: float) -> np.ndarray:
        """(n_layers,) smallest fraction of neurons (hottest first) carrying ``share`` of the activations."""
        out = []
        for layer in range(self.n_layers):
            fraction, cum = self.cumulative_share(layer)
            out.append(fraction[min(int(np.searchsorted(cum, share - 1e-12)), self.d_ff - 1)])
        return np.array(out)

    # ----- files
    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write one .npz file (arrays plus JSON metadata); returns its path.

        The zip comment holds a digest of the whole file, which ``load`` checks: the file is
        small and read whole, and zip's own CRC-32s cover the members' data but not its
        bookkeeping. Written to a temporary sibling and renamed, so an interrupted save
        leaves any older profile of that name intact.
        """
        path = pathlib.Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        header = {"format": FORMAT, "version": VERSION, "model_name": self.model_name,
                  "model_fingerprint": self.model_fingerprint, "ffn_kind": self.ffn_kind,
                  "n_tokens": int(self.n_tokens), "meta": self.meta}
        buffer = io.BytesIO()
        np.savez(buffer, counts=self.counts, active_hist=self.active_hist, thresholds=self.thresholds,
                 header=np.array(json.dumps(header)))
        try:
            with artifacts.atomic_write(path) as tmp:
                tmp.write_bytes(_with_digest(buffer))
        except OSError as e:
            raise ProfileError(f"{path}: cannot write the profile ({e.strerror or e})") from None
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelArg = None) -> "ActivationProfile":
        """Read a profile; with ``model`` (an Engine, a LoadedModel or a checkpoint path),
        check that the profile was made for it. A missing, damaged, foreign or other-version
        file is a ProfileError saying so."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ProfileError(f"{path}: cannot read the profile ({e.strerror or e})") from None
        problem = _digest_problem(data)
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as f:
                header = json.loads(str(f["header"]))
                arrays = {k: f[k] for k in ("counts", "active_hist", "thresholds")}
        except Exception as e:  # over damaged bytes zipfile raises BadZipFile, NotImplementedError, zlib.error, ...
            raise ProfileError(f"{path}: not a jpinfer activation profile, or damaged "
                               f"({problem or 'checksum matches'}; {type(e).__name__}: {e}): {REMAKE}") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ProfileError(f"{path}: not a jpinfer activation profile")
        if header.get("version") != VERSION:
            newer = isinstance(header.get("version"), int) and header["version"] > VERSION
            raise ProfileError(
                f"{path}: profile format version {header.get('version')}, this jpinfer reads {VERSION}"
                f"{' (written by a newer jpinfer)' if newer else ''}: {REMAKE}"
            )
        if problem:
            raise ProfileError(f"{path}: {problem}: {REMAKE}")
        profile = cls(header["model_name"], header["model_fingerprint"], header["ffn_kind"], arrays["counts"],
                      header["n_tokens"], arrays["active_hist"], arrays["thresholds"], header["meta"])
        if model is not None:
            profile.check_model(model)
        return profile

    def with_sparsity_thresholds(self, thresholds: SparsityThresholds) -> "ActivationProfile":
        """A copy carrying the threshold mode's thresholds (``profiler.calibrate_sparsity``) in its
        metadata, saved with it."""
        if not thresholds.fits(self.n_layers):
            raise ValueError(f"got thresholds for {thresholds.n_layers} layers; this profile has {self.n_layers}")
        return dataclasses.replace(self, meta=self.meta | {"sparsity_thresholds": thresholds.to_dict()})

    def sparsity_thresholds(self) -> SparsityThresholds:
        """The threshold mode's thresholds stored with this profile (a ProfileError when it has none)."""
        record = self.meta.get("sparsity_thresholds")
        if record is None:
            raise ProfileError("this profile holds no threshold-mode thresholds: calibrate them "
                               "(jpinfer profile --activation-sparsity S [--input-sparsity S] [--attention-sparsity S] "
                               "or --model-wide-sparsity S, or "
                               "profile.with_sparsity_thresholds(jpinfer.profiler.calibrate_sparsity(...)))")
        try:
            return SparsityThresholds.from_dict(record)
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"this profile's threshold-mode thresholds are unreadable ({e}): {REMAKE}") from None

    def samples(self) -> PredictorSamples:
        """The predictor samples this profile was made with (``meta["samples"]``), opened and
        checked to be those: taken from this profile's model with its thresholds."""
        directory = self.meta.get("samples")
        if not directory:
            raise ProfileError(f"this profile holds no predictor samples: {SAMPLES_REMAKE}")
        found = PredictorSamples.open(directory)
        same = (found.meta.get("model_fingerprint") == self.model_fingerprint
                and found.inputs.shape[0] == self.n_layers and found.d_ff == self.d_ff
                and np.array_equal(np.asarray(found.meta.get("thresholds"), np.float32),
                                   np.asarray(self.thresholds, np.float32)))
        if not same:
            raise SamplesError(f"{directory}: these predictor samples were not taken from this profile's model with "
                               f"its thresholds: {SAMPLES_REMAKE}")
        return found

    def check_model(self, model: ModelArg) -> None:
        """Raise ProfileMismatchError unless this profile was made for ``model``, saying what differs (the
        model, or its weights format: an int8 model's FFN inputs differ from the float one's after
        SmoothQuant's migration, so each format is profiled on its own) and what to run."""
        model = resolve_model(model)
        if model_fingerprint(model.cfg, model.weights) != self.model_fingerprint:
            recorded = {"name": self.model_name, "ffn_kind": self.ffn_kind} | self.meta.get("model", {})
            raise ProfileMismatchError(mismatch_message("this profile was made", recorded, self.model_fingerprint,
                                                        model, "jpinfer profile --out PATH"))


_DIGEST_MARK = b"jpinfer whole-file digest "
_DIGEST_PLACEHOLDER = b"0" * 32  # the hex length of artifacts.DIGEST


def _with_digest(npz: io.BytesIO) -> bytes:
    """The zip file in ``npz`` with a comment (the last bytes of a zip) holding the digest of the
    whole file, taken with the digest's place zeroed."""
    with zipfile.ZipFile(npz, "a") as z:
        z.comment = _DIGEST_MARK + _DIGEST_PLACEHOLDER
    data = npz.getvalue()
    return data[: -len(_DIGEST_PLACEHOLDER)] + artifacts.digest(data).encode()


def _digest_problem(data: bytes) -> str | None:
    """What is wrong with a profile's whole-file digest (None when it matches)."""
    n = len(_DIGEST_PLACEHOLDER)
    if data[-n - len(_DIGEST_MARK) : -n] != _DIGEST_MARK:
        return "its whole-file checksum is missing (not saved by ActivationProfile.save, or damaged)"
    if artifacts.digest(data[:-n] + _DIGEST_PLACEHOLDER) != data[-n:].decode("ascii", "replace"):
        return "contents changed since it was written (checksum mismatch)"
    return None
