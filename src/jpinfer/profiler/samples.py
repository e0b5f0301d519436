"""Predictor training samples: (layer FFN input, active mask) pairs on disk.

A uniform random sample of ``n`` corpus tokens, fixed before the pass, so the sample is
bounded and each batch knows which of its tokens to keep (a static-shape gather in the
jitted pass). Per layer and sampled token: the normalised FFN input as float16 and the
active mask bit-packed (``np.packbits``, big-endian bit order). Stored as ``.npy`` files
under ``$JPINFER_CACHE/samples/`` (default ``~/.cache/jpinfer``), readable memory-mapped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any

import numpy as np

META = "meta.json"


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """Which tokens of each batch to keep: ``local[b, :count[b]]`` are flat (B*T) indices."""

    local: np.ndarray  # (n_batches, per_batch) int32, padded with 0
    count: np.ndarray  # (n_batches,)

    @property
    def total(self) -> int:
        return int(self.count.sum())


def plan(n_samples: int, n_windows: int, window: int, batch_size: int, seed: int | None) -> SamplePlan:
    """Choose min(n_samples, tokens) tokens uniformly without replacement, grouped by batch."""
    if not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an integer >= 1, got {n_samples!r}")
    batch_size = min(batch_size, n_windows)
    total = n_windows * window
    chosen = np.sort(np.random.default_rng(seed).choice(total, min(n_samples, total), replace=False))
    per = batch_size * window
    n_batches = -(-n_windows // batch_size)
    batch_of = chosen // per
    count = np.bincount(batch_of, minlength=n_batches)
    local = np.zeros((n_batches, max(int(count.max()), 1)), np.int32)
    for b in range(n_batches):
        rows = chosen[batch_of == b] - b * per
        local[b, : len(rows)] = rows
    return SamplePlan(local, count)


class SampleWriter:
    """Fills preallocated memory-mapped arrays batch by batch; ``close`` writes the metadata."""

    def __init__(self, directory: pathlib.Path, n_layers: int, n: int, d_model: int, d_ff: int, meta: dict[str, Any]):
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        self.directory, self.meta, self.filled = directory, meta | {"d_ff": d_ff}, 0
        fmt = np.lib.format
        self.inputs = fmt.open_memmap(directory / "inputs.npy", "w+", np.float16, (n_layers, n, d_model))
        self.masks = fmt.open_memmap(directory / "masks.npy", "w+", np.uint8, (n_layers, n, -(-d_ff // 8)))

    def add(self, inputs: np.ndarray, masks: np.ndarray) -> None:
        """Append (n_layers, m, d_model) inputs and (n_layers, m, d_ff/8) packed masks."""
        m = inputs.shape[1]
        self.inputs[:, self.filled : self.filled + m] = inputs
        self.masks[:, self.filled : self.filled + m] = masks
        self.filled += m

    def close(self) -> pathlib.Path:
        if self.filled != self.inputs.shape[1]:
            raise RuntimeError(f"sample writer got {self.filled} of {self.inputs.shape[1]} samples")
        self.inputs.flush()
        self.masks.flush()
        (self.directory / META).write_text(json.dumps(self.meta | {"n_samples": self.filled}, indent=1))
        return self.directory


@dataclasses.dataclass
class PredictorSamples:
    """Samples written by a profile: ``inputs`` (n_layers, n, d_model) float16 and bit-packed
    ``masks`` (n_layers, n, ceil(d_ff/8)) uint8, both memory-mapped."""

    directory: pathlib.Path
    inputs: np.ndarray
    masks: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "PredictorSamples":
        directory = pathlib.Path(directory)
        if not (directory / META).is_file():
            raise ValueError(f"{directory}: no complete predictor samples there (missing {META}); profile again")
        meta = json.loads((directory / META).read_text())
        inputs = np.load(directory / "inputs.npy", mmap_mode="r")
        masks = np.load(directory / "masks.npy", mmap_mode="r")
        return cls(directory, inputs, masks, meta)

    def __len__(self) -> int:
        return self.inputs.shape[1]

    @property
    def d_ff(self) -> int:
        return int(self.meta["d_ff"])

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer inputs (n, d_model) float32 and active masks (n, d_ff) bool."""
        active = np.unpackbits(np.asarray(self.masks[layer]), axis=-1, count=self.d_ff).astype(bool)
        return np.asarray(self.inputs[layer], np.float32), active
