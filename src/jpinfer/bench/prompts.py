"""The bench's prompts: exact token lengths, sampled with a seed from real instruction sets.

The PowerInfer paper's protocol (Song et al., 2023): prompts from the ChatGPT prompts and Alpaca
sets at input lengths 8, 64 and 128 tokens, 128 output tokens, batch 1. Here each prompt of a
given length is the tokens of sampled instructions of both bundled sets (ChatGPT role prompts and
Alpaca instructions, in a seeded random order), joined by blank lines until there are enough, cut
to exactly that length; no chat template (it alone would be ~30 tokens), so the length is the
prompt's.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from jpinfer.data import alpaca_prompts, chatgpt_prompts


def instruction_pool() -> list[str]:
    """Every prompt the bench samples from: the ChatGPT prompts, then the Alpaca instructions."""
    return chatgpt_prompts() + alpaca_prompts()


def sample_prompts(tokenizer: Any, lengths: Sequence[int], rounds: int, seed: int = 0) -> dict[int, list[list[int]]]:
    """Per length, ``rounds`` token lists of exactly that length (a different text each round).

    The same seed gives the same prompts, whatever the lengths asked for (each length draws from
    its own generator).
    """
    pool = instruction_pool()
    out: dict[int, list[list[int]]] = {}
    for length in lengths:
        if length < 1:
            raise ValueError(f"prompt lengths must be >= 1 token, got {length}")
        rng = np.random.default_rng([seed, length])
        order = itertools.cycle(rng.permutation(len(pool)).tolist())
        prompts = []
        for _ in range(rounds):
            ids: list[int] = []
            while len(ids) < length:
                ids += tokenizer.encode(("\n\n" if ids else "") + pool[next(order)], add_special_tokens=False)
            prompts.append([int(i) for i in ids[:length]])
        out[length] = prompts
    return out
