"""What a generation is, apart from how a model runs: its settings, its result, its shapes (prompt
buckets, cache capacity, attention lengths) and its text (pieces as they come, stop strings).
Shared by the one-sequence loop (``engine``) and batched decoding (``batch``)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from jpinfer.config import ModelConfig
from jpinfer.runtime.sampling import Sampler

# The smallest prompt bucket: the native kernels' largest step (``native.kernels.MAX_TOKENS``), so a prompt of up to 8
# tokens runs their products, not XLA's: a 7-token prompt's first token took 72 ms in a bucket of 16 and 46 in one of
# 8 with float32 weights, 39 and 17 ms with int8 (default model, 2-core Zen 4 VM, 2026-12-06, medians of 7
# alternated runs, idle).
MIN_PROMPT_BUCKET = 8
CACHE_ROUNDING = 256  # cache capacities: powers of two up to it, then its multiples
MIN_ATTEND = 128  # each rung is one more compilation of the step; below 128 slots attention is cheap


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate. ``temperature`` 0 is greedy; the same ``seed`` gives the same output.
    ``ignore_eos`` generates ``max_new_tokens`` tokens whatever the model emits (fixed-length
    benchmarks; stop strings still stop)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    chat: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.sampler  # validates temperature, top_k, top_p

    @property
    def sampler(self) -> Sampler:
        return Sampler(float(self.temperature), int(self.top_k), float(self.top_p))


@dataclasses.dataclass
class GenerationResult:
    """One prompt's output. Times in seconds; ``finish_reason`` is 'eos', 'stop' or 'length'."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    prefill_s: float
    step_s: list[float]

    @property
    def decode_s(self) -> float:
        return float(sum(self.step_s))

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.step_s) / self.decode_s if self.step_s else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_token_ids) / self.prefill_s


def prompt_bucket(n: int) -> int:
    """Prompt lengths are padded to powers of two so prefill compiles a few times, not per length."""
    return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())


def cache_capacity(tokens: int, max_position: int) -> int:
    """KV cache slots for ``tokens`` positions: the next power of two up to CACHE_ROUNDING, then the next
    multiple of it (a few cache shapes, so a few compilations), at most the model's context.

    Why powers of two below CACHE_ROUNDING: a short generation's cache was 256 slots whatever it held; for a
    Llama-2-7B-shaped model in 4-bit blocks (3.86 GB of tensors) that float32 cache is 0.27 GB, and a 32-token
    prompt with 8 new tokens peaked at 4.56 GB with 256 slots against 4.41 with 64 (one process, 2026-12-06,
    2-core Zen 4 VM). Attention reads ``attend_length`` slots either way, so a smaller cache only saves memory."""
    tokens = max(int(tokens), 1)
    if tokens <= CACHE_ROUNDING:
        return min(max(MIN_PROMPT_BUCKET, 1 << (tokens - 1).bit_length()), max_position)
    return min(-(-tokens // CACHE_ROUNDING) * CACHE_ROUNDING, max_position)


def generation_shapes(n_prompt: int, max_new_tokens: int, max_position: int) -> tuple[int, int, int]:
    """(prompt bucket, KV cache capacity, tokens that fit) for a prompt of n tokens; a ValueError when the
    prompt leaves no room in the model's context."""
    if n_prompt >= max_position:
        raise ValueError(f"prompt has {n_prompt} tokens but the model's context is {max_position}: shorten the prompt")
    max_new = min(max_new_tokens, max_position - n_prompt)
    bucket = prompt_bucket(n_prompt)
    return bucket, max(bucket, cache_capacity(bucket + max_new, max_position)), max_new


def warn_if_crossing_longrope(cfg: ModelConfig, n_prompt: int, max_new_tokens: int) -> None:
    """Warn when a generation can cross a LongRoPE model's original context: from that step on jpinfer keeps the
    cached keys (rotated with the short factors), where transformers' Phi-3 re-encodes the whole sequence with the
    long ones, so the two generations differ."""
    s = cfg.rope_scaling
    if s is not None and s.kind == "longrope" and n_prompt <= s.original_max_position < n_prompt + max_new_tokens:
        warnings.warn(f"this generation can run past the {s.original_max_position} positions of {cfg.name}'s "
                      "original context (LongRoPE): from there jpinfer keeps the keys rotated with the short factors, "
                      "where transformers' Phi-3 re-encodes the sequence with the long ones", stacklevel=3)


def attend_length(n: int, capacity: int) -> int:
    """Cache slots a step reads to see n positions: the next of 128, 192, 256, 384, 512, ...
    (each step of the ladder at most 1.5x the last), capped at the cache capacity.

    Attention then reads at most 1.5x the used part of the cache (or 128 slots) instead of all
    of it, and a generation compiles the decode step once per rung it reaches (a few times),
    not per position; starting at 128 keeps short generations to one compilation. Reading all 512
    slots of a cache instead of the used prefix made a default-model decode step 1.13-1.15x slower
    (docs/architecture.md).
    """
    length = MIN_ATTEND
    while length < n:
        length = length * 3 // 2 if length & (length - 1) == 0 else length // 3 * 4
    return min(length, capacity)


class TextStream:
    """A generation's text as its tokens come: the new pieces safe to show (never the start of a stop
    string that may yet complete, never half a character) and where a stop string ends it. The one-sequence
    loop and batched decoding both go through it, so their texts and stops agree by construction."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._shown = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became safe to show ('' for none). When a stop string completes,
        ``stopped`` turns True and ``text`` ends before it."""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        cut = _find_stop(text, self.stops)
        if cut is not None:
            text, self.stopped = text[:cut], True
        self.text = text
        safe = len(text) if cut is not None else _safe_prefix(text, self.stops)
        if safe <= self._shown:
            return ""
        piece, self._shown = text[self._shown : safe], safe
        return piece

    def rest(self) -> str:
        """The held-back tail, once the generation ended without completing a stop string."""
        piece, self._shown = self.text[self._shown :], max(self._shown, len(self.text))
        return piece


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of text that can be shown: hold back an incomplete character and any stop-string prefix."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end = min(end, len(text[:end]) - k)
                break
    return end
