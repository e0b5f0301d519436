"""The engines the bench compares. Adding one is a small class with ``name``, ``warm`` and ``run``.

Every engine runs the bench's protocol: greedy, exactly ``max_new_tokens`` tokens whatever the
model emits (end-of-sequence does not stop it), so every engine decodes the same number of steps.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from typing import Callable, Mapping, Protocol

from jpinfer.bench.protocol import Rounds, interleaved_rounds, load_average
from jpinfer.runtime.engine import Engine
from jpinfer.runtime.generation import GenerationConfig


@dataclasses.dataclass
class RunStats:
    """One prompt's timings: prefill (to the first token) and each later decode step."""

    n_prompt: int
    tokens: list[int]
    prefill_s: float
    step_s: list[float]

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.step_s)


class BenchEngine(Protocol):
    name: str
    weight_bytes_per_token: int  # bytes read from weights per decoded token (0 = unknown)

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        """Compile or load whatever a run of this shape needs, untimed."""

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats: ...


def weights_read_per_token(engine: Engine) -> int:
    """Weight bytes one decode step reads: everything but an untied input embedding table
    (one row of it is read; a tied table is read whole as the head)."""
    from jpinfer.models.params import nbytes

    embed = engine.weights.embed
    return nbytes(engine.weights) - (0 if embed is None else int(embed.nbytes))


class JaxEngine:
    """Any jpinfer Engine, greedy, with compilation done before timing."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self.weight_bytes_per_token = weights_read_per_token(engine)

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        self.engine.warmup(n_prompt, GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True))

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats:
        config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
        self.engine.warmup(len(prompt_ids), config)
        result = self.engine.generate(prompt_ids, config)
        return RunStats(len(prompt_ids), result.token_ids, result.prefill_s, result.step_s)


class TransformersEager:
    """Hugging Face transformers' PyTorch eager model from the same checkpoint (optional peer)."""

    def __init__(self, source: str) -> None:
        import pathlib

        import torch
        import transformers

        path = pathlib.Path(source)
        kwargs = {"gguf_file": path.name} if path.is_file() else {}
        directory = path.parent if path.is_file() else path
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, **kwargs
        ).eval()
        self.name = f"transformers eager f32 ({torch.get_num_threads()} threads)"
        self.weight_bytes_per_token = 0

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("torch") is not None

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        self.run([0] * n_prompt, 2)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats:
        torch = self.torch
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            first = self.model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self.model.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
            total = time.perf_counter() - t0
        n_new = out.shape[1] - len(prompt_ids)
        per_step = max(total - prefill_s, 0.0) / max(n_new - 1, 1)
        tokens = out[0, len(prompt_ids) :].tolist()
        assert tokens[0] == first[0, -1].item()
        return RunStats(len(prompt_ids), tokens, prefill_s, [per_step] * (n_new - 1))


# ----- one engine over a list of prompts: what a round of the scripts' speed protocol runs


def run_prompts(engine: BenchEngine, prompts: list[list[int]], max_new_tokens: int) -> list[RunStats]:
    """Every prompt once, in order (one engine's turn in a round of ``protocol.interleaved_rounds``)."""
    return [engine.run(p, max_new_tokens) for p in prompts]


def warm_prompts(engine: BenchEngine, prompts: list[list[int]], max_new_tokens: int) -> Callable[[], None]:
    """The untimed warm-up for ``run_prompts``: ``warm`` once per distinct prompt length."""
    def warm() -> None:
        for n in sorted({len(p) for p in prompts}):
            engine.warm(n, max_new_tokens)
    return warm


def decode_tok_s(stats: list[RunStats]) -> float:
    """Decode tokens per second over the runs: all their decode steps over the steps' time."""
    return sum(len(s.step_s) for s in stats) / sum(sum(s.step_s) for s in stats)


def e2e_tok_s(stats: list[RunStats]) -> float:
    """End-to-end tokens per second: tokens out over prefill and decode time."""
    return sum(len(s.tokens) for s in stats) / sum(s.total_s for s in stats)


def prefill_tok_s(stats: list[RunStats]) -> float:
    """Prompt tokens per second of the prefills."""
    return sum(s.n_prompt for s in stats) / sum(s.prefill_s for s in stats)


def speed_rounds(engines: Mapping[str, BenchEngine], prompts: list[list[int]], max_new_tokens: int,
                 rounds: int, drop: type[BaseException] | None = None) -> tuple[Rounds[list[RunStats]], list[float]]:
    """The scripts' speed protocol: ``protocol.interleaved_rounds`` of ``run_prompts`` over the
    engines (each warmed for the prompts' lengths first, untimed), printing each round's decode
    tok/s; returns the rounds and the 1-minute load average at the start of each round. An engine
    raising ``drop`` (a peer's ``child.EngineFailed``) is dropped, said so, and kept in ``Rounds.errors``."""
    loads: list[float] = []

    def start(r: int, so_far: Rounds) -> bool:
        loads.append((load_average() or [float("nan")])[0])
        return True

    def report(r: int, so_far: Rounds) -> None:
        print(f"round {r + 1} (load {loads[-1]:.1f}): " + ", ".join(
            f"{name} {decode_tok_s(run.result):.1f}" for name, run in so_far.rounds[r].items()), flush=True)

    measured = interleaved_rounds(
        {name: (lambda r, e=engine: run_prompts(e, prompts, max_new_tokens)) for name, engine in engines.items()},
        rounds, warm={name: warm_prompts(engine, prompts, max_new_tokens) for name, engine in engines.items()},
        before_round=start, after_round=report, on_error=None if drop is None else dropped(drop))
    return measured, loads


def dropped(kind: type[BaseException]) -> Callable[[str, BaseException], None]:
    """An ``interleaved_rounds`` ``on_error`` that drops the engines raising ``kind`` and re-raises the rest."""
    def on_error(name: str, error: BaseException) -> None:
        if not isinstance(error, kind):
            raise error
        print(f"dropping {error}", file=sys.stderr, flush=True)  # the error names the engine (EngineFailed does)
    return on_error
