"""The placement result and its versioned on-disk form (placement.json + placement.npz)."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import numpy as np

from jpinfer import artifacts
from jpinfer.config import ModelConfig
from jpinfer.errors import ArtifactError

FORMAT_VERSION = 2  # 2: placement.json records placement.npz's size and digest, and its own checksum
JSON_NAME = "placement.json"
NPZ_NAME = "placement.npz"
REMAKE = "solve the placement again (jpinfer place --save DIR, or solve_placement(...).save(DIR))"


class PlacementError(ArtifactError):
    """A saved placement that cannot be used: missing, damaged, unwritable, or for a model of
    another shape; the message names the directory and says to solve again."""


class PlacementVersionError(PlacementError):
    """A saved placement written by an incompatible format version."""


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Which FFN neurons of each layer live on the accelerator, and what that predicts.

    accel_ids / cpu_ids: per layer, sorted int32 neuron ids; together they cover every
    neuron of the layer exactly once. accel_share: fraction of the expected activation
    mass on the accelerator. per_token_time: predicted seconds per decode step (batch 1),
    layer_times: its FFN part per layer. min_neurons: the communication minimum C_l.
    cpu_dense: dense tables the memory policy moved to the CPU. status / objective_value
    / gap / solve_time describe the solve ("heuristic" and None for the baselines).
    """

    accel_ids: tuple[np.ndarray, ...]
    cpu_ids: tuple[np.ndarray, ...]
    accel_share: float
    per_token_time: float
    layer_times: np.ndarray
    min_neurons: np.ndarray
    dense_accel_bytes: int
    ffn_accel_bytes: int
    budget_bytes: int
    cpu_dense: tuple[str, ...]
    method: str
    objective: str | None
    status: str
    objective_value: float | None
    gap: float | None
    solve_time: float
    group_size: int | None
    hardware: dict

    @classmethod
    def from_masks(cls, masks: list[np.ndarray], **fields) -> "Placement":
        """Build from per-layer boolean masks over neuron ids (True = accelerator)."""
        return cls(
            accel_ids=tuple(np.flatnonzero(m).astype(np.int32) for m in masks),
            cpu_ids=tuple(np.flatnonzero(~m).astype(np.int32) for m in masks),
            **fields,
        )

    @property
    def n_layers(self) -> int:
        return len(self.accel_ids)

    @property
    def memory_used(self) -> int:
        """Accelerator bytes: the dense part plus the placed neurons."""
        return self.dense_accel_bytes + self.ffn_accel_bytes

    def masks(self) -> list[np.ndarray]:
        """Per layer boolean mask over neuron ids (True = accelerator)."""
        out = []
        for acc, cpu in zip(self.accel_ids, self.cpu_ids):
            mask = np.zeros(acc.size + cpu.size, bool)
            mask[acc] = True
            out.append(mask)
        return out

    def below_min_layers(self) -> list[int]:
        """Layers split with fewer accelerator neurons than C_l (the baselines may do this)."""
        return [
            layer
            for layer, acc in enumerate(self.accel_ids)
            if 0 < acc.size < self.min_neurons[layer]
        ]

    def summary(self) -> dict:
        """Scalars for printing and reports."""
        return {
            "method": self.method,
            "objective": self.objective,
            "status": self.status,
            "accel_share": self.accel_share,
            "per_token_time_ms": 1e3 * self.per_token_time,
            "accel_neurons": int(sum(a.size for a in self.accel_ids)),
            "layers_split": sum(1 for a, c in zip(self.accel_ids, self.cpu_ids) if a.size and c.size),
            "layers_below_min": len(self.below_min_layers()),
            "min_neurons_range": [int(self.min_neurons.min()), int(self.min_neurons.max())],
            "memory_used_gib": self.memory_used / 2**30,
            "budget_gib": self.budget_bytes / 2**30,
            "cpu_dense": list(self.cpu_dense),
            "gap": self.gap,
            "solve_time_s": self.solve_time,
        }

    def save(self, directory: str | Path) -> Path:
        """Write placement.npz (ids, per-layer arrays) and placement.json (scalars, format
        version, the size and digest of placement.npz), both to temporary names, then rename
        them into place, the JSON last: a failed or interrupted save leaves the older placement
        there, or (cut between the two renames) a pair ``load`` refuses as mismatched, never a
        wrong one."""
        directory = Path(directory)
        meta = {
            "format_version": FORMAT_VERSION,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("accel_ids", "cpu_ids", "layer_times", "min_neurons")
            },
        }
        meta["cpu_dense"] = list(self.cpu_dense)
        try:  # both written before either is renamed (the inner block's first): a full disk keeps the old pair
            with artifacts.atomic_write(directory / JSON_NAME) as json_tmp, \
                    artifacts.atomic_write(directory / NPZ_NAME) as npz_tmp:
                with open(npz_tmp, "wb") as f:
                    np.savez(
                        f,
                        accel_ids=np.concatenate(self.accel_ids),
                        accel_counts=np.array([a.size for a in self.accel_ids], np.int64),
                        cpu_ids=np.concatenate(self.cpu_ids),
                        cpu_counts=np.array([c.size for c in self.cpu_ids], np.int64),
                        layer_times=self.layer_times,
                        min_neurons=self.min_neurons,
                    )
                meta["files"] = {NPZ_NAME: artifacts.file_record(npz_tmp)}
                json_tmp.write_text(artifacts.json_with_checksum(meta))
        except OSError as e:
            raise PlacementError(f"{directory}: cannot write the placement ({e.strerror or e})") from None
        return directory

    @classmethod
    def load(cls, directory: str | Path, cfg: ModelConfig | None = None) -> "Placement":
        """Read and verify what ``save`` wrote; with ``cfg``, check that the placement is for a
        model of that shape (layers and FFN width: all a placement depends on). A missing,
        damaged or mismatched placement is a PlacementError, another format version a
        PlacementVersionError."""
        directory = Path(directory)
        meta_path = directory / JSON_NAME
        if not meta_path.is_file():
            raise PlacementError(f"no placement in {directory}: {JSON_NAME} is missing: {REMAKE}")
        try:
            meta = artifacts.read_json(meta_path)
            version = meta.get("format_version")
            if version != FORMAT_VERSION:
                newer = isinstance(version, int) and version > FORMAT_VERSION
                raise PlacementVersionError(
                    f"placement in {directory} has format version {version}, but this jpinfer reads version "
                    f"{FORMAT_VERSION}{' (it was written by a newer jpinfer)' if newer else ''}: {REMAKE}"
                )
            artifacts.check_json_checksum(meta_path, meta)
            artifacts.check_files(directory, meta["files"])
            placement = cls._from_files(directory, meta)
        except artifacts.Damaged as damage:
            raise PlacementError(f"{damage}: {REMAKE}") from None
        for layer, (acc, cpu) in enumerate(zip(placement.accel_ids, placement.cpu_ids)):
            d_ff = acc.size + cpu.size
            if not np.array_equal(np.sort(np.concatenate([acc, cpu])), np.arange(d_ff)):
                raise PlacementError(
                    f"{directory}: layer {layer}'s ids do not cover its {d_ff} neurons exactly once: {REMAKE}"
                )
        if cfg is not None:
            widths = {acc.size + cpu.size for acc, cpu in zip(placement.accel_ids, placement.cpu_ids)}
            if (placement.n_layers, widths) != (cfg.n_layers, {cfg.d_ff}):
                raise PlacementError(
                    f"{directory}: a placement for {placement.n_layers} layers of {sorted(widths)} neurons, but "
                    f"{cfg.name!r} has {cfg.n_layers} layers of {cfg.d_ff}: solve the placement for this model"
                )
        return placement

    @classmethod
    def _from_files(cls, directory: Path, meta: dict) -> "Placement":
        """The placement from verified files; ``artifacts.Damaged`` if the arrays cannot be read."""
        fields = {k: v for k, v in meta.items() if k not in ("format_version", "files", "checksum")}
        try:
            with np.load(directory / NPZ_NAME, allow_pickle=False) as arrays:
                accel = np.split(arrays["accel_ids"], np.cumsum(arrays["accel_counts"])[:-1])
                cpu = np.split(arrays["cpu_ids"], np.cumsum(arrays["cpu_counts"])[:-1])
                return cls(
                    accel_ids=tuple(a.astype(np.int32) for a in accel),
                    cpu_ids=tuple(c.astype(np.int32) for c in cpu),
                    layer_times=arrays["layer_times"],
                    min_neurons=arrays["min_neurons"],
                    **(fields | {"cpu_dense": tuple(fields["cpu_dense"])}),
                )
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise artifacts.Damaged(directory / NPZ_NAME, f"unreadable ({type(e).__name__}: {e})") from None
