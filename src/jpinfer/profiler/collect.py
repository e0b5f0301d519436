"""The profiling pass: run a corpus through the dense model and fill an ActivationProfile."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer import artifacts
from jpinfer.activations import SMOOTH_KINDS
from jpinfer.cache import cache_dir
from jpinfer.config import ModelConfig
from jpinfer.models import transformer
from jpinfer.models.identity import model_fingerprint, model_record
from jpinfer.models.loading import LoadedModel, ModelArg, resolve_model
from jpinfer.models.params import Layer
from jpinfer.profiler import calibration, passes, samples
from jpinfer.profiler.activity import Score, activation_and_score, check_score
from jpinfer.profiler.corpus import Corpus, TokenWindows, token_windows
from jpinfer.profiler.sparsity import HEAD, KINDS, SparsityTargets, calibrate_sparsity
from jpinfer.profiler.stats import ActivationProfile

DEFAULT_CORPUS = "wikitext2-valid"


@dataclasses.dataclass(frozen=True)
class _StatsFFN:
    """Dense FFN that counts active neurons, histograms active neurons per token, and
    gathers the planned sample tokens' inputs and packed masks."""

    cfg: ModelConfig
    score: str

    def __call__(self, i: int, layer: Layer, x: jax.Array, state) -> tuple[jax.Array, dict[str, jax.Array]]:
        threshold, valid, sample_index = state
        a, s = activation_and_score(layer, x, self.cfg, self.score)
        active = s > threshold
        d_ff = active.shape[-1]
        per_token = jnp.where(valid, active.sum(-1), d_ff + 1)  # padding goes to a dropped bin
        aux = {
            "counts": (active & valid[..., None]).sum((0, 1), dtype=jnp.int32),
            "hist": jnp.bincount(per_token.ravel(), length=d_ff + 2)[: d_ff + 1],
        }
        if sample_index is not None:
            aux["inputs"] = x.reshape(-1, x.shape[-1])[sample_index].astype(jnp.float16)
            aux["masks"] = jnp.packbits(active.reshape(-1, d_ff)[sample_index], axis=-1)
        return transformer.ffn_down(layer, a), aux


def _windows(loaded: LoadedModel, corpus: Any, s: ProfileSettings) -> TokenWindows:
    if isinstance(corpus, TokenWindows):
        return corpus
    if isinstance(corpus, np.ndarray):
        return TokenWindows(passes.as_tokens(corpus, loaded.cfg.vocab_size), {"source": "token array"})
    return token_windows(Corpus.of(corpus), loaded.tokenizer, window=s.window, n_tokens=s.n_tokens, seed=s.seed,
                         bos=s.bos)


def _thresholds(loaded, thresholds, sparsity, score, hist):
    """(per-layer thresholds, calibration record) for the pass; ``hist`` the score histogram of the
    calibration windows, taken when a SwiGLU model's thresholds are to be calibrated (else None)."""
    cfg = loaded.cfg
    if cfg.ffn_kind not in SMOOTH_KINDS:
        if thresholds is not None or score != "product":
            raise ValueError(f"{cfg.ffn_kind} neurons are active when non-zero: drop thresholds= and score=")
        return np.zeros(cfg.n_layers, np.float32), None
    if isinstance(thresholds, calibration.Calibration):
        if thresholds.score != score:
            raise ValueError(f"the thresholds were calibrated for score {thresholds.score!r}, not {score!r}")
        return thresholds.thresholds, thresholds.to_dict()
    if thresholds is not None:
        thr = np.asarray(thresholds, np.float32)
        if thr.shape != (cfg.n_layers,) or np.any(thr < 0) or not np.all(np.isfinite(thr)):
            raise ValueError(f"thresholds must be {cfg.n_layers} finite non-negative numbers, one per layer")
        return thr, {"method": "given", "score": score}
    cal = calibration.uniform(hist, sparsity)
    return cal.thresholds, cal.to_dict() | {"calibration_tokens": hist.n_tokens}


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """How ``profile`` reads its corpus and what it keeps. ``n_tokens`` in windows of ``window`` tokens
    (``seed``: which documents, None: in order; ``bos``: a BOS token first). SwiGLU-like models
    (``activations.SMOOTH_KINDS``: no exact zeros) take uniform activity thresholds calibrated for ``sparsity``
    (fraction inactive) on the first ``calibration_tokens``, unless ``profile`` is given thresholds;
    ``score`` is what "active" measures (``profiler.activity``). ``n_samples`` > 0 also keeps that many
    (input, active mask) pairs per layer for the predictors. ``batch_size`` windows run through the model
    at a time."""

    n_tokens: int | None = 131072
    window: int = 512
    seed: int | None = 0
    bos: bool = False
    sparsity: float = 0.5
    score: Score = "product"
    calibration_tokens: int = 16384
    n_samples: int = 0
    batch_size: int = 4


def profile(
    model: ModelArg = None,
    corpus: Corpus | str | os.PathLike | TokenWindows | np.ndarray = DEFAULT_CORPUS,
    settings: ProfileSettings = ProfileSettings(),
    *,
    targets: SparsityTargets = SparsityTargets(),
    thresholds: calibration.Calibration | np.ndarray | None = None,
    progress: bool = True,
) -> ActivationProfile:
    """Profile neuron activity of ``model`` (Engine, checkpoint path, or None: default model).

    ``corpus``: a file, bundled or ``datasets`` name, Corpus (with its text columns), or token windows (n,
    window); ``settings``: how much of it, and what is kept (``ProfileSettings``).
    SwiGLU-like models' activity thresholds: a Calibration (calibration.py) or an array given as
    ``thresholds``, else calibrated for ``settings.sparsity``. Predictor samples: ``meta["samples"]``, open with
    ``ActivationProfile.samples``.
    ``targets`` (``SparsityTargets``) also calibrates the threshold mode's thresholds (``calibrate_sparsity``)
    on the first ``calibration_tokens`` (greedy allocation: held out on the next as many) and stores them with
    the profile.
    """
    s = settings
    loaded = resolve_model(model)
    cfg = loaded.cfg
    check_score(s.score, cfg)
    targets.check(cfg.ffn_kind)
    windows = _windows(loaded, corpus, s)
    tokens = windows.tokens
    fingerprint = model_fingerprint(cfg, loaded.weights)
    n = max(1, min(len(tokens), s.calibration_tokens // tokens.shape[1]))  # calibration windows
    if targets.on and targets.method == "greedy" and len(tokens) < 2 * n:
        raise ValueError(f"greedy allocation holds out {n} windows after the {n} it calibrates on; the corpus "
                         f"gave {len(tokens)}: profile more tokens or lower calibration_tokens")
    t0 = time.perf_counter()
    # one histogram pass over the calibration windows serves the activity thresholds and the threshold mode's
    take_hists = lambda: calibration.histograms(loaded, tokens[:n], score=s.score, batch_size=s.batch_size,
                                                progress=progress)
    hists = take_hists() if cfg.ffn_kind in SMOOTH_KINDS and thresholds is None else None
    thr, calibration_record = _thresholds(loaded, thresholds, s.sparsity, s.score, None if hists is None else hists[0])
    t1 = time.perf_counter()

    writer = sample_plan = None
    if s.n_samples:
        sample_plan = samples.plan(s.n_samples, len(tokens), tokens.shape[1], s.batch_size, s.seed or 0)
        key = json.dumps([windows.origin, thr.tolist(), s.n_samples, s.score, s.seed]).encode() + tokens.tobytes()
        name = f"{fingerprint[:16]}-{hashlib.blake2b(key, digest_size=8).hexdigest()}"
        root = cache_dir("samples")
        artifacts.remove_stale_temps(root)  # what killed profiling runs left
        directory = root / name
        meta = {"model_fingerprint": fingerprint, "thresholds": thr.tolist(), "score": s.score,
                "corpus": windows.origin}
        writer = samples.SampleWriter(directory, cfg.n_layers, sample_plan.total, cfg.d_model, cfg.d_ff, meta)
    batch = min(s.batch_size, len(tokens))

    def extra(start: int, valid: np.ndarray):
        return None if sample_plan is None else jnp.asarray(sample_plan.local[start // batch])

    counts = np.zeros((cfg.n_layers, cfg.d_ff), np.int64)
    hist = np.zeros((cfg.n_layers, cfg.d_ff + 1), np.int64)
    collector = _StatsFFN(cfg, s.score)
    try:
        for start, _, aux in passes.run(loaded, tokens, collector, thr, s.batch_size, progress, "profiling", extra):
            counts += np.stack([a["counts"] for a in aux])
            hist += np.stack([a["hist"] for a in aux])
            if writer is not None:
                keep = int(sample_plan.count[start // batch])
                writer.add(np.stack([a["inputs"][:keep] for a in aux]), np.stack([a["masks"][:keep] for a in aux]))
        samples_dir = None if writer is None else str(writer.close())
    except BaseException:  # an interrupted or failed pass leaves no half-written samples behind
        if writer is not None:
            writer.abort()
        raise
    t2 = time.perf_counter()

    mode_thresholds = None
    if targets.on:
        shared = None  # the threshold mode's activation histogram is of score "product"
        if s.score == "product":
            shared = dict(zip((*KINDS, HEAD), hists if hists is not None else take_hists()))
        mode_thresholds = calibrate_sparsity(
            loaded, tokens[:n], activation=targets.activation, input=targets.input, attention=targets.attention,
            model_wide=targets.model_wide, head=targets.head, method=targets.method,
            heldout=tokens[n : 2 * n] if targets.method == "greedy" else None, batch_size=s.batch_size,
            progress=progress,
            hists=shared)
    t3 = time.perf_counter()

    meta = {
        "model": model_record(loaded),
        "corpus": windows.origin,
        "score": s.score,
        "calibration": calibration_record,
        "samples": samples_dir,
        "seconds": {"calibration": t1 - t0, "pass": t2 - t1, "threshold_mode": t3 - t2},
    }
    prof = ActivationProfile(cfg.name, fingerprint, cfg.ffn_kind, counts, int(tokens.size), hist, thr, meta)
    return prof if mode_thresholds is None else prof.with_sparsity_thresholds(mode_thresholds)
