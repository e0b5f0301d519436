"""A bench engine in a process of its own: a peer that crashes or hangs fails alone.

llama.cpp's AMX weight repacking segfaulted inside its decode on an Intel Xeon VM (2026-12-02), and
in the bench's process that took every other engine's measurements with it. ``ChildEngine`` runs an
engine in a child process (``spawn``: nothing of jax's threads is forked) and forwards ``warm``,
``run`` and, where the engine has it, ``perplexity``; when the child dies (a signal, an exit), stops
answering within ``timeout_s``, or raises, the call raises ``EngineFailed`` naming the engine and how,
and the bench drops that engine and goes on (``protocol.interleaved_rounds``' ``on_error``).
The pipe adds a fraction of a millisecond per call, once per prompt: nothing per decode step.
"""

from __future__ import annotations

import multiprocessing
import signal
import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the child's module stays light: the parent imports it before any engine
    from jpinfer.bench.engines import RunStats

DEFAULT_TIMEOUT_S = 1800.0  # one call: the longest is a perplexity over many windows on 2 cores


class EngineFailed(RuntimeError):
    """An engine's process died, stopped answering or raised; the message says which engine and how."""


def _serve(conn: Any, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The child: build the engine, say what it is, then answer calls until told to stop."""
    try:
        engine = factory(*args, **kwargs)
        conn.send(("ok", {"name": engine.name,
                          "weight_bytes_per_token": getattr(engine, "weight_bytes_per_token", None),
                          "scores_itself": callable(getattr(engine, "perplexity", None))}))
    except Exception as err:  # noqa: BLE001 -- reported to the parent as this engine's failure
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    while (message := conn.recv()) is not None:
        method, call_args = message
        try:
            conn.send(("ok", getattr(engine, method)(*call_args)))
        except Exception as err:  # noqa: BLE001
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _stop(process: Any, conn: Any) -> None:
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


class ChildEngine:
    """``factory(*args, **kwargs)`` (a picklable callable: an engine class) built and run in a child
    process; the same ``BenchEngine`` interface (``name``, ``warm``, ``run``), plus ``perplexity`` when
    the engine measures its own."""

    def __init__(self, factory: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                 **kwargs: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, factory, args, kwargs), daemon=True)
        self.timeout_s = timeout_s
        self.name = getattr(factory, "__name__", str(factory))  # until the engine names itself
        self._process.start()
        child_conn.close()
        self._stopper = weakref.finalize(self, _stop, self._process, self._conn)
        info = self._answer()
        self.name, self.weight_bytes_per_token = info["name"], info["weight_bytes_per_token"]
        if info["scores_itself"]:
            self.perplexity = lambda windows: self.call("perplexity", windows)

    def _answer(self) -> Any:
        try:
            if not self._conn.poll(self.timeout_s):
                self._process.kill()
                raise EngineFailed(f"{self.name}: no answer within {self.timeout_s:.0f} s (its process was killed)")
            status, value = self._conn.recv()
        except (EOFError, OSError):  # the child is gone
            self._process.join(5)
            raise EngineFailed(f"{self.name}: its process died ({_how(self._process.exitcode)})") from None
        if status == "error":
            raise EngineFailed(f"{self.name}: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` in the child; ``EngineFailed`` when it cannot answer."""
        try:
            self._conn.send((method, args))
        except (OSError, ValueError):
            self._process.join(5)
            raise EngineFailed(f"{self.name}: its process died ({_how(self._process.exitcode)})") from None
        return self._answer()

    def warm(self, n_prompt: int, max_new_tokens: int) -> None:
        self.call("warm", n_prompt, max_new_tokens)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunStats:
        return self.call("run", prompt_ids, max_new_tokens)

    def memory(self) -> dict[str, int]:
        """The child's resident memory now and at its peak (``machine.process_memory``)."""
        from jpinfer.bench.machine import process_memory

        return process_memory(self._process.pid)

    def close(self) -> None:
        """Stop the child (also done when the engine is garbage-collected, or at exit)."""
        self._stopper()
