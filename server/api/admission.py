"""Refuses a call at its arrival when the scheduler has no place for any request, before its message is read.

Why: under a burst, a refusal that waits its turn behind the parsing, tokenizing and admission of every call that
arrived before it came back after seconds (p99 0.9 to 2.2 s in a burst of 1,000 calls against a queue of 256);
refused at arrival it costs one status write and no read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from nmt_serve.server.api.burst_hold import BurstHold
from nmt_serve.server.api.error_details import abort
from nmt_serve.server.api.status import status_for
from nmt_serve.server.engine.all_schedulers import Schedulers
from nmt_serve.server.engine.scheduler import Scheduler
from nmt_serve.server.models.metrics import Metrics


class EarlyAdmission(grpc.aio.ServerInterceptor):
    """For the methods in `methods` (full names, "/package.Service/Method"); each refusal is counted like the service's own.

    Between hold() and release() (the drain's last phase, server/main.py), refusals wait and are answered together:
    grpc core ends CANCELLED the calls it holds unhanded when the server stops (grpc/grpc#41785); answered together
    just before the stop, clients that back off after an UNAVAILABLE are all backing off, not sending, at that moment.
    """

    def __init__(self, scheduler: Scheduler | Schedulers, methods: frozenset[str], metrics: Metrics | None = None, max_hold_s: float = 5.0,
                 burst_hold: BurstHold | None = None) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.burst_hold = burst_hold  # admitted calls wait there under a burst (server/api/burst_hold.py)
        self.methods = methods
        self.metrics = metrics
        self.max_hold_s = max_hold_s  # a held refusal is answered after this long whatever happens
        self._release: asyncio.Event | None = None
        self._held = 0

    @property
    def holding(self) -> bool:
        return self._release is not None and not self._release.is_set()

    def hold(self) -> None:
        """From now on refusals wait for release(); call on the event loop."""
        self._release = asyncio.Event()

    async def release(self, timeout_s: float = 1.0) -> None:
        """Answers the held refusals, and returns once they are answered (at most timeout_s)."""
        if self._release is not None:
            self._release.set()
        deadline = time.monotonic() + timeout_s
        while self._held and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        release = self._release if self.holding else None
        if release is None:
            await abort(context, code, message)
        self._held += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), self.max_hold_s)
            await abort(context, code, message)
        finally:
            self._held -= 1

    async def _wait_out_burst(self, hold: BurstHold, method: str) -> None:
        """The burst hold, before the message is read (the read is part of what waits); a call its client cancels there
        never reaches a handler, so it is counted here."""
        started = time.perf_counter()
        try:
            await hold.hold()
        except asyncio.CancelledError:
            if self.metrics is not None:
                self.metrics.answered(method.rsplit("/", 1)[-1], grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
            raise

    def refusal_now(self, method: str) -> tuple[grpc.StatusCode, str] | None:
        """For a call to `method` (a full name) arriving now: its status when the scheduler has no place for any request
        (counted as a refusal), else None. The HTTP API asks it too, before reading a body."""
        rejected = self.scheduler.refusal() if method in self.methods else None
        if rejected is None:
            return None
        code, message = status_for(rejected)
        if self.metrics is not None:
            self.metrics.rejected_for(rejected.reason)
            self.metrics.answered(method.rsplit("/", 1)[-1], code.name, 0.0)
        return code, message

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        refused = self.refusal_now(details.method)
        if self.burst_hold is not None and details.method in self.methods:
            self.burst_hold.arrived()
            if refused is None and self.burst_hold.applies():
                await self._wait_out_burst(self.burst_hold, details.method)
        if refused is None:
            return await continuation(details)
        code, message = refused
        # Request-streaming handlers that never read: the message is left unread, whatever the client sends.
        handler = await continuation(details)
        if handler.response_streaming:
            async def refuse_stream(_: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await self._refuse(context, code, message)
                yield  # pragma: no cover - abort raises first

            return grpc.stream_stream_rpc_method_handler(refuse_stream, response_serializer=handler.response_serializer)

        async def refuse(_: object, context: grpc.aio.ServicerContext) -> None:
            await self._refuse(context, code, message)

        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
