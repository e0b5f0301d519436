"""Token sampling on device: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Static sampling mode; one compiled step per distinct mode.

    temperature == 0 means greedy. ``top_k`` = 0 disables top-k; ``top_p`` = 1 disables
    nucleus filtering (and its vocabulary sort).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, sampler: Sampler) -> jax.Array:
    """Next token ids (B,) from float32 logits (B, V)."""
    if sampler.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampler.temperature
    if sampler.top_k:
        kth = jax.lax.top_k(logits, min(sampler.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampler.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff_index = jnp.sum(mass_before < sampler.top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_next(logits: jax.Array, key: jax.Array, sampler: Sampler) -> tuple[jax.Array, jax.Array]:
    """(next token ids (B,), the key for the step after): one sample per step, a fresh subkey each."""
    key, sub = jax.random.split(key)
    return sample(logits, sub, sampler), key


sample_next_jit = jax.jit(sample_next, static_argnames=("sampler",))  # for steps made of several jitted calls
