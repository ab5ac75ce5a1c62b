"""The engine pool's worker threads run at the configured lower priority, so the event loop wins the cores."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

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


class CountsSteps:
    """An engine that always has work; each step takes 1 ms and is counted."""

    def __init__(self) -> None:
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return True

    def step(self) -> None:
        time.sleep(0.001)
        self.steps += 1


def test_a_paused_pool_starts_no_step_until_the_pause_ends_or_it_is_resumed() -> None:
    engine = CountsSteps()
    pool = EnginePool(1, 0)
    pool.add([engine])
    pool.start()
    try:
        assert wait_until(lambda: engine.steps > 0)
        pool.pause(30.0)
        time.sleep(0.05)  # a step running when the pause began may finish
        paused_at = engine.steps
        time.sleep(0.2)
        assert engine.steps == paused_at  # no step started while paused
        pool.resume()
        assert wait_until(lambda: engine.steps > paused_at)  # at once, long before the 30 s are up
        pool.pause(0.1)
        time.sleep(0.05)
        paused_at = engine.steps
        assert wait_until(lambda: engine.steps > paused_at)  # a pause ends by itself
    finally:
        pool.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
