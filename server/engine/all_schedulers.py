"""Every served model's scheduler seen as one: what the drain, the early admission, the gauges and the tests ask of "the" scheduler."""

from __future__ import annotations

from collections.abc import Sequence

from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.engine_pool import EnginePool
from nmt_serve.server.engine.scheduler import Rejected, Scheduler


class Schedulers:
    """The schedulers share `pool`, which this starts and stops; with one model it behaves as that model's scheduler."""

    def __init__(self, schedulers: Sequence[Scheduler], pool: EnginePool) -> None:
        if not schedulers:
            raise ValueError("no scheduler to serve")
        self.schedulers = list(schedulers)
        self.pool = pool

    def start(self) -> None:
        self.pool.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.pool.stop(timeout_s)

    @property
    def draining(self) -> bool:
        return all(scheduler.draining for scheduler in self.schedulers)

    @draining.setter
    def draining(self, value: bool) -> None:
        for scheduler in self.schedulers:
            scheduler.draining = value

    @property
    def engines(self) -> list[Engine]:
        return [engine for scheduler in self.schedulers for engine in scheduler.engines]

    @property
    def in_flight(self) -> int:
        return sum(scheduler.in_flight for scheduler in self.schedulers)

    @property
    def queue_depth(self) -> int:
        return sum(scheduler.queue_depth for scheduler in self.schedulers)

    @property
    def running(self) -> int:
        return sum(scheduler.running for scheduler in self.schedulers)

    @property
    def places_taken(self) -> int:
        """The fullest model's requests in flight and places held."""
        return max(scheduler.places_taken for scheduler in self.schedulers)

    def reserve(self) -> None:
        """A place in every model's queue: the call's model is named in its message, not read yet."""
        for scheduler in self.schedulers:
            scheduler.reserve()

    def unreserve(self) -> None:
        for scheduler in self.schedulers:
            scheduler.unreserve()

    def refusal(self) -> Rejected | None:
        """What any request would meet now, whichever model it names: a refusal only when every model refuses
        (the model is in the message, which the early admission does not read)."""
        refusals = [scheduler.refusal() for scheduler in self.schedulers]
        return None if any(refusal is None for refusal in refusals) else refusals[0]
