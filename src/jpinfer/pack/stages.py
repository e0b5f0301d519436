"""``prepare``: calibration, profile, thresholds, predictors and placement of a model, as one pack.

Stages run in order (``settings.STAGES``). A stage is reused when the manifest lists it with the
key this run computes (its inputs and the keys of the stages it reads) and its files verify, and
every stage it reads is reused too; otherwise it runs, and so does everything after it that reads
it. The manifest is rewritten after each stage, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import re
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np

from jpinfer import artifacts
from jpinfer.activations import SMOOTH_KINDS
from jpinfer.cache import CacheWarning, cache_dir
from jpinfer.errors import JpinferError
from jpinfer.models import quantized
from jpinfer.models.identity import model_fingerprint, model_record
from jpinfer.models.loading import LoadedModel, ModelArg, resolve_model
from jpinfer.modes.placement import check_gpu_budget, choose_placement
from jpinfer.pack import store
from jpinfer.pack.settings import DEPENDS, STAGES, PackSettings, stage_inputs, stage_keys
from jpinfer.pack.store import FILES, Pack, PackError, PackMismatchError
from jpinfer.predictor import SearchConfig, TrainConfig, train_predictors
from jpinfer.predictor.store import Predictors
from jpinfer.profiler import ActivationProfile, Corpus, ProfileSettings, SamplesError, profile, token_windows, uniform
from jpinfer.profiler.calibration import ATTENTION, HEAD
from jpinfer.profiler.sparsity import from_histograms, greedy_thresholds, histograms, model_wide_greedy, with_head
from jpinfer.solver import Placement, measure_hardware, preset

LOADERS: dict[str, Callable[[pathlib.Path], Any]] = {
    "calibration": store.load_histograms, "profile": ActivationProfile.load, "thresholds": store.read_thresholds,
    "predictors": Predictors.load, "placement": Placement.load,
}


@dataclasses.dataclass
class _Run:
    """One ``prepare`` call: the model, the pack directory, the settings, and each stage's result."""

    model: LoadedModel
    path: pathlib.Path
    settings: PackSettings
    progress: bool
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def result(self, stage: str) -> Any:
        """A stage's result: computed by this run, or read from the pack (verified before)."""
        if stage not in self.results:
            self.results[stage] = LOADERS[stage](self.path / FILES[stage])
        return self.results[stage]

    def calibration_windows(self) -> tuple[np.ndarray, int]:
        """(windows, n): twice ``calibration_tokens`` of windows; the first n calibrate, greedy
        allocation measures its held-out loss on the next n."""
        s = self.settings
        corpus = Corpus.of(s.corpus, list(s.fields) or None)
        tokens = token_windows(corpus, self.model.tokenizer, window=s.window, n_tokens=2 * s.calibration_tokens,
                               seed=s.seed).tokens
        return tokens, max(1, s.calibration_tokens // s.window)


def _calibration(run: _Run) -> Any:
    tokens, n = run.calibration_windows()
    hists = histograms(run.model, tokens[:n], progress=run.progress)
    store.save_histograms(run.path / FILES["calibration"], hists)
    return hists


def _profile(run: _Run) -> ActivationProfile:
    s = run.settings
    thresholds = None  # ReLU kinds: active = non-zero
    if run.model.cfg.ffn_kind in SMOOTH_KINDS:
        thresholds = uniform(run.result("calibration")["activation"], s.sparsity)
    settings = ProfileSettings(n_tokens=s.n_tokens, window=s.window, seed=s.seed, n_samples=s.n_samples)
    prof = profile(run.model, Corpus.of(s.corpus, list(s.fields) or None), settings, thresholds=thresholds,
                   progress=run.progress)
    prof.save(run.path / FILES["profile"])
    return prof


def _thresholds(run: _Run) -> Any:
    targets = run.settings.threshold_targets(run.model.cfg.ffn_kind, quantized.weights_format(run.model.weights))
    wide = targets.get("model_wide")
    attention, head = targets.get("attention"), targets.get("head")
    kinds = {"activation": targets.get("activation"), "input": targets.get("input"), "qkv": attention, "o": attention,
             HEAD: head}
    greedy = wide is not None or targets.get("allocation") == "greedy"
    hists = run.result("calibration")
    # a calibration written before the attention's or the head's histograms existed: take them again (not stored:
    # the stage's key, and so the profile and predictors made after it, stay valid)
    rehistogram = ((attention is not None or wide is not None) and not set(ATTENTION) <= set(hists)
                   or head is not None and HEAD not in hists)
    if rehistogram or greedy:
        tokens, n = run.calibration_windows()  # tokenized once for both
    if rehistogram:
        hists = histograms(run.model, tokens[:n], progress=run.progress)
    if greedy and len(tokens) < 2 * n:
        raise JpinferError(f"greedy allocation holds out {n} windows after the {n} it calibrates on; the corpus "
                           f"gave {len(tokens)}: use a longer corpus or fewer calibration_tokens")
    if wide is not None:
        thresholds = with_head(model_wide_greedy(run.model, hists, wide, tokens[n:2 * n], progress=run.progress),
                               hists, head)
    elif greedy:
        thresholds = greedy_thresholds(run.model, hists, kinds, tokens[n:2 * n], progress=run.progress)
    else:
        thresholds = from_histograms(hists, kinds, "uniform")
    with artifacts.atomic_write(run.path / FILES["thresholds"]) as tmp:
        tmp.write_text(artifacts.json_with_checksum(thresholds.to_dict()))
    return thresholds


def _predictors(run: _Run) -> Predictors:
    s = run.settings
    config = TrainConfig(recall=s.recall, strong_recall=s.strong_recall, max_epochs=s.max_epochs)
    search = SearchConfig(samples=s.search_samples, max_epochs=s.search_epochs)
    predictors = train_predictors(run.model, run.result("profile"), ranks=s.ranks, budget=s.predictor_budget,
                                  config=config, search=search, progress=run.progress)
    predictors.save(run.path / FILES["predictors"])
    return predictors


def _placement(run: _Run) -> Placement:
    s = run.settings
    hardware = measure_hardware() if s.hardware == "measure" else preset(s.hardware)
    placement = choose_placement(run.model, run.result("profile"), run.result("predictors"), s.gpu_budget,
                                 context=s.context, hardware=hardware, objective=s.objective)
    placement.save(run.path / FILES["placement"])
    return placement


RUNNERS: dict[str, Callable[[_Run], Any]] = {
    "calibration": _calibration, "profile": _profile, "thresholds": _thresholds, "predictors": _predictors,
    "placement": _placement,
}
DOES = {"calibration": "histograms of activations, FFN and attention inputs",
        "profile": "activity counts, predictor samples",
        "thresholds": "the threshold mode's thresholds", "predictors": "training a predictor per layer",
        "placement": "hot neurons under the GPU budget"}


def default_pack_dir(model_name: str, weights: str, fingerprint: str) -> pathlib.Path:
    """Where ``prepare`` writes a pack when given no directory: under the cache, one per model fingerprint
    (so one per weights format of a model: its int8 and int4 forms are other weights), named with the
    format so that a listing of the cache tells them apart."""
    slug = re.sub(r"[^a-z0-9.]+", "-", model_name.lower()).strip("-") or "model"
    return cache_dir("packs") / f"{slug}-{weights}-{fingerprint[:12]}"


def prepare(model: ModelArg = None, out: str | os.PathLike | None = None, settings: PackSettings | None = None, *,
            progress: bool = True, **overrides: Any) -> Pack:
    """Make (or finish, or update) the pack of ``model`` (an Engine, LoadedModel, checkpoint path,
    or None: the default model) in ``out`` (default: ``$JPINFER_CACHE/packs/MODEL-FINGERPRINT``).

    ``settings`` (a ``PackSettings``), with keyword ``overrides`` of its fields (``sparsity=0.6``,
    ``gpu_budget="6GB"``, ...). Stages whose inputs did not change since the pack was last prepared
    are reused; the returned ``Pack.ran`` names those that ran. A directory holding another model's
    pack, or files that are not a pack, is refused (nothing is overwritten).
    """
    try:
        settings = dataclasses.replace(settings or PackSettings(), **overrides)
    except TypeError as e:  # an unknown setting name
        raise JpinferError(f"prepare: {e}; the settings are the fields of jpinfer.pack.PackSettings") from None
    loaded = resolve_model(model)
    cfg = loaded.cfg
    check_gpu_budget(loaded, settings.gpu_budget, context=settings.context)  # before minutes of profiling
    fingerprint = model_fingerprint(cfg, loaded.weights)
    record = model_record(loaded)
    dtype = record["dtype"]
    path = (pathlib.Path(out).expanduser().absolute() if out is not None
            else default_pack_dir(cfg.name, record["weights"], fingerprint))
    keys = stage_keys(settings, cfg.ffn_kind, dtype, record["weights"], fingerprint)
    inputs = stage_inputs(settings, cfg.ffn_kind, dtype, record["weights"])
    manifest = _existing_manifest(path, loaded)
    run = _Run(loaded, path, settings, progress)
    reused = _reusable(run, manifest, keys)
    unchanged = manifest is not None and manifest.get("complete") and len(reused) == len(STAGES)
    if not unchanged:
        manifest = {"format": store.FORMAT, "version": store.VERSION,
                    "model": record | {"fingerprint": fingerprint, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff},
                    "settings": settings.to_dict(), "complete": False,
                    "stages": {s: manifest["stages"][s] for s in reused}}
        path.mkdir(parents=True, exist_ok=True)
        store.write_manifest(path, manifest)
        _say(progress, f"preparing the pack of {cfg.name} in {path}")
    ran = []
    for number, stage in enumerate(STAGES, 1):
        if stage in reused:
            if not unchanged:
                _say(progress, f"[{number}/{len(STAGES)}] {stage}: reused")
            continue
        _say(progress, f"[{number}/{len(STAGES)}] {stage}: {DOES[stage]} ...")
        start = time.perf_counter()
        run.results[stage] = RUNNERS[stage](run)
        seconds = time.perf_counter() - start
        manifest["stages"][stage] = {
            "key": keys[stage], "inputs": inputs[stage], "after": {d: keys[d] for d in DEPENDS[stage]},
            "files": store.stage_files(path, stage), "seconds": round(seconds, 2),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        store.write_manifest(path, manifest)
        ran.append(stage)
        _say(progress, f"[{number}/{len(STAGES)}] {stage}: done in {seconds:.0f} s")
    if not unchanged:
        manifest["complete"] = True
        store.write_manifest(path, manifest)
    thresholds = run.result("thresholds")
    return Pack(path, store.read_manifest(path), run.result("profile").with_sparsity_thresholds(thresholds), thresholds,
                run.result("predictors"), run.result("placement"), tuple(ran))


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def _existing_manifest(path: pathlib.Path, model: LoadedModel) -> dict[str, Any] | None:
    """The manifest of a pack already at ``path`` (None: nothing there, or a damaged or other-version
    pack, which is remade with a warning); refuses another model's pack and non-pack files."""
    if not path.exists():
        return None
    if not path.is_dir():
        raise JpinferError(f"{path}: a file is in the way of the pack directory")
    if not (path / store.MANIFEST).exists():
        if any(path.iterdir()):
            raise JpinferError(f"{path}: a directory with other files in it, not a pack: "
                               "give an empty or new directory")
        return None
    try:
        manifest = store.read_manifest(path)
    except PackError as err:
        warnings.warn(f"{err}; preparing it anew", CacheWarning, stacklevel=3)
        return None
    try:
        store.check_model(path, manifest, model)
    except PackMismatchError as err:
        raise PackMismatchError(f"{err}; or give another directory (it is not overwritten)") from None
    return manifest


def _reusable(run: _Run, manifest: dict[str, Any] | None, keys: dict[str, str]) -> set[str]:
    """The stages recorded with this run's key whose files verify and whose inputs are all reusable;
    the profile also needs its predictor samples when the predictors are to be trained again."""
    if manifest is None:
        return set()
    reused: set[str] = set()
    for stage in STAGES:
        entry = manifest["stages"].get(stage)
        if entry is None or entry.get("key") != keys[stage] or not set(DEPENDS[stage]) <= reused:
            continue
        try:
            store.check_stage(run.path, entry)
        except artifacts.Damaged as damage:
            warnings.warn(f"{damage}: redoing the {stage} stage", CacheWarning, stacklevel=3)
            continue
        reused.add(stage)
    if "profile" in reused and "predictors" not in reused:
        try:
            run.result("profile").samples()
        except SamplesError:  # removed from the cache since: the profile is taken again, with them
            reused = {s for s in reused if s in ("calibration", "thresholds")}
    return reused
