"""The cache directory: $JPINFER_CACHE, default ~/.cache/jpinfer. Nothing cached lives in the repo."""

from __future__ import annotations

import os
import pathlib


def cache_dir(*parts: str) -> pathlib.Path:
    """A directory under the cache root (created on demand)."""
    root = pathlib.Path(os.environ.get("JPINFER_CACHE") or pathlib.Path.home() / ".cache" / "jpinfer")
    path = root.joinpath(*parts).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path
