"""The server's engine thread: requests wait in a bounded queue, join the batch at step boundaries, and
their text goes back to the asyncio side piece by piece.

JAX calls block, so one thread owns the ``BatchDecoder`` and loops: admit waiting jobs into free slots
(each prefilled alone), drop cancelled ones (a client gone frees its slot before the next step), run one
step for every running job, deliver what each got. The event loop never waits on the device, and a
request's handler only awaits its own job's queue.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import Any

from jpinfer.runtime.batch import BatchedRequest
from jpinfer.runtime.generation import GenerationConfig


class Busy(Exception):
    """The queue of waiting requests is full."""


class Closed(Exception):
    """The server is shutting down: no new requests."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request's generation. Its events arrive on ``events`` (an asyncio queue, filled from the engine
    thread): ("text", piece), then ("done", GenerationResult), or ("error", message)."""

    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False
    request: BatchedRequest | None = None

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Scheduler:
    """Runs an engine's ``BatchDecoder`` (``slots`` sequences of ``context`` cache slots) on its own thread for
    the jobs ``submit`` queues (at most ``max_waiting`` waiting)."""

    def __init__(self, engine: Any, slots: int, context: int, max_waiting: int) -> None:
        self.engine = engine
        self.slots, self.max_waiting = slots, max_waiting
        self.decoder = engine.batch_decoder(slots, context)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._wake = threading.Condition()
        self._closed = False
        self._stopping = False
        self.completed = self.aborted = 0  # jobs that finished; running jobs dropped because their client left
        self._thread = threading.Thread(target=self._loop, name="jpinfer-engine", daemon=True)

    @property
    def context(self) -> int:
        """Positions a sequence may use (prompt and output)."""
        return self.decoder.capacity

    def counts(self) -> dict[str, int]:
        with self._wake:
            return {"slots": self.slots, "running": len(self._running), "waiting": len(self._waiting),
                    "completed": self.completed, "aborted": self.aborted}

    def warmup(self) -> None:
        """Compile prefill (the smallest prompt bucket), the batch insert and a step before serving: the first
        request then waits for its own work only."""
        request = self.decoder.add([0], GenerationConfig(max_new_tokens=3, ignore_eos=True))
        self.decoder.step()
        self.decoder.remove(request)

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt_ids: list[int], config: GenerationConfig, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a generation; raises ``Busy`` when ``max_waiting`` jobs wait already, ``Closed`` when shutting down."""
        job = Job(prompt_ids, config, loop)
        with self._wake:
            if self._closed:
                raise Closed()
            if len(self._waiting) >= self.max_waiting:
                raise Busy()
            self._waiting.append(job)
            self._wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job (its client is gone): out of the queue, or out of the batch before the next step."""
        with self._wake:
            job.cancelled = True
            self._wake.notify()

    def close(self) -> None:
        """Take no new jobs; the ones queued or running go on (graceful shutdown's first half)."""
        with self._wake:
            self._closed = True

    def stop(self, message: str = "the server is shutting down") -> None:
        """Stop the engine thread; jobs still queued or running get an error."""
        with self._wake:
            self._closed = self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        for job in [*self._waiting, *self._running]:
            job.emit("error", message)
        self._waiting.clear()
        self._running.clear()

    # ----- the engine thread
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.slots:
                    job = self._waiting.popleft()
                    if not job.cancelled:
                        admitted.append(job)
            try:
                for job in admitted:
                    self._admit(job)
                for job in [j for j in self._running if j.cancelled]:
                    self.decoder.remove(job.request)
                    self._running.remove(job)
                    self.aborted += 1
                if self._running:
                    self.decoder.step()
                    for job in list(self._running):
                        self._deliver(job)
            except Exception as error:  # a failed step leaves the cache unusable: fail its jobs, start afresh
                for job in self._running:
                    job.emit("error", f"generation failed: {type(error).__name__}: {error}")
                self._running.clear()
                self.decoder = self.engine.batch_decoder(self.slots, self.decoder.capacity)

    def _admit(self, job: Job) -> None:
        try:
            job.request = self.decoder.add(job.prompt_ids, job.config)
        except ValueError as error:
            job.emit("error", str(error))
            return
        self._running.append(job)
        self._deliver(job)

    def _deliver(self, job: Job) -> None:
        request = job.request
        if request.pieces:
            job.emit("text", "".join(request.pieces))
            request.pieces.clear()
        if request.result is not None:
            job.emit("done", request.result)
            self._running.remove(job)
            self.completed += 1
