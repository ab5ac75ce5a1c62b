"""Under a burst, admitted calls wait for arrivals to pause, holding their places, so that refusals go out first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.burst_hold import RUSH_CALLS, BurstHold
from nmt_serve.server.settings import ServerSettings
from tests.serving import RunningServer, held_engines, scrape, scrape_until, server_settings, total, wait_for


class Places:
    """The scheduler as the hold sees it: places taken and held."""

    def __init__(self, taken: int = 0) -> None:
        self.taken = taken
        self.reserved = 0

    @property
    def places_taken(self) -> int:
        return self.taken + self.reserved

    def reserve(self) -> None:
        self.reserved += 1

    def unreserve(self) -> None:
        self.reserved -= 1


async def arrive_every(hold: BurstHold, period_s: float, count: int) -> float:
    """Calls arriving `count` times, `period_s` apart; returns the time of the last."""
    last = time.monotonic()
    for _ in range(count):
        hold.arrived()
        last = time.monotonic()
        await asyncio.sleep(period_s)
    return last


# A burst here: 4 calls within 1 s. The tests' calls arrive 10 ms apart, so only a stall of the test process of most
# of a second, not the speed of the CPU, could end a burst early.
WINDOW_S = 1.0


def burst_hold(places: Places, max_hold_s: float = 30.0) -> BurstHold:
    return BurstHold(places, threshold=4, burst_calls=4, window_s=WINDOW_S, max_hold_s=max_hold_s)


def test_a_call_waits_only_in_a_burst_once_the_threshold_is_reached() -> None:
    places = Places(taken=3)
    hold = burst_hold(places)
    for _ in range(4):
        hold.arrived()
    assert hold.in_burst() and not hold.applies()  # below the threshold
    places.taken = 4
    assert hold.applies()
    calm = burst_hold(places)
    for _ in range(3):
        calm.arrived()
    assert not calm.in_burst() and not calm.applies()  # too few calls for a burst
    never = BurstHold(places, threshold=0, burst_calls=4, window_s=WINDOW_S)
    for _ in range(4):
        never.arrived()
    assert not never.applies()  # 0: never


def test_a_burst_ends_when_its_rate_falls() -> None:
    hold = burst_hold(Places(taken=4))
    for _ in range(4):
        hold.arrived()
    assert hold.in_burst()
    time.sleep(WINDOW_S + 0.05)
    assert not hold.in_burst()  # the last 4 calls are now older than the window


def test_held_calls_keep_their_places_until_the_burst_is_over() -> None:
    async def run() -> tuple[list[float], float, list[int]]:
        places = Places(taken=4)
        hold = burst_hold(places)
        released: list[float] = []
        reserved: list[int] = []

        async def call() -> None:
            await hold.hold()
            released.append(time.monotonic())

        for _ in range(4):
            hold.arrived()
        arrivals = asyncio.create_task(arrive_every(hold, 0.01, 30))
        calls = [asyncio.create_task(call()) for _ in range(3)]
        await asyncio.sleep(0.05)
        reserved.append(places.reserved)  # all three waiting, each holding a place
        last = await arrivals
        await asyncio.gather(*calls)
        reserved.append(places.reserved)
        return released, last, reserved

    released, last_arrival, reserved = asyncio.run(run())
    assert reserved == [3, 0]
    assert all(when > last_arrival for when in released)  # none went on while the burst went on


def test_draining_lets_held_calls_go_at_once() -> None:
    async def run() -> tuple[float, float]:
        places = Places(taken=4)
        hold = burst_hold(places)
        for _ in range(4):
            hold.arrived()
        arrivals = asyncio.create_task(arrive_every(hold, 0.01, 100))  # a second of arrivals
        waiting = asyncio.create_task(hold.hold())
        await asyncio.sleep(0.05)
        hold.release()  # what the drain does
        await waiting
        released = time.monotonic()
        last = await arrivals
        return released, last

    released, last_arrival = asyncio.run(run())
    assert released < last_arrival  # went on while calls still arrived: the drain answers them all


def test_a_call_waits_at_most_max_hold_s() -> None:
    async def run() -> tuple[float, float, int]:
        places = Places(taken=4)
        hold = burst_hold(places, max_hold_s=0.1)
        for _ in range(4):
            hold.arrived()
        arrivals = asyncio.create_task(arrive_every(hold, 0.01, 100))
        await hold.hold()
        released = time.monotonic()
        last = await arrivals
        return released, last, places.reserved

    released, last_arrival, reserved = asyncio.run(run())
    assert released < last_arrival and reserved == 0


def test_a_cancelled_call_gives_its_place_back() -> None:
    async def run() -> int:
        places = Places(taken=4)
        hold = burst_hold(places)
        for _ in range(4):
            hold.arrived()
        arrivals = asyncio.create_task(arrive_every(hold, 0.01, 20))
        waiting = asyncio.create_task(hold.hold())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await arrivals
        return places.reserved

    assert asyncio.run(run()) == 0


def test_settings_refuse_a_share_outside_zero_to_one() -> None:
    with pytest.raises(ValueError, match="--burst-hold-share must be between 0"):
        ServerSettings(burst_hold_share=1.5).validate()


REQUEST = pb.TranslateRequest(texts=["Ich sehe den Hund."])


def hold_every_call(server: RunningServer) -> BurstHold:
    """The server's hold, made to keep calls until released: any two calls within a minute make a burst, and a call may
    wait a minute (the shipped window and longest wait would let them go on their own here)."""
    hold = BurstHold(server.server.scheduler, threshold=2, burst_calls=2, window_s=60.0, max_hold_s=60.0)
    server.server.admission.burst_hold = hold
    return hold


def two_running(server: RunningServer, stub: Any, pool: ThreadPoolExecutor) -> list[Future[Any]]:
    """Two calls in the engine (held there by the step gate): the hold's threshold is reached."""
    running = [pool.submit(stub.Translate, REQUEST, timeout=120) for _ in range(2)]
    assert wait_for(lambda: server.server.scheduler.in_flight == 2, 30)
    return running


def test_server_refuses_beyond_the_held_places_while_held_calls_wait(tiny_model_dir: Path) -> None:
    # A queue of 8 whose hold starts at 2 places: two calls run (held in the engine), the next six wait at the hold
    # holding places 3-8, and a ninth is refused at once, while those six have not been read yet. Then all eight finish.
    settings = server_settings(tiny_model_dir, max_queued_requests=8, burst_hold_share=0.25)
    with RunningServer(settings) as server:
        assert server.server.admission.burst_hold is not None and server.server.admission.burst_hold.threshold == 2
        hold = hold_every_call(server)
        channel, stub = server.stub()
        with channel, ThreadPoolExecutor(8) as pool, held_engines(server) as gate:
            running = two_running(server, stub, pool)
            held = [pool.submit(stub.Translate, REQUEST, timeout=120) for _ in range(6)]
            assert wait_for(lambda: hold.held == 6, 30)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Translate(REQUEST, timeout=30)
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "6 places held" in caught.value.details()
            assert hold.held == 6 and server.server.scheduler.in_flight == 2  # the refusal did not wait for them
            server.server.call_soon(hold.release)
            gate.open()
            answers = [future.result(120) for future in running + held]
        assert all(answer.translations[0].hypotheses[0].text for answer in answers)
        assert wait_for(lambda: server.server.scheduler.places_taken == 0, 10)


def test_a_held_call_its_client_cancels_is_counted_once(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=8)) as server:
        hold = hold_every_call(server)
        channel, stub = server.stub()
        with channel, ThreadPoolExecutor(2) as pool, held_engines(server) as gate:
            running = two_running(server, stub, pool)
            held = stub.Translate.future(REQUEST, timeout=120)
            assert wait_for(lambda: hold.held == 1, 30)
            held.cancel()
            assert wait_for(lambda: hold.held == 0 and server.server.scheduler.places_taken == 2, 30)  # its place is back
            gate.open()
            assert all(future.result(120).translations for future in running)
        samples = scrape_until(server.server.metrics_port,
                               lambda found: total(found, "nmt_requests_total", method="Translate", code="CANCELLED") >= 1)
    assert total(samples, "nmt_requests_total", method="Translate", code="CANCELLED") == 1
    assert total(samples, "nmt_requests_total", method="Translate", code="OK") == 2


def rush(hold: BurstHold) -> None:
    """RUSH_CALLS calls at once: the start of a burst, as the engines' pause tells it."""
    for _ in range(RUSH_CALLS):
        hold.arrived()


class PauseLog:
    """The engines' pool as the hold sees it: when it was told to pause (and for how long) and to resume."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self.resumes: list[float] = []

    def pause(self, seconds: float) -> None:
        self.pauses.append((time.monotonic(), seconds))

    def resume(self) -> None:
        self.resumes.append(time.monotonic())


def test_a_rush_of_calls_pauses_the_engines_until_the_burst_is_over() -> None:
    """RUSH_CALLS calls at once pause the engines (a burst told after 16 calls, not 64); they resume once neither rate
    holds, here after the last of the calls that keep arriving for a while, and within the longest hold."""
    async def run() -> tuple[PauseLog, float]:
        engines = PauseLog()
        hold = BurstHold(Places(), threshold=64, engines=engines)  # the shipped rates and longest hold
        for _ in range(RUSH_CALLS - 1):
            hold.arrived()
        assert engines.pauses == []  # one call short of a rush
        hold.arrived()
        assert len(engines.pauses) == 1 and engines.pauses[0][1] == hold.max_hold_s
        last = time.monotonic()
        for _ in range(40):  # a burst going on for about 0.1 s: 32 calls every 2 ms (64 within 100 ms even 40 ms apart)
            for _ in range(32):
                hold.arrived()
            last = time.monotonic()
            await asyncio.sleep(0.002)
        while not engines.resumes:
            await asyncio.sleep(0.01)
        return engines, last

    engines, last_arrival = asyncio.run(run())
    assert len(engines.pauses) == 1  # the calls arriving during the pause start no other
    # Resumed once the calls stopped: the hold's rate (64 within 100 ms) lapses 100 ms after the last, then a poll.
    assert last_arrival < engines.resumes[0] < last_arrival + 0.25


def pauses_under(traffic: Callable[[BurstHold], Awaitable[None]], max_hold_s: float) -> PauseLog:
    """What a hold with the shipped rates told the engines while `traffic` arrived."""
    engines = PauseLog()
    asyncio.run(traffic(BurstHold(Places(), threshold=64, max_hold_s=max_hold_s, engines=engines)))
    return engines


def test_the_engines_pause_at_most_once_per_twice_the_longest_hold() -> None:
    """Bursts in quick succession, or a flood that goes on, leave the engines stepping at least half of the time."""
    async def rushes(hold: BurstHold) -> None:
        for _ in range(3):  # three rushes 0.1 s apart: one pause
            rush(hold)
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.35)
        rush(hold)  # 0.2 x 2 after the first: another
        await asyncio.sleep(0.1)

    assert len(pauses_under(rushes, max_hold_s=0.2).pauses) == 2


def test_a_flood_pauses_the_engines_once_at_its_start() -> None:
    """A flood that goes on past twice the longest hold pauses the engines once: later on it began too long ago."""
    async def flood(hold: BurstHold) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 0.45:  # 0.45 s of calls at burst rate, past 2 x 0.1 s twice over
            rush(hold)
            await asyncio.sleep(0.005)

    assert len(pauses_under(flood, max_hold_s=0.1).pauses) == 1


def test_draining_resumes_paused_engines_at_once() -> None:
    async def rush_then_drain(hold: BurstHold) -> None:
        rush(hold)
        hold.release()  # what the drain does

    engines = pauses_under(rush_then_drain, max_hold_s=0.5)
    assert len(engines.pauses) == 1 and len(engines.resumes) >= 1 and engines.resumes[0] >= engines.pauses[0][0]


@pytest.mark.parametrize("burst_pause", [1, 0])
def test_the_server_pauses_its_own_engines_only_with_burst_pause_on(tiny_model_dir: Path, burst_pause: int) -> None:
    with RunningServer(server_settings(tiny_model_dir, burst_pause=burst_pause)) as server:
        engines = server.server.burst_hold.engines
        assert (engines is server.server.scheduler.pool) if burst_pause else engines is None


def test_settings_refuse_a_burst_pause_other_than_zero_or_one() -> None:
    with pytest.raises(ValueError, match="--burst-pause must be 0 .off. or 1 .on., got 2"):
        ServerSettings(burst_pause=2).validate()


def send_burst(stub: Any, calls: int) -> list[grpc.StatusCode]:
    """`calls` Translate calls at once; each one's status code once all are answered."""
    futures = [stub.Translate.future(REQUEST, timeout=60) for _ in range(calls)]
    codes = []
    for call in futures:
        try:
            call.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.append(error.code())
    return codes


def hold_told_by_wide_rates(server: RunningServer) -> BurstHold:
    """The server's hold, with its engines and pause counter, told a burst by rates any machine delivers 200 calls at
    once at (16 or 64 calls within a second): how fast a busy machine's client and handlers pass a real burst along then
    does not decide whether the shipped rates (16 within 10 ms, 64 within 100 ms) are reached; those are tested above."""
    shipped = server.server.burst_hold
    hold = BurstHold(shipped.scheduler, shipped.threshold, window_s=1.0, rush_window_s=1.0, engines=shipped.engines,
                     on_pause=shipped.on_pause)
    server.server.burst_hold = server.server.admission.burst_hold = hold
    return hold


@pytest.mark.parametrize("burst_pause", [1, 0])
def test_a_real_burst_pauses_the_engines_once_and_counts_it(tiny_model_dir: Path, burst_pause: int) -> None:
    """200 calls at once against a queue of 8 pause the engines once (only at a burst's start, at most once per twice
    the longest hold) and nmt_burst_engine_pauses_total says so; with --burst-pause 0 it stays 0. Every call is
    answered, OK or refused."""
    settings = server_settings(tiny_model_dir, max_queued_requests=8, burst_pause=burst_pause)
    with RunningServer(settings) as server:
        hold_told_by_wide_rates(server)
        channel, stub = server.stub()
        with channel:
            codes = send_burst(stub, 200)
        pauses = total(scrape(server.server.metrics_port), "nmt_burst_engine_pauses_total")
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED} and grpc.StatusCode.OK in codes
    assert pauses == (1 if burst_pause else 0)
