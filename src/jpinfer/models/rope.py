"""Rotary position embedding: the inverse frequencies a config asks for (plain, or stretched by a
``config.RopeScaling``), the per-step cos/sin tables, and their application to queries and keys."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jpinfer.config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig, length: jax.Array | None = None) -> jax.Array:
    """(head_dim / 2,) float32: theta^(-2i / head_dim), then the config's scaling, all in float32 jnp operations
    inside the step (transformers computes them in float32 too). Not float64 rounded once: that moved 11 of
    the default model's 32 frequencies by an ulp and flipped a greedy answer of its int8 threshold mode, so
    unscaled models keep exactly the frequencies jpinfer always computed. Dynamic scaling reads the ``length``
    the step reaches (a scalar, or (B,) per sequence: (B, head_dim / 2) then; None: the original context)."""
    s = cfg.rope_scaling
    if s is not None and s.kind == "dynamic":
        return _dynamic_frequencies(cfg, s, length)
    if s is not None and s.kind == "longrope":
        return _longrope_frequencies(cfg, s, length)
    inv = _plain_frequencies(cfg.rope_theta, cfg.head_dim)
    return inv if s is None else _scaled(inv, s, cfg.head_dim, cfg.rope_theta)


def _plain_frequencies(theta: float | jax.Array, head_dim: int) -> jax.Array:
    """theta^(-2i / head_dim); a traced theta (dynamic scaling's) of shape (B,) gives (B, head_dim / 2)."""
    half = head_dim // 2
    if isinstance(theta, jax.Array):
        theta = theta[..., None]
    return 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))


def _longrope_frequencies(cfg: ModelConfig, s: RopeScaling, length: jax.Array | None) -> jax.Array:
    """LongRoPE as transformers computes it: 1 / (factor_i theta^(2i / head_dim)), the long factors when the step
    reaches past the original context, the short ones otherwise (and before any step)."""
    half = cfg.head_dim // 2
    short, long = (jnp.asarray(f, jnp.float32) for f in (s.frequency_factors, s.long_factors))
    past = jnp.asarray(0 if length is None else length)[..., None] > s.original_max_position
    return 1.0 / (jnp.where(past, long, short) * cfg.rope_theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))


def _dynamic_frequencies(cfg: ModelConfig, s: RopeScaling, length: jax.Array | None) -> jax.Array:
    """Dynamic NTK (transformers' ``dynamic`` RoPE): the base stretched for the length reached, never below the
    original context's (as transformers computes it per call, in float32)."""
    original = s.original_max_position
    reached = jnp.maximum(jnp.asarray(original if length is None else length, jnp.float32), original)
    d = cfg.head_dim
    base = cfg.rope_theta * (s.factor * reached / original - (s.factor - 1)) ** (d / (d - 2))
    return _plain_frequencies(base, d)


def table_scale(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's or LongRoPE's attention factor, 1 otherwise."""
    s = cfg.rope_scaling
    if s is not None and s.kind == "longrope":
        return float(s.attention_factor)
    if s is None or s.kind != "yarn":
        return 1.0
    return float(s.attention_factor) if s.attention_factor is not None else yarn_attention_factor(s.factor)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin scale for a stretch ``factor``: 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scaled(inv: jax.Array, s: RopeScaling, head_dim: int, theta: float) -> jax.Array:
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "factors":  # as many as frequencies (ModelConfig checks)
        return inv / jnp.asarray(s.frequency_factors, jnp.float32)
    if s.kind == "llama3":
        # wavelengths longer than original / low_freq_factor are divided by the factor, shorter than
        # original / high_freq_factor kept; between, a ramp in original / wavelength
        wavelength = 2 * math.pi / inv
        ramp = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        ramp = jnp.clip(ramp, 0.0, 1.0)
        return (1 - ramp) * inv / s.factor + ramp * inv
    # yarn: dimension i keeps its frequency where it turns more than beta_fast times over the original
    # context, is divided by the factor where less than beta_slow times, a linear ramp between
    def dimension(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # one dimension wide: a step
    divided = jnp.clip((jnp.arange(inv.shape[0], dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv / s.factor * divided + inv * (1 - divided)


class RopeTables(NamedTuple):
    """A step's cos and sin tables (T, head_dim / 2) each, computed once and shared by the layers: ``full``
    for every layer, but ``sliding`` (when the config has a ``local_rope_theta``) for those with a window."""

    full: tuple[jax.Array, jax.Array]
    sliding: tuple[jax.Array, jax.Array] | None

    def for_window(self, window: int | None) -> tuple[jax.Array, jax.Array]:
        """The tables of a layer that attends within ``window`` (None: no window)."""
        return self.sliding if window is not None and self.sliding is not None else self.full


# Steps of more positions than this compute their tables once (``_tables``); decode steps' are a few
# vectors, for which the copies cost nothing and a conditional would.
ONCE_ABOVE_POSITIONS = 8


def rope_tables(positions: jax.Array, cfg: ModelConfig, length: jax.Array | None = None) -> RopeTables:
    """The rotary tables of a step at ``positions``: (T,), or (B, T) when each sequence of a batch is at
    its own position (batched decoding); ``length``: the positions the step reaches (dynamic scaling's)."""
    return RopeTables(_tables(positions, inverse_frequencies(cfg, length), table_scale(cfg)),
                      None if cfg.local_rope_theta is None else
                      _tables(positions, _plain_frequencies(cfg.local_rope_theta, cfg.head_dim), 1.0))


def _tables(positions: jax.Array, inverse: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    if inverse.ndim == 2:  # one set per sequence (dynamic scaling of a batch)
        inverse = inverse[:, None, :]
    def compute(angles):
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)

    angles = positions.astype(jnp.float32)[..., None] * inverse
    if positions.size <= ONCE_ABOVE_POSITIONS:
        return compute(angles)
    # Computed once on the CPU: XLA:CPU fused cos and sin into every consumer, 60 copies of the tables in the
    # default model's prefill (q and k of 30 layers), 4-5% of a 1024-token prefill (2-core Intel Xeon VM,
    # 2026-12-06, three alternated runs each: 952-976 -> 992-1021 tok/s). A conditional is a boundary fusion
    # does not cross (an optimization barrier is dropped before fusion); both branches are the same
    # computation, and the predicate only has to be one XLA cannot fold. Not on GPUs, where a conditional
    # reads its predicate back to the host.
    once = lambda angles: jax.lax.cond(positions.reshape(-1)[0] >= 0, compute, compute, angles)
    return jax.lax.platform_dependent(angles, cpu=once, default=compute)


def rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding, Hugging Face's rotate-half layout. x: (B, T, H, hd); tables (T, hd/2) shared by
    the batch, or (B, T, hd/2) one row per sequence."""
    cos, sin = (t[..., None, :] for t in tables)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
