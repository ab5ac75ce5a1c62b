"""Scheduler: asyncio submit/stream over the engine thread; admission limits, deadlines, cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nmt_serve.model.search import Hypothesis, SearchOptions, generate
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import Outcome
from nmt_serve.server.engine.scheduler import QueueLimits, Rejected, RequestFailed, Scheduler
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings

GREEDY = SearchOptions(beam_size=1, min_output_tokens=6, max_output_tokens=10)
BEAM = SearchOptions(beam_size=3, min_output_tokens=4, max_output_tokens=8)
SOURCES = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Runtime:
    return Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))


@pytest.fixture(params=[1, 2], ids=["one engine", "two engines"])
def scheduler(runtime: Runtime, request: pytest.FixtureRequest) -> Iterator[Scheduler]:
    scheduler = Scheduler([Engine(runtime) for _ in range(request.param)], QueueLimits(max_requests=8, max_tokens=100))
    scheduler.start()
    yield scheduler
    scheduler.stop()


def alone(model_dir: Path, source: list[int], options: SearchOptions) -> list[Hypothesis]:
    step = OrtStep(model_dir)
    config = step.config
    return generate(step, [source], options, config.bos_id, config.eos_id, config.max_positions)[0]


def test_scheduler_concurrent_requests_equal_each_alone(scheduler: Scheduler, tiny_model_dir: Path) -> None:
    async def run() -> list[list[Hypothesis]]:
        options = [GREEDY, BEAM, GREEDY, BEAM]
        return await asyncio.gather(*(scheduler.translate(src, opt) for src, opt in zip(SOURCES, options, strict=True)))

    results = asyncio.run(run())
    for source, options, hypotheses in zip(SOURCES, [GREEDY, BEAM, GREEDY, BEAM], results, strict=True):
        assert [h.token_ids for h in hypotheses] == [h.token_ids for h in alone(tiny_model_dir, source, options)]
    assert scheduler.in_flight == 0
    assert [engine.load for engine in scheduler.engines] == [0] * len(scheduler.engines)


def test_scheduler_sends_each_request_to_the_least_loaded_engine(runtime: Runtime) -> None:
    engines = [Engine(runtime), Engine(runtime)]
    scheduler = Scheduler(engines)  # not started: the requests stay where they were sent

    async def run() -> None:
        long = SearchOptions(min_output_tokens=50, max_output_tokens=60)
        tasks = [asyncio.ensure_future(scheduler.translate(source, options))
                 for source, options in ((SOURCES[0], SearchOptions(beam_size=3, min_output_tokens=50, max_output_tokens=60)), (SOURCES[1], long), (SOURCES[2], long))]  # fmt: skip
        await asyncio.sleep(0)
        # Beam rows waiting: the beam of 3 went to the first engine, then both greedy requests to the second.
        assert [engine.load for engine in engines] == [3, 2] and [engine.pending for engine in engines] == [1, 2]
        assert scheduler.queue_depth == 3 and scheduler.running == 0
        for task in tasks:
            task.cancel()
        await asyncio.sleep(0)
        for engine in engines:
            engine.step()  # cancelled before joining: dropped at admission
        assert [engine.load for engine in engines] == [0, 0]

    asyncio.run(run())


def test_scheduler_rejects_beyond_the_request_limit(runtime: Runtime) -> None:
    scheduler = Scheduler([Engine(runtime)], QueueLimits(max_requests=2, max_tokens=1000))  # not started: nothing drains

    async def run() -> None:
        tasks = [asyncio.ensure_future(scheduler.translate([5, 6], GREEDY)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Rejected, match="limit 2") as caught:
            await scheduler.translate([5, 6], GREEDY)
        assert caught.value.reason == "queue_full"
        for task in tasks:
            task.cancel()

    asyncio.run(run())


def test_scheduler_rejects_beyond_the_token_limit(scheduler: Scheduler) -> None:
    with pytest.raises(Rejected, match="limit 100") as caught:
        asyncio.run(scheduler.translate(list(range(4, 105)), GREEDY))
    assert caught.value.reason == "queue_tokens"


def test_scheduler_past_deadline_is_rejected_before_admission(scheduler: Scheduler) -> None:
    with pytest.raises(Rejected) as caught:
        asyncio.run(scheduler.translate([5], GREEDY, deadline=time.monotonic() - 0.001))
    assert caught.value.reason == "expired"


def test_scheduler_deadline_during_decode_fails_as_expired(runtime: Runtime) -> None:
    engine = Engine(runtime)
    scheduler = Scheduler([engine])

    async def run() -> None:
        task = asyncio.ensure_future(scheduler.translate([5, 6], SearchOptions(min_output_tokens=50, max_output_tokens=60), deadline=time.monotonic() + 0.5))
        await asyncio.sleep(0)
        engine.step()  # admitted and one step decoded, then the deadline passes
        time.sleep(0.6)
        engine.step()
        with pytest.raises(RequestFailed, match="expired") as caught:
            await task
        assert caught.value.outcome is Outcome.EXPIRED

    asyncio.run(run())
    assert not engine.active


def test_scheduler_cancelled_task_frees_its_rows(runtime: Runtime) -> None:
    engine = Engine(runtime)
    scheduler = Scheduler([engine])

    async def run() -> None:
        task = asyncio.ensure_future(scheduler.translate([5, 6], SearchOptions(min_output_tokens=50, max_output_tokens=60)))
        await asyncio.sleep(0)
        engine.step()
        assert engine.active
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.step()  # one step later the rows are gone
        assert not engine.active
        await asyncio.sleep(0.01)
        assert scheduler.in_flight == 0

    asyncio.run(run())


def test_scheduler_stream_greedy_yields_tokens_then_result(scheduler: Scheduler) -> None:
    async def run() -> tuple[list[int], list[Hypothesis]]:
        tokens: list[int] = []
        async for event in scheduler.stream([5, 6, 7], GREEDY):
            if isinstance(event, np.ndarray):
                tokens.extend(event.tolist())
            else:
                return tokens, event
        raise AssertionError("stream ended without a result")

    tokens, hypotheses = asyncio.run(run())
    assert tokens == list(hypotheses[0].token_ids)[: len(tokens)]
    assert len(hypotheses[0].token_ids) - len(tokens) <= 1


def test_scheduler_stream_beam_sends_only_the_final_nbest(scheduler: Scheduler) -> None:
    async def run() -> list[object]:
        return [event async for event in scheduler.stream([5, 6, 7], BEAM)]

    events = asyncio.run(run())
    assert len(events) == 1 and isinstance(events[0], list)
