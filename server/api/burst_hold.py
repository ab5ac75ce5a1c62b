"""Under a burst, admitted calls wait for it to end, holding their places, so that its refusals go out first.

Why: in a burst of 1,000 calls against a queue of 256 the refusals queued on the event loop behind the calls admitted
before them (reading the message, tokenizing, submitting, answering) and behind the engines' start on them; the
refusals' p99 was about 3x that of a bare grpcio server refusing every call (bench/results/burst.md). While calls
arrive at burst rate (BURST_CALLS within BURST_WINDOW_S) and a quarter of the queue is taken, a newly admitted call
holds its place and waits until the rate falls below that (or MAX_HOLD_S has passed, or the drain calls release()),
then goes on as usual. Under steady load, whatever the queue holds, no call waits.

From the moment a burst is seen (RUSH_CALLS within RUSH_WINDOW_S) the engines start no step either (Pausable,
server/engine/engine_pool.py): their Python between ONNX Runtime calls holds the GIL the event loop needs to refuse.
A pause lasts until the burst is over, at most MAX_HOLD_S; only a burst that began less than MAX_HOLD_S ago starts
one, and at most once per twice that, so a flood that goes on, or bursts in quick succession, leave the engines
stepping at least half of the time.

A burst is told by rate, not by a pause: a burst's calls reach the handlers in waves with gaps of 2-45 ms between
them, so a hold that ended at the first 2 ms without a call ended a dozen times per burst and bought nothing
(refusal p99 3.02x the floor against 2.90x without a hold). Rates measured in one interleaved run (5 bursts of 1,000
each, AMD EPYC with AVX-512 VNNI): without a hold 3.04x; 32 calls in 32 ms 2.62x (one burst's hold ended early);
16 in 50 ms 2.48x; 64 in 100 ms 2.44x, every burst held whole.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

# Burst rate: this many calls within BURST_WINDOW_S, 640 calls/s, about 1.5x what two cores serve of the default
# model (400-430 requests/s, 32 clients); a burst of 1,000 reaches the handlers at 2,500-6,000 calls/s.
BURST_CALLS = 64
BURST_WINDOW_S = 0.1
# A burst's start, as the engines' pause sees it: this many calls within RUSH_WINDOW_S (1,600 calls/s; a burst of 1,000
# reaches the handlers at 2,500-6,000 calls/s), told after 16 calls instead of 64. The engines paused from the 64th call
# left refusal p99 at 1.63x-1.67x the floor, from the 16th 1.41x-1.60x (16 within 25 ms). Steady load trips it too
# (a batch's clients all answered at once send their next calls together), but then the pause ends within about
# RUSH_WINDOW_S: 16 within 25 ms cost some 3% of closed-loop requests/s; 16 within 10 ms none measurable (interleaved,
# 5 rounds: 32 clients 480.1 against 463.9 requests/s, 64 clients 512.8 against 522.7, p99 0.139 against 0.143 s and
# 0.259 against 0.256 s, with and without the pause).
RUSH_CALLS = 16
RUSH_WINDOW_S = 0.01
# The longest an admitted call waits, however long the burst goes on.
MAX_HOLD_S = 0.5


def all_within(arrivals: collections.deque[float], window_s: float, now: float | None) -> bool:
    """Whether `arrivals` is full and its oldest is under `window_s` old at `now` (default: the clock)."""
    return len(arrivals) == arrivals.maxlen and (time.monotonic() if now is None else now) - arrivals[0] < window_s


class Places(Protocol):
    """What the hold needs of the scheduler (server/engine/all_schedulers.py)."""

    @property
    def places_taken(self) -> int: ...

    def reserve(self) -> None: ...

    def unreserve(self) -> None: ...


class Pausable(Protocol):
    """What the hold needs of the engines' worker pool (server/engine/engine_pool.py)."""

    def pause(self, seconds: float) -> None: ...

    def resume(self) -> None: ...


class BurstHold:
    """`threshold`: places taken from which an admitted call may wait (0: never). arrived() is told of every call that
    asks for a place, admitted or refused. `engines`, when given, start no step from a burst's start until it is over,
    told by either rate: `burst_calls` within `window_s`, or `rush_calls` within `rush_window_s`."""

    def __init__(self, scheduler: Places, threshold: int, burst_calls: int = BURST_CALLS, window_s: float = BURST_WINDOW_S,
                 max_hold_s: float = MAX_HOLD_S, engines: Pausable | None = None, on_pause: Callable[[], None] | None = None,
                 rush_calls: int = RUSH_CALLS, rush_window_s: float = RUSH_WINDOW_S) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.threshold = threshold
        self.window_s = window_s
        self.rush_window_s = rush_window_s
        self.max_hold_s = max_hold_s
        self.engines = engines
        self.on_pause = on_pause  # told of each pause of the engines (metrics)
        self.held = 0  # calls waiting now
        self._burst_started: float | None = None  # monotonic time the burst going on now was first seen
        self._last_pause = -float("inf")  # monotonic time the engines were last paused
        self._arrivals: collections.deque[float] = collections.deque(maxlen=burst_calls)
        self._recent: collections.deque[float] = collections.deque(maxlen=rush_calls)  # the last calls, for rushing()
        self._over: asyncio.Event | None = None  # set once the burst is over; shared by the calls waiting for it
        self._watcher: asyncio.Task[None] | None = None

    def arrived(self) -> None:
        """Call on the event loop, for every call that asks for a place."""
        now = time.monotonic()
        self._arrivals.append(now)
        self._recent.append(now)
        if not (self.in_burst(now) or self.rushing(now)):
            self._burst_started = None
            return
        if self._burst_started is None:
            self._burst_started = now
        # Only a burst that began under max_hold_s ago pauses the engines, and at most once per twice that: a flood that
        # goes on, or bursts in quick succession, leave the engines stepping at least half of the time.
        if self.engines is not None and now - self._burst_started < self.max_hold_s and now - self._last_pause >= 2 * self.max_hold_s:
            self._last_pause = now
            self.engines.pause(self.max_hold_s)
            logger.debug("a burst: the engines start no step until it is over (at most %g s)", self.max_hold_s)
            if self.on_pause is not None:
                self.on_pause()
            if self._over is None:
                self._watch()  # resumes them once the burst is over

    def in_burst(self, now: float | None = None) -> bool:
        """Whether the last `burst_calls` calls all arrived within `window_s` of now."""
        return all_within(self._arrivals, self.window_s, now)

    def rushing(self, now: float | None = None) -> bool:
        """Whether the last `rush_calls` calls all arrived within `rush_window_s` of now: a burst told early."""
        return all_within(self._recent, self.rush_window_s, now)

    def applies(self) -> bool:
        """Whether a call admitted now waits."""
        return self.threshold > 0 and self.scheduler.places_taken >= self.threshold and self.in_burst()

    async def hold(self) -> None:
        """Waits, holding a place in the queue, until the burst is over (at most max_hold_s); call on the event loop."""
        self.scheduler.reserve()
        self.held += 1
        try:
            over = self._over if self._over is not None else self._watch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(over.wait(), self.max_hold_s)
        finally:
            self.held -= 1
            self.scheduler.unreserve()

    def release(self) -> None:
        """Lets every waiting call go on now (the drain calls it: they are then answered, as draining)."""
        over, self._over = self._over, None
        if over is not None:
            over.set()
        self._resume_engines()

    def _watch(self) -> asyncio.Event:
        over = self._over = asyncio.Event()
        self._watcher = asyncio.get_running_loop().create_task(self._set_when_over(over))
        return over

    def _resume_engines(self) -> None:
        if self.engines is not None:
            self.engines.resume()

    async def _set_when_over(self, over: asyncio.Event) -> None:
        try:
            while self.in_burst() or self.rushing():
                await asyncio.sleep(min(self.window_s, self.rush_window_s) / 8)
        finally:
            if self._over is over:
                self._over = None
            over.set()
            self._resume_engines()
