"""The cache directory: $JPINFER_CACHE, default ~/.cache/jpinfer. Nothing cached lives in the repo."""

from __future__ import annotations

import os
import pathlib

from jpinfer.errors import CacheError


class CacheWarning(UserWarning):
    """Something in the cache was wrong and jpinfer worked around it (a damaged entry rebuilt, an
    unwritable cache bypassed): the run goes on with correct results, only slower."""


def cache_root() -> pathlib.Path:
    """$JPINFER_CACHE, default ~/.cache/jpinfer (not created here)."""
    return pathlib.Path(os.environ.get("JPINFER_CACHE") or pathlib.Path.home() / ".cache" / "jpinfer").expanduser()


def cache_dir(*parts: str) -> pathlib.Path:
    """A directory under the cache root (created on demand); a CacheError when it cannot be."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CacheError(
            f"cannot create the cache directory {path} ({err.strerror or err}): "
            "set JPINFER_CACHE to a writable directory"
        ) from None
    return path
