"""Text generation on top of the decoder: prompts, sampling loop, streaming, stops, timing."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpinfer.config import ModelConfig
from jpinfer.host_heap import release_freed_heap
from jpinfer.models import transformer
from jpinfer.models.loading import LoadedModel
from jpinfer.models.params import Weights
from jpinfer.runtime.batch import BatchDecoder, generate_together
from jpinfer.runtime.chat import chat_ids
from jpinfer.runtime.generation import (
    GenerationConfig,
    GenerationResult,
    TextStream,
    attend_length,
    generation_shapes,
    warn_if_crossing_longrope,
)
from jpinfer.runtime.sampling import Sampler, sample_next


@dataclasses.dataclass(frozen=True)
class FfnStrategy:
    """How the decoder computes each layer's FFN: the engine's pluggable part.

    ``impl`` is a static, hashable ``transformer.FfnImpl`` (part of the compiled step; None
    = the dense FFN) and ``state`` its traced per-layer pytree (indexed by layer). Sparse
    modes (oracle masks, predictors, hybrid placement) are strategies; attention, sampling
    and the generation loop do not change with them.
    """

    impl: transformer.FfnImpl | None = None
    state: Any = None
    name: str = "dense"
    # What ``impl`` refers to without holding (the hybrid's cold neurons on the host): kept alive by the engine;
    # an engine with it refuses with_ffn (part of its FFN lives on another device)
    held: Any = None


DENSE = FfnStrategy()


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "ffn_impl", "attend"), donate_argnames=("cache",))
def _first_token(weights, tokens, n_valid, cache, key, cfg, sampler, ffn_impl=None, ffn_state=None, attend=None):
    step_logits, cache = transformer.prefill(weights, tokens, n_valid, cache, cfg, ffn_impl, ffn_state, attend)
    token, key = sample_next(step_logits, key, sampler)
    return token, cache, key


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "ffn_impl", "attend"), donate_argnames=("cache",))
def _next_token(weights, token, cache, key, cfg, sampler, ffn_impl=None, ffn_state=None, attend=None):
    step_logits, cache = transformer.decode_step(weights, token, cache, cfg, ffn_impl, ffn_state, attend)
    token, key = sample_next(step_logits, key, sampler)
    return token, cache, key


class Stepper(Protocol):
    """How an engine runs its model: the KV cache, the prefill that samples the first token,
    and one decode step. ``attend`` is the static number of cache slots attention reads.

    ``new_cache(capacity, batch, per_sequence)``: ``batch`` sequences of ``capacity`` slots; with
    ``per_sequence`` each sequence has a length of its own (``runtime.batch``: every step then takes one
    token per sequence, each at its own position)."""

    name: str

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> Any: ...

    def first_logits(self, tokens: jax.Array, n_valid: jax.Array, cache: Any, attend: int) -> tuple[jax.Array, Any]:
        """Prefill a right-padded prompt (1, T) of which ``n_valid`` tokens are real: (float32 logits (1, V) at the
        last real position, the cache holding the prompt)."""
        ...

    def first(self, tokens: jax.Array, n_valid: jax.Array, cache: Any, key: jax.Array, sampler: Sampler,
              attend: int) -> tuple[jax.Array, Any, jax.Array]: ...

    def next(self, token: jax.Array, cache: Any, key: jax.Array, sampler: Sampler,
             attend: int) -> tuple[jax.Array, Any, jax.Array]: ...

    def step_logits(self, token: jax.Array, cache: Any, attend: int) -> tuple[jax.Array, Any]:
        """The decode step's float32 logits (B, V) for tokens (B,), unsampled (tests, scoring)."""
        ...


@dataclasses.dataclass(frozen=True)
class FusedStepper:
    """The whole step as one jitted function, its FFN computed by ``ffn`` (dense, oracle masks, the
    predictor-driven sparse FFN, or the hybrid's two parts, the cold one called on the host from the step)."""

    model: LoadedModel
    ffn: FfnStrategy = DENSE

    @property
    def name(self) -> str:
        return self.ffn.name

    def new_cache(self, capacity: int, batch: int = 1, per_sequence: bool = False) -> transformer.KVCache:
        return transformer.KVCache.create(self.model.cfg, batch, capacity, self.model.weights.dtype,
                                          per_sequence=per_sequence)

    def first_logits(self, tokens, n_valid, cache, attend):
        return transformer.prefill(self.model.weights, tokens, n_valid, cache, self.model.cfg, self.ffn.impl,
                                   self.ffn.state, attend)

    def first(self, tokens, n_valid, cache, key, sampler, attend):
        return _first_token(self.model.weights, tokens, n_valid, cache, key, self.model.cfg, sampler, self.ffn.impl,
                            self.ffn.state, attend)

    def next(self, token, cache, key, sampler, attend):
        return _next_token(self.model.weights, token, cache, key, self.model.cfg, sampler, self.ffn.impl,
                           self.ffn.state, attend)

    def step_logits(self, token, cache, attend):
        return transformer.decode_step(self.model.weights, token, cache, self.model.cfg, self.ffn.impl, self.ffn.state,
                                       attend)


class Engine:
    """A loaded model ready to generate, with an FFN strategy (dense by default).

    Create it with ``jpinfer.load``; ``with_ffn`` gives an engine over the same weights with
    another strategy. ``stepper`` replaces the one-jitted-step runner (the bench's layer offload
    runs whole layers per device); ``ffn`` is then ignored.
    """

    def __init__(self, model: LoadedModel, ffn: FfnStrategy = DENSE, stepper: Stepper | None = None) -> None:
        self.model = model
        self.ffn = ffn
        self.stepper = stepper or FusedStepper(model, ffn)
        self._warm: set[tuple] = set()
        release_freed_heap()  # what building the weights' layouts freed (host_heap)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def weights(self) -> Weights:
        return self.model.weights

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def source(self) -> str:
        return self.model.source

    @property
    def dtype(self):
        return self.weights.dtype

    def with_ffn(self, ffn: FfnStrategy) -> "Engine":
        """An engine over the same model (no copy of the weights) that computes FFNs with ``ffn``."""
        if not isinstance(self.stepper, FusedStepper) or self.ffn.held is not None:
            raise ValueError(f"with_ffn needs a one-device engine; this one runs {self.stepper.name!r}")
        return Engine(self.model, ffn)

    def __repr__(self) -> str:
        return (
            f"Engine({self.cfg.name!r}, layers={self.cfg.n_layers}, d_model={self.cfg.d_model}, "
            f"dtype={self.dtype}, ffn={self.stepper.name})"
        )

    # ----- prompts
    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        """Token ids for a text prompt, a list of chat messages, or a list of ids.

        With ``chat=True`` a text prompt becomes one user message; a list of
        ``{"role", "content"}`` messages always goes through the chat template (whose text carries
        the model's BOS where it wants one); message contents are tokenized as plain text, so control
        tokens written in them stay text (``runtime.chat``). Plain text gets the tokenizer's own special tokens, as
        transformers' ``tokenizer(text)`` and llama.cpp add them: a BOS for Llama 2/3 and Gemma, whose
        outputs degrade without it; none for the default model.
        """
        is_messages = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)
        if isinstance(prompt, str) or is_messages:
            if not prompt:
                raise ValueError("prompt is empty: give some text or token ids")
            if self.tokenizer is None:
                raise ValueError("this model was loaded without a tokenizer: pass token ids instead of text")
            if chat or is_messages:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("chat=True, but the model has no chat template")
                return chat_ids(self.tokenizer, prompt if is_messages else [{"role": "user", "content": prompt}])
            return [int(i) for i in self.tokenizer.encode(prompt, add_special_tokens=True)]
        ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise ValueError("prompt is empty: give some text or token ids")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        return ids

    def eos_ids(self) -> set[int]:
        """The token ids that end a generation: the config's and the tokenizer's."""
        ids = set(self.cfg.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return ids

    def decode_text(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out ('' without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----- generation
    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **kwargs) -> Iterator[str]:
        """Yield text pieces as they are generated (stop strings are never yielded)."""
        events = self.events(prompt, config or GenerationConfig(**kwargs))
        for piece in events:
            if isinstance(piece, str):
                yield piece

    def generate(
        self, prompt: str | Sequence[int] | Sequence[str], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (text or token ids) or a list of text prompts. A list is decoded
        together (``runtime.batch``: up to ``batch.MAX_SLOTS`` sequences a step, each as it would be alone)."""
        config = config or GenerationConfig(**kwargs)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return generate_together(self, [self.encode_prompt(p, chat=config.chat) for p in prompt], config)
        result = None
        for event in self.events(prompt, config):
            if isinstance(event, GenerationResult):
                result = event
        return result

    def _shapes(self, n_prompt: int, max_new_tokens: int) -> tuple[int, int, int]:
        return generation_shapes(n_prompt, max_new_tokens, self.cfg.max_position)

    def batch_decoder(self, slots: int, capacity: int) -> BatchDecoder:
        """A decoder of up to ``slots`` sequences together, ``capacity`` cache slots each (``runtime.batch``)."""
        return BatchDecoder(self, slots, capacity)

    def _start(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler, seed: int):
        """Prefill and sample the first token; returns (token, cache, key, tokens that fit)."""
        n = len(prompt_ids)
        bucket, capacity, max_new = self._shapes(n, max_new_tokens)
        warn_if_crossing_longrope(self.cfg, n, max_new)
        cache = self.stepper.new_cache(capacity)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = prompt_ids
        token, cache, key = self.stepper.first(
            jnp.asarray(padded), jnp.int32(n), cache, jax.random.PRNGKey(seed), sampler,
            attend_length(bucket, capacity),
        )
        return token, cache, key, max_new

    def _step(self, token, cache, key, sampler: Sampler, position: int):
        """Decode the token at ``position`` (the number of positions already in the cache)."""
        return self.stepper.next(token, cache, key, sampler, attend_length(position + 1, cache.capacity))

    def warmup(self, n_prompt_tokens: int, config: GenerationConfig | None = None) -> None:
        """Compile prefill and decode for this prompt length and config, so that the first
        generation is not slowed by compilation. Returns at once when already compiled."""
        config = config or GenerationConfig()
        bucket, capacity, max_new = self._shapes(n_prompt_tokens, config.max_new_tokens)
        key = (bucket, capacity, max_new, config.sampler)
        if key in self._warm:
            return
        token, cache, rng, _ = self._start([0] * n_prompt_tokens, config.max_new_tokens, config.sampler, 0)
        # one decode step per attention length the generation will reach
        lengths = {attend_length(p + 1, capacity): p for p in range(n_prompt_tokens, n_prompt_tokens + max_new)}
        for position in lengths.values():
            token, cache, rng = self._step(token, cache, rng, config.sampler, position)
        jax.block_until_ready(token)
        self._warm.add(key)
        del token, cache, rng
        release_freed_heap()  # what compiling and this run freed (host_heap)

    def device_step_seconds(self, prompt_ids: list[int], n_steps: int, config: GenerationConfig | None = None) -> float:
        """Mean decode step time with no host round trip between steps (the loop's lower bound).
        Compiles first (``warmup``), so no compilation is timed."""
        return self.step_times(prompt_ids, n_steps, config)[0]

    def step_times(self, prompt_ids: list[int], n_steps: int,
                   config: GenerationConfig | None = None) -> tuple[float, float]:
        """(mean device step time, mean host time to dispatch a step) over ``n_steps`` steps
        queued back to back. Dispatch returns before the device is done, so a dispatch time
        close to the step time means the host, not the device, sets the pace."""
        config = config or GenerationConfig(max_new_tokens=n_steps + 1)
        n = len(prompt_ids)
        self.warmup(n, config)
        token, cache, key, _ = self._start(prompt_ids, config.max_new_tokens, config.sampler, config.seed)
        token, cache, key = jax.block_until_ready(self._step(token, cache, key, config.sampler, n))
        t0 = time.perf_counter()
        for i in range(n_steps):
            token, cache, key = self._step(token, cache, key, config.sampler, n + 1 + i)
        dispatched = time.perf_counter()
        jax.block_until_ready(token)
        return (time.perf_counter() - t0) / n_steps, (dispatched - t0) / n_steps

    def events(self, prompt, config: GenerationConfig) -> Iterator[str | GenerationResult]:
        """Yield text pieces as they are generated, then the GenerationResult (streaming with stats).

        The device never waits for the host: the step that produces token i + 1 is dispatched
        (asynchronously, from token i still on the device) before token i is read back, so the
        read, detokenizing, stop strings and the consumer's work overlap the device's next step.
        Token i is read as a host copy of its buffer (``np.asarray``), not with ``token[0]``: that
        indexing is itself a device computation, queued behind step i + 1, and waited for it.
        At most one step past the end (EOS, a stop string) is computed and discarded.
        ``step_s`` holds the time between consecutive tokens.
        """
        prompt_ids = self.encode_prompt(prompt, chat=config.chat)
        sampler, n = config.sampler, len(prompt_ids)
        eos_ids = set() if config.ignore_eos else self.eos_ids()
        t0 = time.perf_counter()
        token, cache, key, max_new = self._start(prompt_ids, config.max_new_tokens, sampler, config.seed)
        ahead = self._step(token, cache, key, sampler, n) if max_new > 1 else None
        token_id = int(np.asarray(token)[0])
        last = time.perf_counter()
        prefill_s = last - t0

        text = TextStream(self.decode_text, config.stop)
        step_s: list[float] = []
        finish = "length"
        while token_id not in eos_ids:
            piece = text.push(token_id)
            if piece:
                yield piece
            if text.stopped:
                finish = "stop"
                break
            if ahead is None:
                break
            token, cache, key = ahead
            ahead = self._step(token, cache, key, sampler, n + len(text.ids)) if len(text.ids) + 1 < max_new else None
            token_id = int(np.asarray(token)[0])
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        else:
            finish = "eos"
        tail = text.rest()  # the held-back tail: no stop string completed it
        if tail:
            yield tail
        yield GenerationResult(text.text, text.ids, prompt_ids, finish, prefill_s, step_s)
