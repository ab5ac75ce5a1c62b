"""Under a burst, admitted calls wait for the arrivals to pause, holding their places, so that refusals go out first.

Why: in a burst of 1,000 calls against a queue of 256 the refusals queued on the event loop behind the calls admitted
before them (reading the message, tokenizing, submitting, answering: about twice a refusal's loop time each) and
behind the engines' start on them; the refusals' p99 was 2.4x-3x that of a bare grpcio server refusing every call
(bench/results/burst.md). Once a quarter of the queue is taken, a newly admitted call holds its place and waits
until no call has arrived for QUIET_S (or MAX_HOLD_S has passed, or the server drains), then goes on as usual.
Below that, and under steady load, no call waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from nmt_serve.server.api.arrivals import ArrivalClock

# Arrivals paused this long end a burst: a burst's calls reach the handlers tens of microseconds apart.
QUIET_S = 0.002
# The longest an admitted call waits, however long arrivals go on.
MAX_HOLD_S = 0.5


class Places(Protocol):
    """What the hold needs of the scheduler (server/engine/all_schedulers.py)."""

    draining: bool

    @property
    def places_taken(self) -> int: ...

    def reserve(self) -> None: ...

    def unreserve(self) -> None: ...


class BurstHold:
    """`threshold`: places taken from which an admitted call waits (0: never)."""

    def __init__(self, scheduler: Places, clock: ArrivalClock, threshold: int, quiet_s: float = QUIET_S, max_hold_s: float = MAX_HOLD_S) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.threshold = threshold
        self.quiet_s = quiet_s
        self.max_hold_s = max_hold_s
        self.held = 0  # calls waiting now
        self._opened: asyncio.Event | None = None  # set once arrivals pause; shared by the calls waiting for it
        self._watcher: asyncio.Task[None] | None = None

    def applies(self) -> bool:
        """Whether a call admitted now waits."""
        return self.threshold > 0 and self.scheduler.places_taken >= self.threshold

    async def hold(self) -> None:
        """Waits, holding a place in the queue, until arrivals pause (at most max_hold_s); call on the event loop."""
        self.scheduler.reserve()
        self.held += 1
        try:
            opened = self._opened if self._opened is not None else self._watch_arrivals()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), self.max_hold_s)
        finally:
            self.held -= 1
            self.scheduler.unreserve()

    def release(self) -> None:
        """Lets every waiting call go on now (the drain calls it: they are then answered, as draining)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.set()

    def _watch_arrivals(self) -> asyncio.Event:
        opened = self._opened = asyncio.Event()
        self._watcher = asyncio.get_running_loop().create_task(self._open_when_quiet(opened))
        return opened

    async def _open_when_quiet(self, opened: asyncio.Event) -> None:
        try:
            while not self.scheduler.draining and self.clock.quiet_for() < self.quiet_s:
                await asyncio.sleep(max(self.quiet_s - self.clock.quiet_for(), self.quiet_s / 4))
        finally:
            if self._opened is opened:
                self._opened = None
            opened.set()
