"""The pack a model gets when none is named: its default pack in the cache, prepared on first use."""

from __future__ import annotations

import os

from jpinfer.models.loading import ModelArg, resolve_model
from jpinfer.pack.settings import PackSettings
from jpinfer.pack.stages import prepare
from jpinfer.pack.store import Pack


def default_pack(model: ModelArg = None, progress: bool = True) -> Pack:
    """The pack of ``model`` (default: the default model) with the default ``PackSettings``, in the
    cache directory: one per model fingerprint, so one per weights format (an int8 or int4 model's is
    made from the quantized model: its own activity, thresholds, predictors and placement); prepared on
    first use (the default model's float pack in about five minutes on two CPU cores), then verified and
    reused."""
    return prepare(model, None, PackSettings(), progress=progress)


def pack_for(model: ModelArg = None, path: str | os.PathLike | None = None) -> Pack:
    """The pack at ``path``, checked to be ``model``'s (None: the default model), or (``path`` None) the
    model's default pack."""
    loaded = resolve_model(model)
    return default_pack(loaded) if path is None else Pack.load(path, loaded)
