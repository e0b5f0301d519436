"""Timing for benches on a shared machine: variants alternate, the fastest call counts."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax


def fastest(calls: Sequence[Callable[[], object]], rounds: int, per_round: int = 3) -> list[float]:
    """Fastest seconds of each no-argument call, alternating between the calls in rounds of
    ``per_round`` calls each, so that a change in the machine's load hits every variant alike.

    The minimum, not the median: on a machine shared with other jobs the median mostly
    measures their load, while the fastest of many calls is the code's own speed. Each call
    runs once first (compilation, first touch), untimed.
    """
    for call in calls:
        jax.block_until_ready(call())
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            for _ in range(per_round):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                best[i] = min(best[i], time.perf_counter() - t0)
    return best
