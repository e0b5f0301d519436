"""jpinfer: activation-sparse LLM inference in JAX.

Public API: ``load`` a model into an ``Engine``, ``generate`` text, configure with
``GenerationConfig``, ``profile`` neuron activity into an ``ActivationProfile``,
``train_predictors`` from its samples into ``Predictors``. See README.md.
"""

from __future__ import annotations

from typing import Any

from jpinfer.api import generate, load
from jpinfer.config import ModelConfig
from jpinfer.errors import ArtifactError, CacheError, CheckpointError, JpinferError
from jpinfer.models.loading import LoadedModel, load_model
from jpinfer.profiler import ActivationProfile, ProfileSettings, SparsityTargets, profile
from jpinfer.runtime.engine import Engine, FfnStrategy
from jpinfer.runtime.generation import GenerationConfig, GenerationResult

__all__ = [
    "load", "load_model", "generate", "Engine", "FfnStrategy", "GenerationConfig", "GenerationResult", "ModelConfig",
    "LoadedModel", "JpinferError", "CheckpointError", "ArtifactError", "CacheError", "profile", "ProfileSettings",
    "SparsityTargets", "ActivationProfile", "train_predictors", "Predictors", "prepare",
]
__version__ = "0.1.0"

_LAZY = {"train_predictors": "predictor", "Predictors": "predictor", "prepare": "pack"}  # Flax loads only when used


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"jpinfer.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jpinfer' has no attribute {name!r}")

