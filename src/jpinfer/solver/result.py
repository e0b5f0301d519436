"""The placement result and its versioned on-disk form (placement.json + placement.npz)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jpinfer.errors import JpinferError

FORMAT_VERSION = 1
JSON_NAME = "placement.json"
NPZ_NAME = "placement.npz"


class PlacementVersionError(JpinferError):
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
        """Write placement.json (scalars, version) and placement.npz (ids, per-layer arrays)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "format_version": FORMAT_VERSION,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("accel_ids", "cpu_ids", "layer_times", "min_neurons")
            },
        }
        meta["cpu_dense"] = list(self.cpu_dense)
        (directory / JSON_NAME).write_text(json.dumps(meta, indent=1, allow_nan=False))
        np.savez(
            directory / NPZ_NAME,
            accel_ids=np.concatenate(self.accel_ids),
            accel_counts=np.array([a.size for a in self.accel_ids], np.int64),
            cpu_ids=np.concatenate(self.cpu_ids),
            cpu_counts=np.array([c.size for c in self.cpu_ids], np.int64),
            layer_times=self.layer_times,
            min_neurons=self.min_neurons,
        )
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Placement":
        """Read what ``save`` wrote; another format version is a PlacementVersionError."""
        directory = Path(directory)
        meta_path = directory / JSON_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"no placement in {directory}: {JSON_NAME} is missing")
        meta = json.loads(meta_path.read_text())
        version = meta.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise PlacementVersionError(
                f"placement in {directory} has format version {version}, but this jpinfer reads "
                f"version {FORMAT_VERSION}; solve the placement again"
            )
        with np.load(directory / NPZ_NAME, allow_pickle=False) as arrays:
            accel = np.split(arrays["accel_ids"], np.cumsum(arrays["accel_counts"])[:-1])
            cpu = np.split(arrays["cpu_ids"], np.cumsum(arrays["cpu_counts"])[:-1])
            return cls(
                accel_ids=tuple(a.astype(np.int32) for a in accel),
                cpu_ids=tuple(c.astype(np.int32) for c in cpu),
                layer_times=arrays["layer_times"],
                min_neurons=arrays["min_neurons"],
                **(meta | {"cpu_dense": tuple(meta["cpu_dense"])}),
            )
