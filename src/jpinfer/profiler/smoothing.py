"""The int8 model: per-channel activation peaks over calibration text, SmoothQuant's migration, quantization.

Per-token int8 activations lose most where a few input channels are much larger than the rest (the
quantization step is the token's peak / 127). Measured on the default model (scratch runs, WikiText-2
test, 8 x 512 tokens): W8A8 without migration raised perplexity 3.9%, most of it in the q/k/v inputs
(quantizing only them: +1.9%), then the down projection's (+1.0%) and the head's (+0.6%); the whole
table with the migration is in bench/results/quantized.md (bench/quantized.py).
The peaks are taken on the float model, before
anything is quantized, on bundled text apart from the text the accuracy is measured on.
"""

from __future__ import annotations

import functools
import hashlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpinfer import artifacts
from jpinfer.cache import CacheWarning, cache_dir
from jpinfer.config import ModelConfig
from jpinfer.errors import CacheError
from jpinfer.models import quantized, smoothquant, transformer
from jpinfer.models.identity import model_fingerprint
from jpinfer.models.loading import LoadedModel
from jpinfer.models.smoothquant import ChannelPeaks
from jpinfer.profiler import passes
from jpinfer.profiler.corpus import TokenWindows, token_windows

SMOOTHING_CORPUS = "chatgpt-prompts"  # bundled; not the WikiText-2 text the accuracy is measured on
SMOOTHING_WINDOWS = 8  # x WINDOW tokens; 32 windows were no better on WikiText-2 test (scratch run)
WINDOW = 512
# Chosen on WikiText-2 *valid* (16 x 512 tokens, default model, scratch run 2026-12-01): perplexity x float
# 1.012 / 1.017 / 1.007 / 1.015 / 1.035 at alpha 0.4 / 0.5 (SmoothQuant's default) / 0.6 / 0.7 / 0.8.
ALPHA = 0.6
PEAKS_CACHE_VERSION = 1


@functools.partial(jax.jit, static_argnames=("cfg",))
def _batch_peaks(weights, tokens: jax.Array, valid: jax.Array, cfg: ModelConfig):
    """Per layer, max |input| per channel of q/k/v, gate/up and down over the valid windows of a batch;
    and of the head.

    Walks the layers with the decoder's own pieces: the q/k/v input (the attention norm's output) is
    inside ``attention_residual``, which no FFN hook sees."""
    cache = transformer.KVCache.create(cfg, tokens.shape[0], tokens.shape[1], weights.dtype)
    h, positions, rope_cs = transformer.step_inputs(weights, tokens, cache.length, cfg)
    keep = valid[:, None, None]
    peak = lambda v: jnp.max(jnp.where(keep, jnp.abs(v.astype(jnp.float32)), 0), axis=(0, 1))
    out = []
    for i, layer in enumerate(weights.layers):
        attention_input = transformer.norm(layer.attn_norm, h, cfg)
        h, x, _, _ = transformer.attention_residual(layer, h, positions, rope_cs, cache.k[i], cache.v[i], cfg,
                                                    window=cfg.layer_window(i))
        a = transformer.ffn_activations(layer, x, cfg)
        out.append((peak(attention_input), peak(x), peak(a)))
        h = transformer.ffn_residual(layer, h, transformer.ffn_down(layer, a), cfg)
    return out, peak(transformer.norm(weights.final_norm, h, cfg))


def channel_peaks(model: LoadedModel, windows: TokenWindows | np.ndarray, *, batch_size: int = 2,
                  progress: bool = False) -> ChannelPeaks:
    """Max |input| per channel of every layer's q/k/v, gate/up and down projections over ``windows``."""
    if quantized.weights_format(model.weights) != "float":
        raise ValueError("channel peaks are taken on the float model, before it is quantized")
    tokens = passes.as_tokens(windows, model.cfg.vocab_size)
    total = None
    with tqdm(total=int(tokens.size), unit="tok", desc="int8 calibration", disable=not progress) as bar:
        for _, chunk, valid in passes.batches(tokens, batch_size):
            layers, head = _batch_peaks(model.weights, jnp.asarray(chunk), jnp.asarray(valid[:, 0]), model.cfg)
            found = [np.stack([np.asarray(layer[k]) for layer in layers]) for k in range(3)] + [np.asarray(head)]
            total = found if total is None else [np.maximum(a, b) for a, b in zip(total, found)]
            bar.update(int(valid.sum()))
    return ChannelPeaks(*total)


def cached_channel_peaks(model: LoadedModel, windows: TokenWindows | np.ndarray, *, progress: bool = False
                         ) -> ChannelPeaks:
    """``channel_peaks``, kept in the cache directory (``$JPINFER_CACHE/int8``): the calibration pass is most
    of what the int8 form adds to a load (default model: 5.9 s of ~10 s; the migration 1.8 s, quantizing
    1.5 s). The key is the float weights' fingerprint and the token windows' digest, so other weights or
    other text never share an entry. Like the GGUF cache it only saves time: a damaged entry is reported
    (a ``CacheWarning``), removed and recomputed; an unwritable cache is reported and bypassed."""
    tokens = passes.as_tokens(windows, model.cfg.vocab_size)
    key = hashlib.sha256(f"{PEAKS_CACHE_VERSION}|{model_fingerprint(model.cfg, model.weights)}|{tokens.shape}|"
                         f"{artifacts.digest(np.ascontiguousarray(tokens, np.int32).tobytes())}".encode())
    try:
        path = cache_dir("int8") / f"{key.hexdigest()[:24]}.npz"
    except CacheError as err:
        warnings.warn(f"{err}; calibrating the int8 model without the cache", CacheWarning, stacklevel=3)
        return channel_peaks(model, tokens, progress=progress)
    if path.exists():
        try:
            return _read_peaks(path, model.cfg)
        except artifacts.Damaged as damage:
            warnings.warn(f"jpinfer cache: {damage}; removing it and calibrating again", CacheWarning, stacklevel=3)
            artifacts.remove(path)
    peaks = channel_peaks(model, tokens, progress=progress)
    arrays = {field: np.asarray(getattr(peaks, field), np.float32) for field in _PEAK_FIELDS}
    try:
        with artifacts.atomic_write(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, digest=np.array(_peaks_digest(arrays)), **arrays)
    except OSError as err:
        warnings.warn(f"jpinfer cache: cannot write {path} ({err}); set JPINFER_CACHE to a writable directory",
                      CacheWarning, stacklevel=3)
    return peaks


_PEAK_FIELDS = ("attention", "ffn", "down", "head")


def _peaks_digest(arrays: dict[str, np.ndarray]) -> str:
    return artifacts.digest(b"".join(arrays[k].tobytes() for k in _PEAK_FIELDS))


def _read_peaks(path, cfg: ModelConfig) -> ChannelPeaks:
    """A cached entry's peaks; ``artifacts.Damaged`` for anything unreadable, of other shapes or not matching
    its digest."""
    shapes = {"attention": (cfg.n_layers, cfg.d_model), "ffn": (cfg.n_layers, cfg.d_model),
              "down": (cfg.n_layers, cfg.d_ff), "head": (cfg.d_model,)}
    try:
        with np.load(path) as data:
            arrays = {k: np.asarray(data[k], np.float32) for k in _PEAK_FIELDS}
            digest = str(data["digest"])
    except (OSError, ValueError, KeyError) as err:
        raise artifacts.Damaged(path, f"unreadable ({type(err).__name__}: {err})") from None
    if any(arrays[k].shape != shape for k, shape in shapes.items()) or digest != _peaks_digest(arrays):
        raise artifacts.Damaged(path, "its peaks do not match their shapes or digest")
    return ChannelPeaks(**arrays)


def calibration_windows(tokenizer) -> TokenWindows:
    """The default calibration text: ``SMOOTHING_WINDOWS`` windows of ``WINDOW`` tokens of ``SMOOTHING_CORPUS``."""
    return token_windows(SMOOTHING_CORPUS, tokenizer, window=WINDOW, n_tokens=SMOOTHING_WINDOWS * WINDOW)


def int8_model(model: LoadedModel, windows: TokenWindows | np.ndarray | None = None, *, alpha: float = ALPHA,
               progress: bool = False) -> LoadedModel:
    """``model`` with int8 weights (``quantized.quantize_weights``) after SmoothQuant's migration, the peaks taken
    on ``windows`` (default: ``calibration_windows``; cached, ``cached_channel_peaks``). A model without
    a tokenizer and no windows given is quantized without migration, with a warning."""
    weights = model.weights
    if windows is None and model.tokenizer is None:
        warnings.warn("the model has no tokenizer to read the int8 calibration text: quantized without "
                      "SmoothQuant's migration (pass token windows to calibrate)", stacklevel=2)
    else:
        if windows is None:
            windows = calibration_windows(model.tokenizer)
        weights = smoothquant.smooth(weights, cached_channel_peaks(model, windows, progress=progress), alpha)
    return LoadedModel(model.cfg, quantized.quantize_weights(weights, "int8"), model.tokenizer, model.source)
