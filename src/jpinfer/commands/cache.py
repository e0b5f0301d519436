"""``jpinfer cache``: what is in the cache directory ($JPINFER_CACHE, default ~/.cache/jpinfer), and
``jpinfer cache prune``: remove what no current key can reach.

Every cache entry is keyed by what it was made from (a file's path, size and modification time, a
format version), so a reinstalled model package or a new jpinfer leaves the old entries behind, never
read again: a development machine held ten such 517 MiB GGUF conversions (2026-12-02). Pruning removes
exactly those: entries of another format version, conversions whose source file changed or is gone, and
temporaries a killed writer left (unchanged for a day). It never touches what a current key may still
reach, nor XLA's compilation cache (jax manages its own). Dry run unless ``--yes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pathlib
from typing import Callable

from jpinfer import artifacts
from jpinfer.cache import cache_root

# area (a directory under the cache root) -> (what it holds, the "module:function" that tells why an entry is
# unreachable, or None when nothing there is pruned); the modules are imported only when their area is listed
AREAS: dict[str, tuple[str, str | None]] = {
    "gguf": ("GGUF checkpoints dequantized to float32, one per source file",
             "jpinfer.models.loading:gguf_cache_entry_problem"),
    "packs": ("prepared packs (profile, thresholds, predictors, placement), one per model and weights format",
              "jpinfer.pack.store:pack_problem"),
    "predictors": ("predictors trained without --out", None),
    "samples": ("the profiler's predictor training samples", None),
    "int8": ("SmoothQuant channel peaks of int8 models", None),
    "peers": ("llama.cpp peer files for the bench (float32 copies, llama.cpp's quantizations)",
              "jpinfer.bench.llama_cpp:peer_file_problem"),
    "bench": ("benchmark intermediates (profiles, predictors)", None),
    "xla": ("XLA's compiled programs (jax's own cache, not pruned)", None),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the cache: a file or directory directly under an area (or the root)."""

    path: pathlib.Path
    area: str
    size: int
    problem: str | None  # why nothing can reach it (None: current, or not checkable)

    @property
    def prunable(self) -> bool:
        return self.problem is not None


def _size(path: pathlib.Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum((pathlib.Path(root) / name).lstat().st_size for root, _, files in os.walk(path) for name in files)


def inventory(root: pathlib.Path | None = None) -> list[Entry]:
    """Every entry under the cache root, area by area (unknown directories and files at the root too)."""
    root = cache_root() if root is None else root
    if not root.is_dir():
        return []
    entries = []
    for area_dir in sorted(root.iterdir()):
        if area_dir.name not in AREAS or not area_dir.is_dir():
            problem = "a temporary left by a killed writer" if area_dir in artifacts.stale_temps(root) else None
            entries.append(Entry(area_dir, "", _size(area_dir), problem))
            continue
        check = _checker(AREAS[area_dir.name][1])
        stale = set(artifacts.stale_temps(area_dir))
        for path in sorted(area_dir.iterdir()):
            if path in stale:
                problem = "a temporary left by a killed writer"
            elif artifacts.is_temp(path.name) or check is None:
                problem = None  # a temporary still being written, or an area whose keys cannot be checked here
            else:
                problem = check(path)
            entries.append(Entry(path, area_dir.name, _size(path), problem))
    return entries


def _checker(name: str | None) -> Callable[[pathlib.Path], str | None] | None:
    if name is None:
        return None
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("action", nargs="?", choices=("list", "prune"), default="list",
                   help="list (default): every entry with its size and state; prune: remove the entries no current "
                        "key reaches (a dry run unless --yes)")
    p.add_argument("--yes", action="store_true", help="prune: remove them (default: only say what would go)")
    p.add_argument("--dry-run", action="store_true", help="prune: only say what would go (the default)")
    p.add_argument("--all", action="store_true", help="list: every entry of every area (default: areas of many "
                                                      "small entries, like xla, as one line)")


def run(args: argparse.Namespace) -> int:
    if args.yes and args.dry_run:
        raise ValueError("give --yes or --dry-run, not both")
    root = cache_root()
    entries = inventory(root)
    if args.action == "prune":
        return _prune(root, entries, remove=args.yes)
    total = sum(e.size for e in entries)
    print(f"{root}: {_megabytes(total)} in {len(entries)} entries")
    for area in [*AREAS, ""]:
        mine = [e for e in entries if e.area == area]
        if not mine:
            continue
        purpose = AREAS[area][0] if area else "not made by jpinfer (left alone by prune unless a stale temporary)"
        print(f"\n{area or '(root)'}/  {_megabytes(sum(e.size for e in mine))} in {len(mine)}: {purpose}")
        if len(mine) > 20 and not args.all:
            stale = sum(e.prunable for e in mine)
            print(f"  ({len(mine)} entries{f', {stale} unreachable' if stale else ''}; --all lists them)")
            continue
        for e in mine:
            state = f"unreachable: {e.problem}" if e.prunable else "kept"
            print(f"  {e.path.name:40s} {_megabytes(e.size):>12s}  {state}")
    unreachable = [e for e in entries if e.prunable]
    if unreachable:
        print(f"\n{len(unreachable)} unreachable entries, {_megabytes(sum(e.size for e in unreachable))}: "
              "jpinfer cache prune --yes removes them")
    return 0


def _prune(root: pathlib.Path, entries: list[Entry], *, remove: bool) -> int:
    doomed = [e for e in entries if e.prunable]
    verb = "removed" if remove else "would remove"
    for e in doomed:
        if remove:
            artifacts.remove(e.path)
        print(f"{verb} {e.path.relative_to(root)} ({_megabytes(e.size)}): {e.problem}")
    freed = _megabytes(sum(e.size for e in doomed))
    if not doomed:
        print(f"{root}: nothing to prune")
    elif remove:
        print(f"freed {freed}")
    else:
        print(f"{freed} in {len(doomed)} entries; run jpinfer cache prune --yes to remove them")
    return 0
