"""Scheduler: the asyncio face of one model's engines — bounded admission, deadlines, cancellation; workers step the engines."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from nmt_serve.model.search import Hypothesis, SearchOptions
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.engine_pool import EnginePool
from nmt_serve.server.engine.jobs import Job, Outcome

logger = logging.getLogger(__name__)
ENGINES_JOIN_S = 5.0  # how long stop() waits for the engine workers to finish their step and exit


class Rejected(Exception):
    """Not admitted; `reason` is a low-cardinality label (queue_full, queue_tokens, draining, expired)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestFailed(Exception):
    """Admitted but not completed; `outcome` says why (expired, cancelled, failed)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class SchedulerObserver(Protocol):
    """Per-request timings (server/models/metrics.py implements it); called on any thread. Refusals are counted per call, by the service."""

    def finished_job(self, queue_wait_s: float | None, first_token_s: float | None, input_tokens: int, output_tokens: int | None) -> None: ...


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int = 256  # waiting + running requests
    max_tokens: int = 64 * 1024  # source tokens of waiting + running requests


def least_loaded(engines: Sequence[Engine]) -> int:
    """Where the next request goes: the engine with the fewest beam rows waiting or running (the first among equals)."""
    return min(range(len(engines)), key=lambda index: engines[index].load)


class Scheduler:
    """Submit from the event loop; ONNX Runtime runs in the engines' worker threads, never on the loop.

    Each engine (server/engine/workers.py says how many) steps its own batch; a request goes to the engine
    with the least load (beam rows waiting or running) and stays there. The engines are stepped by an
    EnginePool: the scheduler's own (one worker per engine), or one shared with other models'
    schedulers, which then starts and stops it.
    """

    def __init__(self, engines: Sequence[Engine], limits: QueueLimits = QueueLimits(), observer: SchedulerObserver | None = None,
                 pool: EnginePool | None = None) -> None:  # fmt: skip
        if not engines:
            raise ValueError("a scheduler needs at least one engine")
        self.engines = list(engines)
        self.limits = limits
        self.observer = observer
        self._owns_pool = pool is None
        self._pool = EnginePool(len(self.engines)) if pool is None else pool
        self._pool.add(self.engines)
        self._lock = threading.Lock()
        self._requests = 0
        self._tokens = 0
        self._reserved = 0  # places held by admitted calls not yet submitted (server/api/burst_hold.py)
        self.draining = False

    def start(self) -> None:
        if self._owns_pool:
            self._pool.start()

    def stop(self, timeout_s: float = ENGINES_JOIN_S) -> None:
        if self._owns_pool:
            self._pool.stop(timeout_s)

    @property
    def queue_depth(self) -> int:
        """Requests waiting to join a batch, all engines."""
        return sum(engine.pending for engine in self.engines)

    @property
    def running(self) -> int:
        """Requests in a batch, all engines."""
        return sum(len(engine.active) for engine in self.engines)

    @property
    def in_flight(self) -> int:
        return self._requests

    @property
    def places_taken(self) -> int:
        """Requests in flight plus the places held for calls admitted at arrival and not yet submitted."""
        return self._requests + self._reserved

    def reserve(self) -> None:
        """Holds one place for a call admitted at its arrival whose request is not submitted yet; unreserve() gives it back."""
        with self._lock:
            self._reserved += 1

    def unreserve(self) -> None:
        with self._lock:
            self._reserved -= 1

    def _submit(self, src_ids: Sequence[int], options: SearchOptions, deadline: float | None,
                on_tokens: Callable[[Job, np.ndarray], None] | None, on_done: Callable[[Job], None]) -> tuple[Engine, Job]:  # fmt: skip
        """To the least loaded engine; a worker is then woken."""
        engine = self.engines[least_loaded(self.engines)]
        job = engine.submit(src_ids, options, deadline, on_tokens=on_tokens, on_done=on_done)
        self._pool.wake()
        return engine, job

    def refusal(self) -> Rejected | None:
        """What any request would meet now, whatever its size (draining, or no place left); cheap, and takes no place."""
        if self.draining:
            return Rejected("draining", "server is shutting down")
        if self._requests + self._reserved >= self.limits.max_requests:
            held = f" and {self._reserved} places held for calls being admitted" if self._reserved else ""
            return Rejected("queue_full", f"queue full: {self._requests} requests in flight{held} (limit {self.limits.max_requests})")
        return None

    def _admit(self, src_ids: Sequence[int], deadline: float | None) -> None:
        with self._lock:
            rejected = self.refusal()
            if rejected is None and deadline is not None and time.monotonic() >= deadline:
                rejected = Rejected("expired", "deadline passed before admission")
            if rejected is None and self._tokens + len(src_ids) > self.limits.max_tokens:
                rejected = Rejected("queue_tokens", f"queue full: {self._tokens} source tokens in flight (limit {self.limits.max_tokens})")
            if rejected is not None:
                raise rejected
            self._requests += 1
            self._tokens += len(src_ids)

    def _release(self, job: Job) -> None:
        with self._lock:
            self._requests -= 1
            self._tokens -= len(job.src_ids)
        if self.observer is not None:
            joined = job.joined_at - job.submitted_at if job.joined_at else None
            first = job.first_token_at - job.submitted_at if job.first_token_at else None
            output = len(job.hypotheses[0].token_ids) if job.hypotheses else None
            self.observer.finished_job(joined, first, len(job.src_ids), output)

    async def translate(self, src_ids: Sequence[int], options: SearchOptions, deadline: float | None = None) -> list[Hypothesis]:
        """n-best hypotheses; raises Rejected (not admitted) or RequestFailed. Cancelling the task cancels the job."""
        self._admit(src_ids, deadline)
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[Job] = loop.create_future()

        def on_done(job: Job) -> None:
            self._release(job)
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(job))

        engine, job = self._submit(src_ids, options, deadline, None, on_done)
        try:
            await finished
        except asyncio.CancelledError:
            engine.cancel(job)
            raise
        return self._result(job)

    async def stream(self, src_ids: Sequence[int], options: SearchOptions, deadline: float | None = None) -> AsyncIterator[np.ndarray | list[Hypothesis]]:
        """Yields each step's new token ids (greedy: one id) as chosen, then the final n-best list."""
        self._admit(src_ids, deadline)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[np.ndarray | Job] = asyncio.Queue()

        def on_tokens(_: Job, tokens: np.ndarray) -> None:
            loop.call_soon_threadsafe(events.put_nowait, tokens.copy())

        def on_done(job: Job) -> None:
            self._release(job)
            loop.call_soon_threadsafe(events.put_nowait, job)

        streaming = options.beam_size == 1  # a beam's best row can change every step: it sends the n-best at the end
        engine, job = self._submit(src_ids, options, deadline, on_tokens if streaming else None, on_done)
        try:
            while True:
                event = await events.get()
                if isinstance(event, Job):
                    yield self._result(event)
                    return
                yield event
        finally:
            if not job.done.is_set():  # the consumer went away (client cancelled): free the rows
                engine.cancel(job)

    @staticmethod
    def _result(job: Job) -> list[Hypothesis]:
        if job.outcome is Outcome.OK:
            return job.hypotheses
        assert job.outcome is not None
        detail = f": {job.error}" if job.error else ""
        raise RequestFailed(job.outcome, f"request {job.outcome.value}{detail}")
