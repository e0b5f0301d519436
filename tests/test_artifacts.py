"""Fault injection over every kind of file jpinfer writes.

Each artifact kind (the GGUF cache, a profile, predictor samples, a placement, predictors) is
written once, copied per test, damaged, and read back the way a user would. A damaged cache
entry must be reported once (a CacheWarning naming the file), rebuilt, and give the model the
GGUF file holds; a damaged artifact the user owns must raise its own error class naming the
file and how to make it again. Never a raw library exception, never a wrong result. Disks are
filled with RLIMIT_FSIZE (writes past the limit fail with EFBIG, as on a full disk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from jpinfer import artifacts
from jpinfer.cache import CacheWarning
from jpinfer.errors import ArtifactError, CacheError
from jpinfer.models import gguf_loader, loading, params
from jpinfer.predictor import PredictorError, PredictorMismatchError, Predictors, PredictorWeights, profile_fingerprint
from jpinfer.profiler import (
    ActivationProfile,
    ProfileError,
    ProfileMismatchError,
    ProfileSettings,
    SamplesError,
    profile,
)
from jpinfer.solver import Placement, PlacementError, PlacementVersionError

import gguf_fixtures as fx
from profiler_fixtures import tiny_engine

GGUF_SEED = 3
N_SAMPLES = 30
PUBLISH = artifacts.publish


@dataclasses.dataclass
class World:
    """Pristine artifacts, written once per module; tests copy and damage them."""

    root: pathlib.Path
    gguf: pathlib.Path  # the tiny GGUF file every cache entry is made from
    gguf_cfg: object  # its config as the loader reads it
    cache: pathlib.Path  # the cache the world was made in: that file's entry and both sample sets
    engine: object
    profile: ActivationProfile  # with predictor samples
    profile_file: pathlib.Path
    other_samples: pathlib.Path  # another model's samples, same shapes
    placement: Placement
    placement_dir: pathlib.Path
    predictors: Predictors
    predictors_dir: pathlib.Path


def windows(n=6, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, 40, (n, t)).astype(np.int32)


def random_placement(n_layers: int, d_ff: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement.from_masks(
        [rng.random(d_ff) < 0.4 for _ in range(n_layers)], accel_share=0.61, per_token_time=1.5e-3,
        layer_times=rng.random(n_layers) * 1e-4, min_neurons=np.full(n_layers, 4), dense_accel_bytes=1 << 20,
        ffn_accel_bytes=1 << 18, budget_bytes=1 << 22, cpu_dense=("embed",), method="milp", objective="latency",
        status="optimal", objective_value=1.25, gap=1e-3, solve_time=0.5, group_size=8, hardware={"name": "test"},
    )


def random_predictors(engine, prof: ActivationProfile, seed: int) -> Predictors:
    rng = np.random.default_rng(seed)
    cfg = engine.cfg
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    layers = [PredictorWeights(normal(8, cfg.d_model), normal(8), normal(cfg.d_ff, 8), normal(cfg.d_ff), normal())
              for _ in range(cfg.n_layers)]
    meta = {"model_name": cfg.name, "model_fingerprint": prof.model_fingerprint,
            "profile_fingerprint": profile_fingerprint(prof), "recall": 0.99, "n_samples": N_SAMPLES}
    return Predictors(layers, meta)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("world")
    cfg = fx.tiny_config(tied=False)
    gguf = fx.write_gguf(root / "tiny.gguf", cfg, fx.random_tensors(cfg, seed=GGUF_SEED))
    engine = tiny_engine("reglu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JPINFER_CACHE", str(root / "cache"))
        gguf_cfg = loading.load_model(gguf).cfg  # read from the file: the cache was empty
        settings = ProfileSettings(n_samples=N_SAMPLES, batch_size=2)
        prof = profile(engine, windows(), settings, progress=False)
        other = profile(tiny_engine("reglu", seed=7), windows(), settings, progress=False)
    placement = random_placement(engine.cfg.n_layers, engine.cfg.d_ff, seed=0)
    predictors = random_predictors(engine, prof, seed=0)
    return World(root, gguf, gguf_cfg, root / "cache", engine, prof, prof.save(root / "profile.npz"),
                 pathlib.Path(other.meta["samples"]), placement, placement.save(root / "placement"), predictors,
                 predictors.save(root / "predictors"))


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))


def temps_under(directory: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in directory.rglob(f"*{artifacts.TEMP_MARK}*")] if directory.exists() else []


# ----- the artifact kinds: how to get a fresh copy, read it, damage it, and what reading must give

class Kind:
    """One artifact kind; subclasses say where its files are and what reading it must give."""

    name = ""
    error: type[Exception] | None = None  # None: a cache, which heals
    remake = ""  # the message must say how to make it again (a regular expression)

    def __init__(self, world: World, tmp: pathlib.Path):
        self.world, self.tmp = world, tmp

    def make(self) -> pathlib.Path:
        """A fresh copy of the pristine artifact for this test; returns its path."""
        raise NotImplementedError

    def read(self, path: pathlib.Path, foreign: bool = False):
        """Read it as a user would (with ``foreign``, as another model's user would)."""
        raise NotImplementedError

    def check_same(self, value) -> None:
        """Assert that what ``read`` returned is the pristine artifact."""
        raise NotImplementedError

    def data_files(self, path: pathlib.Path) -> list[pathlib.Path]:
        """The files holding the artifact's content: each in turn is truncated, zeroed, flipped."""
        raise NotImplementedError

    def missing_file(self, path: pathlib.Path) -> pathlib.Path:
        return self.data_files(path)[0]

    def meta_file(self, path: pathlib.Path) -> pathlib.Path:
        """The file holding format, version and metadata."""
        raise NotImplementedError

    def set_future_version(self, path: pathlib.Path) -> None:
        edit_json(self.meta_file(path), lambda meta: meta | {"version": meta["version"] + 1})

    def save_other(self, target: pathlib.Path) -> None:
        """Write a different artifact of this kind to ``target`` (for interrupted and failed writes)."""
        raise NotImplementedError

    def temp_home(self, path: pathlib.Path) -> tuple[pathlib.Path, str]:
        """Where writing the artifact at ``path`` puts its temporaries, and the name they are of."""
        return path.parent, path.name


def fresh_copy(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """``target`` as a new copy of ``source`` (a file or a directory), replacing an older copy."""
    artifacts.remove(target)
    if source.is_dir():
        return pathlib.Path(shutil.copytree(source, target))
    return pathlib.Path(shutil.copy(source, target))


def edit_json(path: pathlib.Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def weights_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class GGUFCache(Kind):
    name = "gguf-cache"

    def make(self):
        fresh_copy(self.world.cache, self.tmp / "cache")
        (entry,) = (self.tmp / "cache" / "gguf").iterdir()
        return entry

    def read(self, path, foreign=False):
        return loading.load_model(self.world.gguf)

    def check_same(self, model):
        cfg = fx.tiny_config(tied=False)  # the independent reference: the tensors the GGUF was written from
        assert model.cfg == self.world.gguf_cfg
        assert weights_equal(model.weights, params.build_weights(cfg, fx.random_tensors(cfg, seed=GGUF_SEED)))
        reference = gguf_loader.load_gguf_tokenizer(self.world.gguf)
        text = "The quick brown fox, 12345 <think>"
        assert model.tokenizer.encode(text) == reference.encode(text)
        assert model.tokenizer.chat_template == reference.chat_template

    def data_files(self, path):
        return sorted(f for f in path.rglob("*") if f.is_file() and f.name != loading.CACHE_MANIFEST)

    def missing_file(self, path):
        return path / "tokenizer" / "tokenizer.json"

    def meta_file(self, path):
        return path / loading.CACHE_MANIFEST

    def make_foreign(self, path):
        """Put the entry of another GGUF file (same size and shapes, other weights) under this file's key."""
        cfg = fx.tiny_config(tied=False)
        other = fx.write_gguf(self.tmp / "other.gguf", cfg, fx.random_tensors(cfg, seed=GGUF_SEED + 1))
        loading.load_model(other)
        (other_entry,) = [e for e in path.parent.iterdir() if e != path]
        shutil.rmtree(path)
        other_entry.rename(path)


class Profile(Kind):
    name = "profile"
    error = ProfileError
    remake = "profile again"

    def make(self):
        return fresh_copy(self.world.profile_file, self.tmp / "prof.npz")

    def read(self, path, foreign=False):
        return ActivationProfile.load(path, model=tiny_engine("reglu", seed=7) if foreign else self.world.engine)

    def check_same(self, prof):
        for name in ("counts", "active_hist", "thresholds"):
            np.testing.assert_array_equal(getattr(prof, name), getattr(self.world.profile, name))
        assert (prof.n_tokens, prof.meta) == (self.world.profile.n_tokens, self.world.profile.meta)

    def data_files(self, path):
        return [path]

    def meta_file(self, path):
        return path  # the JSON header is a member of the same zip

    def set_future_version(self, path):
        with np.load(path) as f:
            members = {k: f[k] for k in f.files}
        header = json.loads(str(members["header"]))
        members["header"] = np.array(json.dumps(header | {"version": header["version"] + 1}))
        with open(path, "wb") as f:
            np.savez(f, **members)

    def save_other(self, target):
        dataclasses.replace(self.world.profile, counts=self.world.profile.counts // 2).save(target)


class Samples(Kind):
    name = "samples"
    error = SamplesError
    remake = "profile again with n_samples"

    def make(self):
        return fresh_copy(pathlib.Path(self.world.profile.meta["samples"]), self.tmp / "samples-copy")

    def read(self, path, foreign=False):
        prof = dataclasses.replace(self.world.profile, meta=self.world.profile.meta | {"samples": str(path)})
        samples = prof.samples()
        return [samples.arrays(layer) for layer in range(prof.n_layers)]

    def check_same(self, layers):
        pristine = np.load(pathlib.Path(self.world.profile.meta["samples"]) / "inputs.npy")
        for layer, (inputs, masks) in enumerate(layers):
            np.testing.assert_array_equal(inputs, pristine[layer])
            assert masks.shape == (N_SAMPLES, -(-self.world.engine.cfg.d_ff // 8))

    def data_files(self, path):
        return [path / "inputs.npy", path / "masks.npy"]

    def meta_file(self, path):
        return path / "meta.json"

    def make_foreign(self, path):
        shutil.rmtree(path)
        shutil.copytree(self.world.other_samples, path)


class PlacementKind(Kind):
    name = "placement"
    error = PlacementError
    remake = "solve the placement again"

    def make(self):
        return fresh_copy(self.world.placement_dir, self.tmp / "placement")

    def read(self, path, foreign=False):
        cfg = self.world.engine.cfg
        return Placement.load(path, dataclasses.replace(cfg, d_ff=2 * cfg.d_ff) if foreign else cfg)

    def check_same(self, placement):
        for a, b in zip(placement.masks(), self.world.placement.masks()):
            np.testing.assert_array_equal(a, b)
        assert placement.summary() == self.world.placement.summary()

    def data_files(self, path):
        return [path / "placement.npz"]

    def meta_file(self, path):
        return path / "placement.json"

    def set_future_version(self, path):
        edit_json(self.meta_file(path), lambda meta: meta | {"format_version": meta["format_version"] + 1})

    def temp_home(self, path):
        return path, "placement.npz"  # one file at a time, inside the directory

    def save_other(self, target):
        cfg = self.world.engine.cfg
        random_placement(cfg.n_layers, cfg.d_ff, seed=1).save(target)


class PredictorsKind(Kind):
    name = "predictors"
    error = PredictorError
    remake = "train"

    def make(self):
        return fresh_copy(self.world.predictors_dir, self.tmp / "predictors")

    def read(self, path, foreign=False):
        return Predictors.load(path, tiny_engine("reglu", seed=7) if foreign else self.world.engine, self.world.profile)

    def check_same(self, predictors):
        for a, b in zip(predictors.layers, self.world.predictors.layers):
            for name, value in a.arrays().items():
                np.testing.assert_array_equal(value, b.arrays()[name])

    def data_files(self, path):
        return sorted(f for f in (path / "arrays").rglob("*") if f.is_file())  # all orbax wrote, not only data

    def meta_file(self, path):
        return path / "predictors.json"

    def save_other(self, target):
        random_predictors(self.world.engine, self.world.profile, seed=1).save(target)


KINDS = {k.name: k for k in (GGUFCache, Profile, Samples, PlacementKind, PredictorsKind)}
OWNED = [name for name, k in KINDS.items() if k.error is not None and name != "samples"]  # saved to a user's path


@pytest.fixture
def kind(request, world, tmp_path) -> Kind:
    return KINDS[request.param](world, tmp_path)


# ----- damage

def truncate(target):
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])


def zero_fill(target):
    target.write_bytes(bytes(target.stat().st_size))


def flip_middle(target):
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def remove_file(kind, path):
    target = kind.missing_file(path)
    target.unlink()
    return target


def change_a_digit(kind, path):
    """Change one digit in the second half of the metadata: the JSON stays valid (no leading zero
    appears), so only a checksum can tell."""
    target = kind.meta_file(path)
    data = bytearray(target.read_bytes())
    i = next(i for i in range(len(data) // 2, len(data)) if chr(data[i]).isdigit())
    data[i] = ord("8") if data[i] == ord("9") else data[i] + 1
    target.write_bytes(bytes(data))
    return target


def remove_metadata(kind, path):
    target = kind.meta_file(path)
    target.unlink()
    return target


def garble_metadata(kind, path):
    target = kind.meta_file(path)
    target.write_text("{not json")
    return target


def future_version(kind, path):
    kind.set_future_version(path)
    return kind.meta_file(path)


DATA_FAULTS = {"truncated": truncate, "zero-filled": zero_fill, "flipped": flip_middle}  # each data file in turn
FAULTS = {"missing-file": remove_file, "missing-metadata": remove_metadata, "garbled-metadata": garble_metadata,
          "metadata-digit": change_a_digit, "future-version": future_version}
CASES = [(k, f) for k in KINDS for f in [*DATA_FAULTS, *FAULTS] if not (k == "profile" and f.startswith("missing"))]


def expect_healed(kind: Kind, path: pathlib.Path, damaged: pathlib.Path, monkeypatch) -> None:
    """One CacheWarning naming the damaged file, one rebuild, the right model; then a quiet cache hit."""
    calls = []
    original = gguf_loader.load_gguf
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda *a, **k: calls.append(a) or original(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = kind.read(path)
    reports = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(reports) == 1 and damaged.name in str(reports[0].message), [str(w.message) for w in caught]
    assert len(calls) == 1
    kind.check_same(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        kind.check_same(kind.read(path))
    assert len(calls) == 1 and temps_under(path.parent) == []


def expect_refused(kind: Kind, path: pathlib.Path, damaged: pathlib.Path) -> None:
    """The artifact's own error, naming the file (or the directory holding it) and how to remake it."""
    with pytest.raises(kind.error) as info:
        kind.read(path)
    message = str(info.value)
    assert damaged.name in message or str(path) in message, message
    assert re.search(kind.remake, message), message


@pytest.mark.parametrize("kind, fault", CASES, indirect=["kind"])
def test_damage_heals_the_cache_and_is_refused_in_artifacts(kind, fault, monkeypatch):
    for i in range(len(kind.data_files(kind.make())) if fault in DATA_FAULTS else 1):
        path = kind.make()
        if fault in DATA_FAULTS:
            damaged = kind.data_files(path)[i]
            DATA_FAULTS[fault](damaged)
        else:
            damaged = FAULTS[fault](kind, path)
        if kind.error is None:
            expect_healed(kind, path, damaged, monkeypatch)
        else:
            expect_refused(kind, path, damaged)


@pytest.mark.parametrize("kind", list(KINDS), indirect=True)
def test_another_models_artifact(kind, monkeypatch):
    path = kind.make()
    if kind.name == "gguf-cache":  # an entry made from another file under this file's key
        kind.make_foreign(path)
        expect_healed(kind, path, kind.meta_file(path), monkeypatch)
        return
    if kind.name == "samples":  # the profile points at samples another model wrote
        kind.make_foreign(path)
    mismatch = {"profile": ProfileMismatchError, "predictors": PredictorMismatchError}.get(kind.name, kind.error)
    with pytest.raises(mismatch, match="this model|this profile's model"):
        kind.read(path, foreign=True)


@pytest.mark.parametrize("kind", list(KINDS), indirect=True)
def test_a_pristine_copy_reads_back_exactly(kind):
    """The control: without damage every kind reads back as written (so the cases above fail for the damage)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        kind.check_same(kind.read(kind.make()))


def test_every_artifact_error_is_in_the_family():
    for error in (ProfileError, SamplesError, PlacementError, PlacementVersionError, PredictorError, CacheError):
        assert issubclass(error, ValueError)
    for error in (ProfileError, SamplesError, PlacementError, PredictorError):
        assert issubclass(error, ArtifactError)


# ----- writes that fail or are cut short

@contextlib.contextmanager
def disk_full_beyond(n_bytes: int):
    """No file may grow past ``n_bytes``: writes fail with EFBIG, as they do with ENOSPC on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_gguf_cache_that_cannot_be_created_or_written_is_bypassed(world, tmp_path, monkeypatch):
    kind = GGUFCache(world, tmp_path)
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "not-a-dir"))
    with pytest.warns(CacheWarning, match="cannot create the cache directory .*not-a-dir.*JPINFER_CACHE"):
        kind.check_same(kind.read(None))
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))
    with disk_full_beyond(16 << 10), pytest.warns(CacheWarning, match="cannot write .*without caching it"):
        model = kind.read(None)
    kind.check_same(model)
    gguf = tmp_path / "cache" / "gguf"
    assert list(gguf.iterdir()) == []  # neither an entry nor a temporary left
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        kind.check_same(kind.read(None))  # with room again, the entry is written
    assert len(list(gguf.iterdir())) == 1


def test_samples_in_a_cache_that_cannot_be_created_or_written(world, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "not-a-dir"))
    with pytest.raises(CacheError, match="not-a-dir.*JPINFER_CACHE"):
        profile(world.engine, windows(), ProfileSettings(n_samples=N_SAMPLES, batch_size=2), progress=False)
    monkeypatch.setenv("JPINFER_CACHE", str(tmp_path / "cache"))
    with disk_full_beyond(1 << 10), pytest.raises(CacheError, match="cannot write predictor samples.*JPINFER_CACHE"):
        profile(world.engine, windows(), ProfileSettings(n_samples=N_SAMPLES, batch_size=2), progress=False)
    assert list((tmp_path / "cache" / "samples").iterdir()) == []


# After a failed write, a tensorstore callback may post to the event loop orbax already closed: an
# exception orbax's thread cannot raise, reported by pytest; the save itself raised PredictorError.
ORBAX_LATE_CALLBACK = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.parametrize("kind",
                         [pytest.param(k, marks=ORBAX_LATE_CALLBACK) if k == "predictors" else k for k in OWNED],
                         indirect=True)
def test_a_failed_save_is_a_clear_error_and_keeps_the_older_artifact(kind):
    (kind.tmp / "a-file").write_text("")
    with pytest.raises(kind.error, match="cannot write"):
        kind.save_other(kind.tmp / "a-file" / "inside")
    path = kind.make()
    limit = max(f.stat().st_size for f in kind.data_files(path)) // 2
    with disk_full_beyond(limit), pytest.raises(kind.error, match=f"{path.name}.*cannot write"):
        kind.save_other(path)
    kind.check_same(kind.read(path))
    assert temps_under(path.parent) == []


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("kind", OWNED, indirect=True)
def test_an_interrupted_save_keeps_the_older_artifact(kind, monkeypatch):
    path = kind.make()
    monkeypatch.setattr(artifacts, "publish", interrupt)
    with pytest.raises(KeyboardInterrupt):
        kind.save_other(path)
    monkeypatch.setattr(artifacts, "publish", PUBLISH)
    kind.check_same(kind.read(path))
    assert temps_under(path.parent) == []


def test_an_interrupted_cache_write_leaves_nothing(world, tmp_path, monkeypatch):
    kind = GGUFCache(world, tmp_path)
    monkeypatch.setattr(artifacts, "publish", interrupt)
    with pytest.raises(KeyboardInterrupt):
        kind.read(None)
    monkeypatch.setattr(artifacts, "publish", PUBLISH)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        kind.check_same(kind.read(None))


def test_an_interrupted_profile_leaves_no_samples_and_keeps_older_ones(world, monkeypatch, tmp_path):
    first = profile(world.engine, windows(), ProfileSettings(n_samples=N_SAMPLES, batch_size=2), progress=False)
    monkeypatch.setattr(artifacts, "publish", interrupt)
    with pytest.raises(KeyboardInterrupt):  # the same profile again: the same sample directory
        profile(world.engine, windows(), ProfileSettings(n_samples=N_SAMPLES, batch_size=2), progress=False)
    monkeypatch.setattr(artifacts, "publish", PUBLISH)
    samples = first.samples()
    for layer in range(first.n_layers):
        np.testing.assert_array_equal(samples.arrays(layer)[0], world.profile.samples().arrays(layer)[0])
    assert temps_under(tmp_path / "cache") == []



# ----- what killed writers leave

def plant_temp(directory: pathlib.Path, name: str, age: float) -> pathlib.Path:
    """A temporary as a killed writer leaves it, last written ``age`` seconds ago."""
    temp = directory / name
    temp.mkdir(parents=True)
    (temp / "part").write_bytes(b"x" * 100)
    past = time.time() - age
    for p in (temp / "part", temp):
        os.utime(p, (past, past))
    return temp


@pytest.mark.parametrize("kind", list(KINDS), indirect=True)
def test_stale_temporaries_are_removed_and_live_ones_kept(kind):
    path = kind.make()
    directory, name = kind.temp_home(path)
    if kind.name == "samples":  # swept when a profile writes samples
        directory, name = kind.tmp / "cache" / "samples", "0123456789abcdef-0123456789abcdef"

    def act():
        if kind.name == "gguf-cache":
            kind.read(path)  # a cache hit sweeps too
        elif kind.name == "samples":
            profile(kind.world.engine, windows(), ProfileSettings(n_samples=N_SAMPLES, batch_size=2), progress=False)
        else:
            kind.save_other(path)

    old = artifacts.STALE_SECONDS + 3600
    stale = [plant_temp(directory, f".{name}{artifacts.TEMP_MARK}killed", old)]
    if kind.name == "gguf-cache":
        stale.append(plant_temp(directory, f"{artifacts.TEMP_MARK}older-jpinfer", old))  # the old naming
    live = plant_temp(directory, f".{name}{artifacts.TEMP_MARK}live", 60)
    act()
    assert [p.exists() for p in stale] == [False] * len(stale) and live.exists()


# ----- processes sharing the cache

CHILD = """
import hashlib, pathlib, sys, time, warnings
import jax, numpy as np
from jpinfer.cache import CacheWarning
from jpinfer.models import loading
warnings.simplefilter("error", CacheWarning)
gguf, ready, go = (pathlib.Path(a) for a in sys.argv[1:4])
entries = pathlib.Path(sys.argv[4])
ready.touch()
while not go.exists():
    time.sleep(0.005)
empty = not entries.is_dir() or not any(not e.name.startswith(".") for e in entries.iterdir())
model = loading.load_model(gguf)
print(empty, hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(model.weights))).hexdigest())
"""


def test_processes_building_the_same_entry_at_once_agree(world, tmp_path):
    cache = tmp_path / "cache"
    env = os.environ | {"JPINFER_CACHE": str(cache)}
    ready = [tmp_path / f"ready-{i}" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(world.gguf), str(r), str(tmp_path / "go"),
                               str(cache / "gguf")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ready]
    deadline = time.time() + 120
    while not all(r.exists() for r in ready):  # all imported: start them together
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    cfg = fx.tiny_config(tied=False)
    reference = params.build_weights(cfg, fx.random_tensors(cfg, seed=GGUF_SEED))
    expected = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(reference)))
    results = [out.split() for out, _ in outputs]
    assert [digest for _, digest in results] == [expected.hexdigest()] * 3
    assert sum(empty == "True" for empty, _ in results) >= 2  # at least two really built the entry at once
    assert len(list((cache / "gguf").iterdir())) == 1  # one entry, no temporaries
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        GGUFCache(world, tmp_path).check_same(loading.load_model(world.gguf))


# ----- the helpers themselves

def test_publish_replaces_a_directory_or_keeps_the_one_already_there(tmp_path):
    target = tmp_path / "artifact"
    for content, replace, expected in (("first", False, "first"), ("second", False, "first"), ("third", True, "third")):
        tmp = artifacts.temp_path(target, directory=True)
        (tmp / "file").write_text(content)
        assert artifacts.publish(tmp, target, replace=replace) == (content == expected)
        artifacts.remove(tmp)
        assert (target / "file").read_text() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_a_json_checksum_catches_an_edited_value(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text(artifacts.json_with_checksum({"n": 12, "x": [0.5, None]}))
    artifacts.check_json_checksum(path, artifacts.read_json(path))
    edit_json(path, lambda meta: meta | {"n": 13})
    with pytest.raises(artifacts.Damaged, match="meta.json: contents changed"):
        artifacts.check_json_checksum(path, artifacts.read_json(path))



def test_a_flipped_byte_anywhere_in_a_profile_is_refused(world, tmp_path):
    """Zip's CRC-32s cover the members' data but not its bookkeeping (a flip in a local header's
    extra field reads back fine); the whole-file digest covers every byte."""
    data = world.profile_file.read_bytes()
    path = tmp_path / "prof.npz"
    for i in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[i] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(ProfileError, match="prof.npz"):
            ActivationProfile.load(path)
