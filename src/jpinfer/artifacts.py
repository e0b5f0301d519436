"""Files jpinfer writes and reads back later: written atomically, verified when read.

Every artifact (the GGUF cache, profiles, predictor samples, placements, predictors)
follows the same rules, implemented once here:

- **Atomic writes.** An artifact is written under a temporary sibling name
  (``.NAME.tmp-XXXX``) and renamed into place (``atomic_write``), so an interrupted or
  failed write never leaves a complete-looking artifact under its real name, and an older
  artifact of that name survives it.
- **Stale temporaries.** A temporary left behind by a killed writer is removed by the next
  write beside it, or the next use of a cache directory (``remove_stale_temps``), once
  nothing in it has changed for ``STALE_SECONDS``; a live writer changes its files far more
  often than that, even across machines sharing a cache.
- **Verification.** What is needed to verify a file is recorded when it is written
  (``file_record``: its size, and a digest where reading the file whole is cheap next to
  using it) and checked when it is read (``check_files``). JSON metadata carries a digest of
  its own content (``json_with_checksum``). A failed check raises ``Damaged`` naming the
  file and the problem; each artifact turns it into its own error (files the user owns) or
  removes and rebuilds the entry (caches).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any, Iterator

import xxhash

from jpinfer.errors import ArtifactError

# xxh3-128: a checksum against damage, not against tampering; faster than copying memory (measured
# in docs/architecture.md, "Caches and artifacts"), so even a multi-GB GGUF cache entry is verified
# on every load.
DIGEST = "xxh3_128"
STALE_SECONDS = 24 * 3600
TEMP_MARK = ".tmp-"
_CHUNK = 1 << 22


class Damaged(ArtifactError):
    """A file of an artifact that failed verification; the message is "PATH: PROBLEM"."""

    def __init__(self, path: os.PathLike | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = pathlib.Path(path), problem


def hasher() -> Any:
    """A fresh ``DIGEST`` hash object (``update(buffer)``, ``hexdigest()``), for data written in pieces."""
    return xxhash.xxh3_128()


def file_digest(path: os.PathLike | str) -> str:
    """``DIGEST`` of a file's bytes, read in 4 MiB pieces (the file is never held in memory whole)."""
    h = hasher()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def file_record(path: os.PathLike | str, checksum: bool = True) -> dict[str, Any]:
    """What ``check_file`` verifies later: the size, and with ``checksum`` the digest."""
    record: dict[str, Any] = {"size": os.stat(path).st_size}
    if checksum:
        record[DIGEST] = file_digest(path)
    return record


def directory_records(directory: os.PathLike | str) -> dict[str, dict[str, Any]]:
    """``file_record`` (with digests) of every file under ``directory``, keyed by relative POSIX path."""
    directory = pathlib.Path(directory)
    return {f.relative_to(directory).as_posix(): file_record(f) for f in sorted(directory.rglob("*")) if f.is_file()}


def check_file(path: os.PathLike | str, record: dict[str, Any]) -> None:
    """Raise ``Damaged`` unless ``path`` has the recorded size (and digest, when one was recorded)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise Damaged(path, "missing")
    size = path.stat().st_size
    if size != record["size"]:
        raise Damaged(path, f"{size} bytes, but {record['size']} were written (truncated, extended or replaced)")
    if DIGEST in record and file_digest(path) != record[DIGEST]:
        raise Damaged(path, "contents changed since it was written (checksum mismatch)")


def check_files(directory: os.PathLike | str, records: dict[str, dict[str, Any]]) -> None:
    """``check_file`` every recorded file under ``directory``."""
    for name, record in records.items():
        check_file(pathlib.Path(directory) / name, record)


def digest(data: bytes | bytearray | memoryview) -> str:
    """``DIGEST`` of bytes in memory (hex)."""
    return xxhash.xxh3_128_hexdigest(data)


def _json_digest(obj: dict[str, Any]) -> str:
    return digest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def json_with_checksum(obj: dict[str, Any]) -> str:
    """``obj`` as indented JSON with a ``checksum`` entry over the rest (see ``check_json_checksum``)."""
    return json.dumps(obj | {"checksum": _json_digest(obj)}, indent=1)


def read_json(path: os.PathLike | str) -> dict[str, Any]:
    """A JSON object from ``path``; ``Damaged`` when it is missing, unreadable or not an object."""
    path = pathlib.Path(path)
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Damaged(path, "missing") from None
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise Damaged(path, f"not readable JSON ({err})") from None
    if not isinstance(obj, dict):
        raise Damaged(path, f"holds a JSON {type(obj).__name__}, not an object")
    return obj


def check_json_checksum(path: os.PathLike | str, obj: dict[str, Any]) -> None:
    """Raise ``Damaged`` unless ``obj`` (read from ``path``) carries the checksum ``json_with_checksum`` wrote.

    Callers check the format and version first, so a file from another version is reported
    as that rather than as damage.
    """
    rest = {k: v for k, v in obj.items() if k != "checksum"}
    if "checksum" not in obj:
        raise Damaged(path, "has no checksum (not written by this version of jpinfer)")
    if obj["checksum"] != _json_digest(rest):
        raise Damaged(path, "contents changed since it was written (checksum mismatch)")


def remove(path: os.PathLike | str) -> None:
    """Remove a file or a directory tree, if there is one (errors ignored: another process may race us)."""
    path = pathlib.Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _newest_mtime(path: str) -> float:
    """The latest modification time of ``path`` or anything under it (0 when it vanished)."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = os.lstat(path).st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def is_temp(name: str) -> bool:
    """Whether a directory entry's name is one of ``temp_path``'s temporaries."""
    return name.startswith(".") and TEMP_MARK in name


def stale_temps(directory: os.PathLike | str, name: str | None = None, max_age: float = STALE_SECONDS
                ) -> list[pathlib.Path]:
    """The temporaries in ``directory`` (of artifact ``name``, or of any artifact) in which nothing
    changed for ``max_age`` seconds: what killed writers left (a live writer touches its temporary)."""
    prefix = "." if name is None else f".{name}{TEMP_MARK}"
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(prefix) and is_temp(e.name)]
    except OSError:  # no directory (yet), or one we cannot list: nothing to clean
        return []
    now = time.time()
    return [pathlib.Path(e.path) for e in entries if now - _newest_mtime(e.path) > max_age]


def remove_stale_temps(directory: os.PathLike | str, name: str | None = None, max_age: float = STALE_SECONDS) -> None:
    """Remove ``stale_temps(directory, name, max_age)``."""
    for path in stale_temps(directory, name, max_age):
        remove(path)


def temp_path(path: os.PathLike | str, directory: bool = False) -> pathlib.Path:
    """A new, empty temporary sibling of ``path`` (a directory or a file) to write the artifact
    into; stale temporaries of the same artifact are removed first."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, path.name)
    prefix = f".{path.name}{TEMP_MARK}"
    if directory:
        return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
    fd, name = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    os.close(fd)
    return pathlib.Path(name)


def publish(tmp: os.PathLike | str, path: os.PathLike | str, replace: bool = True) -> bool:
    """Rename the finished temporary ``tmp`` to ``path``. An existing ``path`` is replaced, or,
    with ``replace=False`` (a cache entry another process finished first: the same content),
    kept and ``tmp`` left for the caller to remove; returns whether ``tmp`` became ``path``.

    A file replaces a file atomically. A directory cannot replace a non-empty directory in one
    rename, so the old one is first renamed aside (to a temporary name) and then removed.
    """
    tmp, path = pathlib.Path(tmp), pathlib.Path(path)
    try:
        os.replace(tmp, path)
        return True
    except OSError:  # path is a non-empty directory, or a directory where tmp is a file
        if not path.exists():  # removed meanwhile: nothing is in the way now
            os.replace(tmp, path)
            return True
        if not replace:
            return False
    aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}{TEMP_MARK}old-", dir=path.parent))
    os.replace(path, aside / path.name)
    os.replace(tmp, path)
    remove(aside)
    return True


@contextlib.contextmanager
def atomic_write(path: os.PathLike | str, directory: bool = False, replace: bool = True) -> Iterator[pathlib.Path]:
    """Yield a temporary sibling of ``path`` to write into; when the block ends normally it is
    published as ``path`` (``publish``), and whatever is left of it is removed in any case."""
    tmp = temp_path(path, directory)
    try:
        yield tmp
        publish(tmp, path, replace)
    finally:
        remove(tmp)
