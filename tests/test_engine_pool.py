"""The engine pool's worker threads run at the configured lower priority, so the event loop wins the cores."""

from __future__ import annotations

import os
import threading

import pytest

from nmt_serve.server.engine.engine_pool import DEFAULT_WORKER_NICENESS, EnginePool
from nmt_serve.server.settings import ServerSettings


class RecordsItsPriority:
    """An engine with one step of work; the step records the nice value of the thread that runs it."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.stepped = threading.Event()

    @property
    def has_work(self) -> bool:
        return not self.stepped.is_set()

    def step(self) -> None:
        self.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.stepped.set()


def nice_value_of_a_step(niceness: int) -> int:
    engine = RecordsItsPriority()
    pool = EnginePool(1, niceness)
    pool.add([engine])
    pool.start()
    try:
        pool.wake()
        assert engine.stepped.wait(10), "the worker never stepped the engine"
    finally:
        pool.stop()
    return engine.seen[0]


@pytest.mark.parametrize("niceness", [0, 3, DEFAULT_WORKER_NICENESS])
def test_workers_step_engines_at_the_configured_niceness(niceness: int) -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # a new thread starts at its creator's value
    assert nice_value_of_a_step(niceness) == min(19, own + niceness)


def test_the_server_default_lowers_the_workers() -> None:
    assert ServerSettings().worker_niceness == DEFAULT_WORKER_NICENESS > 0
