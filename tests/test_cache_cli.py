"""``jpinfer cache``: listing the cache, and pruning exactly the entries no current key reaches."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from jpinfer import artifacts
from jpinfer.bench import llama_cpp as peer
from jpinfer.cli import main
from jpinfer.models import loading
from jpinfer.pack import store as pack_store

import gguf_fixtures as fx


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache holding what jpinfer keeps (current entries) and what it leaves behind (unreachable ones).
    Returns (root, the GGUF source, the relative paths of the unreachable entries, those of the kept ones)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("JPINFER_CACHE", str(root))
    cfg = fx.tiny_config()
    source = fx.write_gguf(tmp_path / "tiny.gguf", cfg, fx.random_tensors(cfg, seed=3))
    loading.load_model(source)  # gguf entry of the first version of the file: orphaned below
    (orphan,) = (root / "gguf").iterdir()
    fx.write_gguf(source, cfg, fx.random_tensors(cfg, seed=4))
    loading.load_model(source)  # the current entry
    (current,) = set((root / "gguf").iterdir()) - {orphan}
    old = root / "gguf" / ("0" * 24)  # an entry written by an earlier cache version
    shutil.copytree(current, old)
    manifest = json.loads((old / loading.CACHE_MANIFEST).read_text())
    (old / loading.CACHE_MANIFEST).write_text(json.dumps({**manifest, "version": loading.GGUF_CACHE_VERSION - 1}))

    f32 = peer.float32_gguf(source)  # a peer copy with its record: current
    legacy = root / "peers" / "0123456789abcdef.gguf"  # a copy from before the records: nothing names its source
    legacy.write_bytes(b"GGUF")

    packs = root / "packs"
    (packs / "old-model").mkdir(parents=True)
    (packs / "old-model" / "pack.json").write_text(json.dumps({"format": "jpinfer-pack", "version": 1}))  # float only
    (packs / "current").mkdir()  # this format version (2: packs of int8 and int4 models too): kept
    (packs / "current" / "pack.json").write_text(json.dumps({"format": "jpinfer-pack", "version": pack_store.VERSION}))
    (packs / "half-made").mkdir()  # an interrupted prepare: resumable, so kept
    stale = packs / f".model{artifacts.TEMP_MARK}dead"
    stale.mkdir()
    (stale / "profile.npz").write_bytes(b"x")
    day_ago = time.time() - artifacts.STALE_SECONDS - 60
    for path in (stale / "profile.npz", stale):
        os.utime(path, (day_ago, day_ago))
    live = packs / f".model{artifacts.TEMP_MARK}live"  # a writer at work
    live.write_bytes(b"y")
    (root / "xla").mkdir()
    (root / "xla" / "jit_step-abc-cache").write_bytes(b"z" * 10)
    (root / "notes.txt").write_text("mine")

    unreachable = {f"gguf/{orphan.name}", f"gguf/{old.name}", f"peers/{legacy.name}", "packs/old-model",
                   f"packs/{stale.name}"}
    kept = {f"gguf/{current.name}", f"peers/{f32.name}", f"peers/{f32.stem}.json", "packs/current", "packs/half-made",
            f"packs/{live.name}", "xla", "notes.txt"}
    return root, source, unreachable, kept


def _present(root) -> set[str]:
    areas = {"gguf", "peers", "packs"}
    return {str(p.relative_to(root)) for p in root.iterdir() if p.name not in areas} | {
        f"{area}/{p.name}" for area in areas for p in (root / area).iterdir()}


def _named(output: str, prefix: str) -> set[str]:
    return {line.split()[len(prefix.split())] for line in output.splitlines() if line.startswith(prefix)}


def test_prune_is_a_dry_run_by_default_and_names_exactly_the_unreachable_entries(cache, capsys):
    root, _, unreachable, kept = cache
    assert _present(root) == unreachable | kept
    for argv in (["cache", "prune"], ["cache", "prune", "--dry-run"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert _named(out, "would remove") == unreachable
        assert _present(root) == unreachable | kept  # nothing removed
    assert "--yes" in out


def test_prune_yes_removes_exactly_those_and_the_kept_entries_still_serve(cache, capsys, monkeypatch):
    root, source, unreachable, kept = cache
    assert main(["cache", "prune", "--yes"]) == 0
    assert _named(capsys.readouterr().out, "removed") == unreachable
    assert _present(root) == kept
    calls = []
    monkeypatch.setattr("jpinfer.models.gguf_loader.load_gguf", lambda *a, **k: calls.append(a))
    loading.load_model(source)
    assert calls == []  # the current GGUF entry still serves the load
    assert main(["cache", "prune"]) == 0
    assert "nothing to prune" in capsys.readouterr().out


def test_a_changed_source_orphans_its_peer_files(cache):
    root, source, _, _ = cache
    f32 = peer.float32_gguf(source)
    assert peer.peer_file_problem(f32) is None and peer.peer_file_problem(f32.with_suffix(".json")) is None
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert "changed since" in peer.peer_file_problem(f32)
    source.unlink()
    assert "is gone" in peer.peer_file_problem(f32)


def test_list_shows_every_area_with_sizes_and_states(cache, capsys):
    root, _, unreachable, _ = cache
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{root}: ")
    for area in ("gguf/", "peers/", "packs/", "xla/", "(root)/"):
        assert any(line.startswith(area) for line in out.splitlines()), area
    assert out.count("unreachable: ") == len(unreachable)
    assert f"{len(unreachable)} unreachable entries" in out


def test_yes_and_dry_run_together_is_a_usage_error(cache, capsys):
    assert main(["cache", "prune", "--yes", "--dry-run"]) == 2
    assert "not both" in capsys.readouterr().err
