"""Batched decoding: up to ``slots`` sequences share each decode step, joining and leaving at step
boundaries (continuous batching), each with its own prompt, sampling settings, seed and stop strings.

Layout: one KV cache of ``slots`` sequences with a length per sequence (``KVCache.create(...,
per_sequence=True)``), so every sequence decodes at its own position in the same static-shaped step;
free slots ride along (their rows are computed and dropped, their length held at 0). A new sequence
is prefilled alone, into a one-sequence cache of the same capacity kept for the next one, and its
prompt's slots are copied into its row; its first token is sampled then, like the rest, with
``sampling.sample_rows`` (per-row settings traced: one compiled step for any mix of requests).

A request's output does not depend on what else is in the batch: attention reads only its own row
(per-row positions), every mode's FFN keeps each token's own neurons (the sparse modes' union of
rows is read once, with each token's own selection; ``ffn.listed``, ``modes.hybrid``), and the sampler
gives each row what it gives that request alone. Products over a batch may round differently from
one token's (a matrix product of 8 rows is not 8 matrix-vector products), so equal greedy outputs
hold up to near-ties of the logits (tests check the margin where they differ).

Why batch: a decode step reads every weight once however many sequences it carries (the default
model's float32 step reads ~540 MB), so on a memory-bound CPU 8 sequences cost little more than one
(bench/serve.py measures it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.models.transformer import KVCache
from jpinfer.runtime.generation import (
    MIN_PROMPT_BUCKET,
    GenerationConfig,
    GenerationResult,
    TextStream,
    attend_length,
    cache_capacity,
    generation_shapes,
    warn_if_crossing_longrope,
)
from jpinfer.runtime.sampling import sample_rows

MAX_SLOTS = 8  # the native kernels take up to 8 tokens a call


class BatchEngine(Protocol):
    """What batched decoding needs of an ``Engine``."""

    cfg: ModelConfig
    stepper: Any

    def decode_text(self, ids: list[int]) -> str: ...

    def eos_ids(self) -> set[int]: ...


@dataclasses.dataclass(eq=False)
class BatchedRequest:
    """One sequence of a ``BatchDecoder``. ``pieces`` collects the text safe to show as it comes (the
    caller drains it); ``result`` is set once it has finished (then it has left the batch)."""

    prompt_ids: list[int]
    config: GenerationConfig
    slot: int
    max_new: int
    text: TextStream
    eos_ids: set[int]
    prefill_s: float = 0.0
    step_s: list[float] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    result: GenerationResult | None = None
    _last: float = 0.0

    @property
    def position(self) -> int:
        """The position of the token this sequence feeds the next step."""
        return len(self.prompt_ids) + len(self.text.ids) - 1

    def take(self, token_id: int, now: float) -> None:
        """Add the sampled token; finish on an end-of-sequence id, a completed stop string or the length."""
        finish = None
        if token_id in self.eos_ids:
            finish = "eos"
        else:
            piece = self.text.push(token_id)
            if piece:
                self.pieces.append(piece)
            if self.text.stopped:
                finish = "stop"
            elif len(self.text.ids) >= self.max_new:
                finish = "length"
        if self._last:
            self.step_s.append(now - self._last)
        self._last = now
        if finish is not None:
            tail = self.text.rest()
            if tail:
                self.pieces.append(tail)
            self.result = GenerationResult(self.text.text, list(self.text.ids), self.prompt_ids, finish,
                                           self.prefill_s, self.step_s)


@functools.partial(jax.jit, static_argnames=("used",), donate_argnames=("batch",))
def _insert(batch: KVCache, one: KVCache, slot: jax.Array, *, used: int) -> KVCache:
    """The batch cache with a one-sequence cache's first ``used`` slots and its length in row ``slot``."""
    put = lambda rows, new: jax.lax.dynamic_update_slice(rows, new[:, :, :used], (slot, 0, 0, 0))
    return KVCache([put(b, o) for b, o in zip(batch.k, one.k)], [put(b, o) for b, o in zip(batch.v, one.v)],
                   batch.length.at[slot].set(one.length))


@jax.jit
def _settle(logits, keys, temperature, top_k, top_p, active, lengths):
    """Sample every row, and hold the free rows' lengths at 0 (a free row never outgrows the cache)."""
    tokens, keys = sample_rows(logits, keys, temperature, top_k, top_p)
    return tokens, keys, jnp.where(active, lengths, 0)


class BatchDecoder:
    """Up to ``slots`` sequences decoded together over one engine, ``capacity`` cache slots each.

    ``add`` prefills a sequence into a free slot (and samples its first token), ``step`` advances every
    running sequence by one token, ``remove`` drops one (a client gone); finished sequences leave at once.
    One thread drives it (its calls are not safe to interleave).
    """

    def __init__(self, engine: BatchEngine, slots: int, capacity: int) -> None:
        if not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be an integer in [1, {MAX_SLOTS}], got {slots!r}")
        if capacity < MIN_PROMPT_BUCKET:
            raise ValueError(f"capacity must be at least {MIN_PROMPT_BUCKET} cache slots, got {capacity}")
        self.engine = engine
        self.stepper = engine.stepper
        self.capacity = cache_capacity(capacity, engine.cfg.max_position)
        self.cache = self.stepper.new_cache(self.capacity, slots, per_sequence=True)
        self._prefill_cache = self.stepper.new_cache(self.capacity)
        self.running: list[BatchedRequest | None] = [None] * slots
        self._tokens = np.zeros(slots, np.int32)
        self._keys = jnp.zeros((slots, 2), jnp.uint32)
        self._temperature = np.zeros(slots, np.float32)
        self._top_k = np.zeros(slots, np.int32)
        self._top_p = np.ones(slots, np.float32)

    @property
    def slots(self) -> int:
        return len(self.running)

    @property
    def free_slots(self) -> int:
        return self.running.count(None)

    @property
    def busy(self) -> bool:
        return self.free_slots < self.slots

    def check(self, n_prompt: int) -> None:
        """A ValueError when a prompt of n tokens leaves no room for a token in this decoder's slots."""
        self._prompt_bucket(n_prompt)

    def _prompt_bucket(self, n_prompt: int) -> int:
        """The padded length a prompt of n tokens prefills at (``check``'s errors first)."""
        if n_prompt >= self.capacity:
            raise ValueError(f"prompt has {n_prompt} tokens but this decoder's context is {self.capacity} tokens: "
                             "shorten the prompt")
        return min(generation_shapes(n_prompt, 1, self.engine.cfg.max_position)[0], self.capacity)

    def add(self, prompt_ids: list[int], config: GenerationConfig) -> BatchedRequest:
        """Prefill a prompt into a free slot and sample its first token; it decodes from the next ``step``.
        At most ``capacity`` positions in all: ``max_new_tokens`` is cut to what fits, as ``Engine.generate``
        cuts it to the model's context."""
        if not self.free_slots:
            raise RuntimeError("no free slot: step until a sequence finishes, or remove one")
        n = len(prompt_ids)
        bucket = self._prompt_bucket(n)
        max_new = min(config.max_new_tokens, self.capacity - n)
        warn_if_crossing_longrope(self.engine.cfg, n, max_new)
        slot = self.running.index(None)
        t0 = time.perf_counter()
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = prompt_ids
        cache = dataclasses.replace(self._prefill_cache, length=jnp.zeros((), jnp.int32))
        logits, cache = self.stepper.first_logits(jnp.asarray(padded), jnp.int32(n), cache,
                                                  attend_length(bucket, self.capacity))
        self.cache = _insert(self.cache, cache, jnp.int32(slot), used=bucket)
        self._prefill_cache = cache
        sampler = config.sampler
        self._temperature[slot], self._top_k[slot] = sampler.temperature, sampler.top_k
        self._top_p[slot] = sampler.top_p
        token, key = sample_rows(logits, jax.random.PRNGKey(config.seed)[None], self._temperature[slot:slot + 1],
                                 self._top_k[slot:slot + 1], self._top_p[slot:slot + 1])
        self._keys = self._keys.at[slot].set(key[0])
        eos = set() if config.ignore_eos else self.engine.eos_ids()
        stream = TextStream(self.engine.decode_text, config.stop)
        request = BatchedRequest(list(prompt_ids), config, slot, max_new, stream, eos)
        token_id = int(np.asarray(token)[0])
        now = time.perf_counter()
        request.prefill_s = now - t0
        request.take(token_id, now)
        if request.result is None:
            self.running[slot] = request
            self._tokens[slot] = token_id
        return request

    def remove(self, request: BatchedRequest) -> None:
        """Drop a running sequence (its client is gone); its slot is free for the next ``add``."""
        if self.running[request.slot] is request:
            self.running[request.slot] = None

    def step(self) -> list[BatchedRequest]:
        """One decode step for every running sequence; returns them (each has taken one token; the
        finished ones have a ``result`` and have left the batch)."""
        running = [r for r in self.running if r is not None]
        if not running:
            return []
        attend = attend_length(max(r.position for r in running) + 1, self.capacity)
        logits, cache = self.stepper.step_logits(jnp.asarray(self._tokens), self.cache, attend)
        active = np.array([r is not None for r in self.running])
        tokens, self._keys, lengths = _settle(logits, self._keys, self._temperature, self._top_k, self._top_p,
                                              active, cache.length)
        self.cache = dataclasses.replace(cache, length=lengths)
        ids = np.asarray(tokens)
        now = time.perf_counter()
        for request in running:
            request.take(int(ids[request.slot]), now)
            if request.result is None:
                self._tokens[request.slot] = ids[request.slot]
            else:
                self.running[request.slot] = None
        return running


def generate_together(engine: BatchEngine, prompts: list[list[int]], config: GenerationConfig,
                      slots: int = MAX_SLOTS) -> list[GenerationResult]:
    """Each prompt's ``GenerationResult`` (in order), decoded up to ``slots`` at a time: a prompt joins
    as soon as one before it finishes. Every prompt is checked against the context before any runs."""
    if not prompts:
        return []
    shapes = [generation_shapes(len(p), config.max_new_tokens, engine.cfg.max_position) for p in prompts]
    decoder = BatchDecoder(engine, min(slots, len(prompts)), max(capacity for _, capacity, _ in shapes))
    pending = collections.deque(range(len(prompts)))
    results: dict[int, GenerationResult] = {}
    index: dict[BatchedRequest, int] = {}  # requests hash by identity
    while pending or decoder.busy:
        while pending and decoder.free_slots:
            i = pending.popleft()
            request = decoder.add(prompts[i], config)
            index[request] = i
            if request.result is not None:
                results[i] = request.result
        for request in decoder.step():
            if request.result is not None:
                results[index[request]] = request.result
    return [results[i] for i in range(len(prompts))]
