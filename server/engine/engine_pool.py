"""The worker threads that step engines: one pool for the engines of every served model, taking the models in turn.

Why one pool: the workers are what use the cores (each runs one ONNX Runtime call at a time, on
ServerSettings.threads intra-op threads), so however many models a server holds, no more calls
compute at once than with one model. A free worker takes the next model after the one it took last
that has an engine with work no other worker is stepping, so a flooded model gets at most every
other step while another model has work, and all of the workers while the others are idle.

Why the workers run at a lower scheduling priority (niceness, default 10): the event loop that takes calls in and
answers them shares the cores with them, and a call is refused or admitted only when the loop gets its turn. At equal
priority, two busy workers on two cores held back the loop under bursts of 1,000 calls (int8 model, AMD EPYC, 2
cores, load generator on the same cores; nmt-burst-report, bench/results/burst.md): refusals came back after a p99
of 0.859 s (median of 7 bursts); with the workers at niceness 10, 0.613 s, at the same closed-loop throughput
(308.7 against 312.6 requests/s with 32 clients).
Linux applies niceness per thread; it covers the ONNX Runtime calls a worker makes on its own thread (one intra-op
thread, the CPU default up to 4 cores), not the pool threads of sessions given more.

Why the workers can be paused (pause/resume, server/api/burst_hold.py): niceness gives the loop the cores, not the
interpreter; a worker's Python between its ONNX Runtime calls (search, cache moves, bookkeeping) holds the GIL the
loop needs. Under a burst of 1,000 calls, refusals came back at 2.29x the bare grpcio floor's p99 with the workers
stepping the calls admitted first, and at 1.39x with the workers paused for the burst (one interleaved run, AMD EPYC
with AVX-512 VNNI; nmt-burst-report, bench/results/burst.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # a worker with nothing to step re-checks this often even without a wake-up (stop, lost races)
DEFAULT_WORKER_NICENESS = 10


def lower_thread_priority(niceness: int) -> None:
    """Adds `niceness` to the calling thread's nice value (Linux: per thread); where the platform cannot, logs and goes on."""
    if niceness <= 0:
        return
    try:
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, os.getpriority(os.PRIO_PROCESS, thread_id) + niceness))
    except (AttributeError, OSError) as error:  # not Linux, or a sandbox that refuses it
        logger.warning("engine workers keep the server's priority: %s", error)


class Steppable(Protocol):
    """What the pool needs of an engine (server/engine/engine.py)."""

    @property
    def has_work(self) -> bool: ...

    def step(self) -> None: ...


class EnginePool:
    """Call `add` once per model before `start`; `wake` after submitting work (from any thread)."""

    def __init__(self, workers: int, niceness: int = DEFAULT_WORKER_NICENESS) -> None:
        if workers < 1:
            raise ValueError(f"an engine pool needs at least 1 worker, got {workers}")
        self.workers = workers
        self.niceness = niceness  # added to each worker thread's nice value
        self._groups: list[list[Steppable]] = []  # one list of engines per model
        self._next_engine: list[int] = []  # per group: the engine to try first next time
        self._next_group = 0
        self._busy: set[int] = set()  # id() of the engines a worker is stepping
        self._condition = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._paused_until = 0.0  # monotonic time before which no worker starts a step

    def add(self, engines: Sequence[Steppable]) -> None:
        """One model's engines; the pool takes them in turn with every other model's."""
        with self._condition:
            self._groups.append(list(engines))
            self._next_engine.append(0)

    def start(self) -> None:
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._work, name=f"nmt-worker-{index}", daemon=True) for index in range(self.workers)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def pause(self, seconds: float) -> None:
        """No worker starts a step for `seconds` or until resume(); steps already running finish. From any thread."""
        with self._condition:
            self._paused_until = time.monotonic() + seconds

    def resume(self) -> None:
        """Workers take steps again now."""
        with self._condition:
            self._paused_until = 0.0
            self._condition.notify_all()

    def wake(self) -> None:
        """New work: one idle worker looks for it."""
        with self._condition:
            self._condition.notify()

    def _take(self) -> Steppable | None:
        """Under the condition: the next engine with work and no worker, models in turn, or None."""
        count = len(self._groups)
        for offset in range(count):
            group_index = (self._next_group + offset) % count
            group = self._groups[group_index]
            for step in range(len(group)):
                engine_index = (self._next_engine[group_index] + step) % len(group)
                engine = group[engine_index]
                if id(engine) not in self._busy and engine.has_work:
                    self._busy.add(id(engine))
                    self._next_engine[group_index] = (engine_index + 1) % len(group)
                    self._next_group = (group_index + 1) % count
                    return engine
        return None

    def _work(self) -> None:
        lower_thread_priority(self.niceness)
        while True:
            with self._condition:
                engine = None
                while not self._stopping:
                    paused_s = self._paused_until - time.monotonic()
                    if paused_s <= 0 and (engine := self._take()) is not None:
                        break
                    self._condition.wait(paused_s if paused_s > 0 else IDLE_WAIT_S)
                if self._stopping:
                    if engine is not None:
                        self._busy.discard(id(engine))
                    return
            try:
                engine.step()
            except Exception:  # the engine fails its own requests; this only keeps the worker alive
                logger.exception("engine step raised")
            finally:
                with self._condition:
                    self._busy.discard(id(engine))
                    # The engine may have more work, which a waiting worker could take now.
                    self._condition.notify()
