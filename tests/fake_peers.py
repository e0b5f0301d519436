"""Bench peers that misbehave on purpose, importable by the child processes of ``jpinfer.bench.child``."""

from __future__ import annotations

import os
import pathlib
import signal
import time

from jpinfer.bench.engines import RunStats

CRASH_SUFFIX = ".crash"  # a model path ending so makes FakePeer die in its first timed run


class FakePeer:
    """A peer answering every prompt with its tokens reversed; ``how``: what goes wrong in ``run``."""

    weight_bytes_per_token = 123

    def __init__(self, model_path: os.PathLike | str, n_threads: int = 2, label: str | None = None, how: str = "",
                 n_ctx: int = 2048, repack: bool = True) -> None:
        path = pathlib.Path(model_path)
        self.how = "segfault" if path.suffix == CRASH_SUFFIX else how
        if self.how == "fail to load":
            raise OSError(f"cannot open {path}")
        self.name = f"fake peer {path.name}" + ("" if repack else " without repacking")
        self.repack = repack
        self.n_ctx = n_ctx
        self.pid = os.getpid()

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats:
        if self.how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.how == "exit":
            os._exit(3)
        if self.how == "raise":
            raise ValueError("bad prompt")
        if self.how == "hang":
            time.sleep(60)
        tokens = (list(reversed(prompt_ids)) * max_new_tokens)[:max_new_tokens]
        return RunStats(len(prompt_ids), tokens, 0.001, [0.001] * (max_new_tokens - 1))

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        """Untimed; fails only as llama.cpp's weight repacking did (how "repacking crashes")."""
        if self.how == "repacking crashes" and self.repack:
            os.kill(os.getpid(), signal.SIGSEGV)

    def perplexity(self, windows) -> float:
        return float(len(windows)) + 1.5

    def process_id(self) -> int:
        return self.pid

    def context(self) -> int:
        return self.n_ctx

    @staticmethod
    def available() -> bool:
        return True


class RepackingCrashPeer(FakePeer):
    """A peer that dies in its first decode unless loaded without weight repacking (llama.cpp's AMX case)."""

    def __init__(self, model_path: os.PathLike | str, n_threads: int = 2, label: str | None = None,
                 n_ctx: int = 2048, repack: bool = True) -> None:
        super().__init__(model_path, n_threads, label, how="repacking crashes", n_ctx=n_ctx, repack=repack)
