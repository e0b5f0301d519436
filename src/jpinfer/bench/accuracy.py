"""The bench's accuracy columns: perplexity on WikiText-2 test of what each engine decodes with.

jpinfer engines are scored through ``modes.evaluation.decode_equivalent`` (the per-token FFN of
their decode step, over whole windows), which also gives the neurons computed and clipped per
token and layer; llama.cpp through its own logits (``llama_cpp.perplexity``); transformers' eager
model runs the dense model's weights in float32 and is not scored again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jpinfer.bench.engines import JaxEngine
from jpinfer.bench.protocol import TEST_WINDOWS
from jpinfer.cache import cache_dir
from jpinfer.data import WIKITEXT2_TEST
from jpinfer.errors import ArtifactError
from jpinfer.ffn import evaluate
from jpinfer.models.loading import LoadedModel
from jpinfer.modes.evaluation import decode_equivalent
from jpinfer.predictor import Predictors, train_predictors
from jpinfer.profiler import ActivationProfile, ProfileSettings, profile, token_windows

WINDOW = 512  # tokens per perplexity window (fewer when the model's context is shorter)


@dataclasses.dataclass
class Accuracy:
    """One engine's scores: perplexity, and per token and layer the neurons it computed (None:
    every one), the neurons its capacity clipped and, of those, the truly active ones."""

    perplexity: float | None
    neurons: float | None = None
    clipped: float | None = None
    clipped_active: float | None = None


def wikitext_windows(tokenizer: Any, n_windows: int = TEST_WINDOWS, window: int = WINDOW) -> np.ndarray:
    """The first ``n_windows`` windows of ``window`` tokens of WikiText-2 test (the perplexity protocol)."""
    return token_windows(str(WIKITEXT2_TEST), tokenizer, window=window, n_tokens=n_windows * window).tokens


def calibration_windows(tokenizer: Any, n_windows: int, window: int = WINDOW) -> np.ndarray:
    """2 x ``n_windows`` windows of WikiText-2 *valid*: the first half calibrates thresholds, greedy allocations
    hold out the second (never test text)."""
    return token_windows("wikitext2-valid", tokenizer, window=window, n_tokens=2 * n_windows * window).tokens


def score(engine: Any, dense: LoadedModel, windows: np.ndarray, activity_thresholds: np.ndarray | None) -> Accuracy:
    """The engine's accuracy on ``windows`` (``dense``: the same model with its dense FFN;
    ``activity_thresholds``: what "active" means for the clipped-active count, None: not counted).
    A peer that measures its own (llama.cpp, from its own logits) has a ``perplexity(windows)``."""
    own = getattr(engine, "perplexity", None)
    if callable(own):
        return Accuracy(own(windows))
    if not isinstance(engine, JaxEngine):
        return Accuracy(None)
    model, strategy = decode_equivalent(engine.engine, dense, activity_thresholds)
    ppl, aux = evaluate(model, windows, strategy.impl, strategy.state)
    per_token = lambda key: _per_token_and_layer(aux, key, windows)
    return Accuracy(ppl, per_token("predicted") if _has(aux, "predicted") else per_token("neurons"),
                    per_token("clipped"), None if activity_thresholds is None else per_token("clipped_active"))


def _has(aux: Any, key: str) -> bool:
    return bool(aux) and isinstance(aux[0], dict) and key in aux[0]


def _per_token_and_layer(aux: Any, key: str, windows: np.ndarray) -> float | None:
    """Mean over tokens and layers of a per-token count in the strategy's aux (None if it has none)."""
    if not _has(aux, key):
        return None
    return float(sum(layer[key] for layer in aux) / (len(aux) * windows.size))


# ----- operating points the scripts share


def cached_profile(engine: Any, n_samples: int) -> ActivationProfile:
    """The model's activation profile with ``n_samples`` predictor samples per layer, profiled once
    and cached under $JPINFER_CACHE/bench (profiled again when the cached one is unreadable)."""
    path = cache_dir("bench") / f"predictors-profile-{n_samples}.npz"
    if path.is_file():
        try:
            prof = ActivationProfile.load(path, engine)
            prof.samples()
            return prof
        except ArtifactError as e:  # an older format, or samples deleted or damaged: profile again
            print(f"profiling again: {e}")
    prof = profile(engine, settings=ProfileSettings(n_samples=n_samples))
    prof.save(path)
    return prof


def trained(engine: Any, prof: ActivationProfile, name: str, reuse: bool, **kwargs: Any) -> tuple[Predictors, float]:
    """Predictors trained on ``prof`` (``train_predictors`` with ``kwargs``) and the training seconds;
    saved under $JPINFER_CACHE/bench/predictors-``name``, loaded from there with ``reuse``."""
    path = cache_dir("bench") / f"predictors-{name}"
    if reuse and path.is_dir():
        loaded = Predictors.load(path, engine, prof)
        return loaded, loaded.meta["seconds"]
    t = time.perf_counter()
    predictors = train_predictors(engine, prof, **kwargs)
    seconds = time.perf_counter() - t
    predictors.meta["seconds"] = seconds
    predictors.save(path)
    return predictors, seconds


def parse_point(text: str) -> tuple[dict[str, float], str]:
    """A threshold operating point: 'a0.5+i0.3g' -> ({'activation': 0.5, 'input': 0.3}, 'greedy')
    (a: activation sparsity, i: input sparsity; a trailing g: the greedy per-layer method, else uniform)."""
    method = "greedy" if text.endswith("g") else "uniform"
    targets = {}
    for part in text.rstrip("g").split("+"):
        targets[{"a": "activation", "i": "input"}[part[0]]] = float(part[1:])
    return targets, method
