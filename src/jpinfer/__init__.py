"""jpinfer: activation-sparse LLM inference in JAX.

Public API: ``load`` a model into an ``Engine``, ``generate`` text, configure with
``GenerationConfig``, ``profile`` neuron activity into an ``ActivationProfile``,
``train_predictors`` from its samples into ``Predictors``. See README.md.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from jpinfer.config import ModelConfig
from jpinfer.errors import ArtifactError, CacheError, CheckpointError, JpinferError
from jpinfer.models.loading import LoadedModel, load_model
from jpinfer.profiler import ActivationProfile, profile
from jpinfer.runtime.engine import Engine, FfnStrategy, GenerationConfig, GenerationResult

__all__ = [
    "load", "load_model", "generate", "Engine", "FfnStrategy", "GenerationConfig", "GenerationResult", "ModelConfig",
    "LoadedModel", "JpinferError", "CheckpointError", "ArtifactError", "CacheError", "profile", "ActivationProfile",
    "train_predictors", "Predictors",
]
__version__ = "0.1.0"

_engines: dict[str, Engine] = {}
_LAZY = {"train_predictors", "Predictors"}  # from jpinfer.predictor: Flax and optax load only when used


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from jpinfer import predictor

        return getattr(predictor, name)
    raise AttributeError(f"module 'jpinfer' has no attribute {name!r}")


def load(source: str | pathlib.Path | None = None, *, dtype: Any = "float32", ffn_kind: str | None = None) -> Engine:
    """Load a checkpoint (HF directory, .gguf file, or None for the default model) as a dense Engine."""
    return Engine(load_model(source, dtype=dtype, ffn_kind=ffn_kind))


def generate(
    prompt: str | Sequence[int] | Sequence[str],
    model: str | pathlib.Path | Engine | None = None,
    **kwargs: Any,
) -> GenerationResult | list[GenerationResult]:
    """Generate text. ``model`` is an Engine, a checkpoint path, or None for the default model
    (loaded once and reused). Keyword arguments are GenerationConfig fields."""
    config = GenerationConfig(**kwargs)
    if isinstance(model, Engine):
        engine = model
    else:
        key = str(model)
        if key not in _engines:
            _engines[key] = load(model)
        engine = _engines[key]
    return engine.generate(prompt, config)
