"""ActivationProfile: what the profiler measured, and its versioned file format.

Everything here has a fixed size for a given model (counts per neuron, a histogram of
active neurons per token, one threshold per layer), whatever the corpus length.
A profile remembers a fingerprint of the model's weights; loading it for another model
is a ``ProfileMismatchError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.errors import JpinferError
from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.models.params import Weights

FORMAT = "jpinfer-activation-profile"
VERSION = 2  # 2: fingerprints of the fused (out, in) weight layout


class ProfileError(JpinferError):
    """A profile file that cannot be read (wrong format, version, or damaged)."""


class ProfileMismatchError(ProfileError):
    """A profile made for a different model than the one given."""


def model_fingerprint(cfg: ModelConfig, weights: Weights) -> str:
    """Hex digest of the architecture and the weights rounded to bfloat16.

    Rounding makes the fingerprint the same whether the model was loaded in float32 or
    bfloat16, so a profile made at one precision serves the other.
    """
    h = hashlib.blake2b(digest_size=16)
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"}
    h.update(json.dumps(arch, sort_keys=True, default=list).encode())
    for leaf in jax.tree_util.tree_leaves(weights):
        h.update(str(leaf.shape).encode())
        h.update(np.asarray(jnp.asarray(leaf).astype(jnp.bfloat16)).view(np.uint16).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class ActivationProfile:
    """Per-layer neuron activity of a model over a corpus.

    ``counts[l, i]``: tokens on which neuron i of layer l was active; ``n_tokens``: tokens
    seen; ``active_hist[l, k]``: tokens on which exactly k neurons of layer l were active;
    ``thresholds[l]``: a neuron is active when its score exceeds it (0 for ReLU kinds,
    where active means non-zero). ``meta`` records the corpus, score, calibration and the
    directory of predictor samples (if any).
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
        """Write one .npz file (arrays plus JSON metadata); returns its path."""
        path = pathlib.Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "version": VERSION, "model_name": self.model_name,
                  "model_fingerprint": self.model_fingerprint, "ffn_kind": self.ffn_kind,
                  "n_tokens": int(self.n_tokens), "meta": self.meta}
        np.savez(path, counts=self.counts, active_hist=self.active_hist, thresholds=self.thresholds,
                 header=np.array(json.dumps(header)))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelArg = None) -> "ActivationProfile":
        """Read a profile; with ``model`` (an Engine, a LoadedModel or a checkpoint path),
        check that the profile was made for it."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file")
        try:
            with np.load(path, allow_pickle=False) as f:
                header = json.loads(str(f["header"]))
                arrays = {k: f[k] for k in ("counts", "active_hist", "thresholds")}
        except (OSError, ValueError, KeyError) as e:
            raise ProfileError(f"{path}: not a jpinfer activation profile ({e})") from None
        if header.get("format") != FORMAT:
            raise ProfileError(f"{path}: not a jpinfer activation profile")
        if header.get("version") != VERSION:
            raise ProfileError(
                f"{path}: profile format version {header.get('version')}, this jpinfer reads {VERSION}: profile again"
            )
        profile = cls(header["model_name"], header["model_fingerprint"], header["ffn_kind"], arrays["counts"],
                      header["n_tokens"], arrays["active_hist"], arrays["thresholds"], header["meta"])
        if model is not None:
            profile.check_model(model)
        return profile

    def check_model(self, model: ModelArg) -> None:
        """Raise ProfileMismatchError unless this profile was made for ``model``."""
        model = resolve_model(model)
        fingerprint = model_fingerprint(model.cfg, model.weights)
        if fingerprint != self.model_fingerprint:
            raise ProfileMismatchError(
                f"this profile was made for model {self.model_name!r} (fingerprint {self.model_fingerprint[:12]}), "
                f"not for {model.cfg.name!r} (fingerprint {fingerprint[:12]}): profile this model first"
            )
