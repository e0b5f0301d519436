"""Predictor training samples: (layer FFN input, active mask) pairs on disk.

A uniform random sample of ``n`` corpus tokens, fixed before the pass, so the sample is
bounded and each batch knows which of its tokens to keep (a static-shape gather in the
jitted pass). Per layer and sampled token: the normalised FFN input as float16 and the
active mask bit-packed (``np.packbits``, big-endian bit order). Stored as ``.npy`` files
under ``$JPINFER_CACHE/samples/`` (default ``~/.cache/jpinfer``), readable memory-mapped.

A profile points to its samples, which cannot be remade without its corpus, so damaged
samples are a ``SamplesError`` (profile again), never silently rebuilt. What is verified:
``meta.json`` (format, version, its own checksum), both files' sizes and ``.npy`` headers on
every open, and each layer's digest (recorded while writing) the first time that layer is
read. Checking every digest on open would read gigabytes (a 7B model's 65536 samples are
20 GB) just to open them; checking a layer when it is read adds one hashing pass to a read
that training follows with minutes of work on that layer.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

from jpinfer import artifacts
from jpinfer.errors import ArtifactError, CacheError

FORMAT = "jpinfer-predictor-samples"
VERSION = 1  # layer digests are artifacts.DIGEST: another digest is another version
META = "meta.json"
FILES = {"inputs": "inputs.npy", "masks": "masks.npy"}


class SamplesError(ArtifactError):
    """Predictor samples that cannot be used: missing, damaged, of another format version, or
    not the ones their profile was made with; the message says to profile again."""


SAMPLES_REMAKE = ("profile again with n_samples > 0 (jpinfer.profile(model, settings=jpinfer.ProfileSettings("
                  "n_samples=65536)), or jpinfer profile --samples 65536) and use the new profile")


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
    """Fills preallocated memory-mapped arrays batch by batch, hashing each layer's rows as they
    come; ``close`` writes the metadata and moves the finished directory into place, ``abort``
    removes what was written. The files are allocated on disk up front, so a disk too small
    for them is a ``CacheError`` at the start, not a crash (SIGBUS) halfway through the pass."""

    def __init__(self, directory: pathlib.Path, n_layers: int, n: int, d_model: int, d_ff: int, meta: dict[str, Any]):
        self.directory, self.filled, self.tmp = directory, 0, None
        self.meta = meta | {"n_layers": n_layers, "d_model": d_model, "d_ff": d_ff}
        self.hashes = {name: [artifacts.hasher() for _ in range(n_layers)] for name in FILES}
        try:
            self.tmp = artifacts.temp_path(directory, directory=True)
            self.inputs = _allocate(self.tmp / FILES["inputs"], np.float16, (n_layers, n, d_model))
            self.masks = _allocate(self.tmp / FILES["masks"], np.uint8, (n_layers, n, -(-d_ff // 8)))
        except OSError as err:
            self.abort()
            raise _write_error(directory, err) from None

    def add(self, inputs: np.ndarray, masks: np.ndarray) -> None:
        """Append (n_layers, m, d_model) inputs and (n_layers, m, d_ff/8) packed masks."""
        inputs, masks = np.asarray(inputs, np.float16), np.asarray(masks, np.uint8)
        m = inputs.shape[1]
        self.inputs[:, self.filled : self.filled + m] = inputs
        self.masks[:, self.filled : self.filled + m] = masks
        self.filled += m
        for layer in range(inputs.shape[0]):  # rows arrive in file order: the digest of each layer's block
            self.hashes["inputs"][layer].update(np.ascontiguousarray(inputs[layer]))
            self.hashes["masks"][layer].update(np.ascontiguousarray(masks[layer]))

    def close(self) -> pathlib.Path:
        """Write the metadata and publish the directory; returns its final path."""
        if self.filled != self.inputs.shape[1]:
            raise RuntimeError(f"sample writer got {self.filled} of {self.inputs.shape[1]} samples")
        try:
            self.inputs.flush()
            self.masks.flush()
            del self.inputs, self.masks
            meta = self.meta | {
                "format": FORMAT, "version": VERSION, "n_samples": self.filled,
                "files": {name: artifacts.file_record(self.tmp / name, checksum=False) for name in FILES.values()},
                "layer_digests": {name: [h.hexdigest() for h in hs] for name, hs in self.hashes.items()},
            }
            (self.tmp / META).write_text(artifacts.json_with_checksum(meta))
            artifacts.publish(self.tmp, self.directory)
        except OSError as err:
            self.abort()
            raise _write_error(self.directory, err) from None
        return self.directory

    def abort(self) -> None:
        """Remove the unfinished samples (an interrupted or failed profile)."""
        if self.tmp is not None:
            artifacts.remove(self.tmp)


def _allocate(path: pathlib.Path, dtype: type, shape: tuple[int, ...]) -> np.memmap:
    """A zero-filled memory-mapped .npy file whose blocks are reserved on disk now."""
    array = np.lib.format.open_memmap(path, "w+", dtype, shape)
    if hasattr(os, "posix_fallocate"):  # not on macOS: there a full disk shows up at the first write
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    return array


def _write_error(directory: pathlib.Path, err: OSError) -> CacheError:
    return CacheError(f"cannot write predictor samples to {directory} ({err.strerror or err}): free space there "
                      "or set JPINFER_CACHE to a directory with room for them")


@dataclasses.dataclass
class PredictorSamples:
    """Samples written by a profile: ``inputs`` (n_layers, n, d_model) float16 and bit-packed
    ``masks`` (n_layers, n, ceil(d_ff/8)) uint8, both memory-mapped. Read them through
    ``arrays`` or ``layer``, which check each layer's digest on its first read."""

    directory: pathlib.Path
    inputs: np.ndarray
    masks: np.ndarray
    meta: dict[str, Any]
    verified: set[int] = dataclasses.field(default_factory=set, repr=False)  # layers whose digests were checked

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "PredictorSamples":
        """Open and check (metadata, sizes, headers, shapes) a sample directory; a SamplesError says what is wrong."""
        directory = pathlib.Path(directory)
        meta_path = directory / META
        try:
            meta = artifacts.read_json(meta_path)
            if meta.get("format") != FORMAT:
                raise artifacts.Damaged(meta_path, "not the metadata of this jpinfer's predictor samples")
            if meta.get("version") != VERSION:
                raise artifacts.Damaged(meta_path, f"predictor samples format version {meta.get('version')}, "
                                                   f"this jpinfer reads {VERSION}")
            artifacts.check_json_checksum(meta_path, meta)
            artifacts.check_files(directory, meta["files"])
            arrays = {}
            for name, file in FILES.items():
                try:
                    arrays[name] = np.load(directory / file, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as err:
                    raise artifacts.Damaged(directory / file, f"not a readable .npy file ({err})") from None
        except artifacts.Damaged as damage:
            raise SamplesError(f"{damage}: {SAMPLES_REMAKE}") from None
        expected = {
            "inputs": (np.float16, (meta["n_layers"], meta["n_samples"], meta["d_model"])),
            "masks": (np.uint8, (meta["n_layers"], meta["n_samples"], -(-meta["d_ff"] // 8))),
        }
        for name, (dtype, shape) in expected.items():
            if arrays[name].dtype != dtype or arrays[name].shape != shape:
                raise SamplesError(f"{directory / FILES[name]}: holds {arrays[name].dtype} {arrays[name].shape}, "
                                   f"meta.json says {np.dtype(dtype)} {shape}: {SAMPLES_REMAKE}")
        return cls(directory, arrays["inputs"], arrays["masks"], meta)

    def __len__(self) -> int:
        return self.inputs.shape[1]

    @property
    def d_ff(self) -> int:
        return int(self.meta["d_ff"])

    def arrays(self, layer: int, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """In-memory copies of layer ``layer``'s first ``count`` (default all) inputs (count, d_model)
        float16 and packed masks (count, ceil(d_ff/8)); the whole layer is checked against its
        recorded digest on its first read (a SamplesError if it changed)."""
        if layer not in self.verified:
            for name, array in (("inputs", self.inputs), ("masks", self.masks)):
                h = artifacts.hasher()
                h.update(array[layer])
                if h.hexdigest() != self.meta["layer_digests"][name][layer]:
                    raise SamplesError(f"{self.directory / FILES[name]}: layer {layer} changed since it was written "
                                       f"(checksum mismatch): {SAMPLES_REMAKE}")
            self.verified.add(layer)
        return np.array(self.inputs[layer, :count]), np.array(self.masks[layer, :count])

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer inputs (n, d_model) float32 and active masks (n, d_ff) bool."""
        inputs, masks = self.arrays(layer)
        return inputs.astype(np.float32), np.unpackbits(masks, axis=-1, count=self.d_ff).astype(bool)
