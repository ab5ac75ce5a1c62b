"""Reads every unary request inside the handler, under a deadline: no call waits forever for its request message.

grpcio reads a unary call's request before any handler or deadline of ours runs, and waits as long as the client
keeps the stream open: a message that declares 100 bytes and sends 10, or headers with no message at all, held the
call (and its HTTP/2 stream) with no end when the client had set no deadline. Served as request-streaming
instead (the same bytes on the wire), the read is ours: a stream that ends before a whole message is
INVALID_ARGUMENT at once, a message still missing at the deadline is DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from nmt_serve.server.api.error_details import abort


# What grpc core answers when it ends a call before handing its request message to the handler, which then sees the
# stream end as if the message had been cut short, but cannot write its own status: a message over grpc core's receive
# limit (server/api/service.py, transport_receive_limit), or one that decompresses past it, gets RESOURCE_EXHAUSTED.
# A compressed message that does not decompress gets INTERNAL from core, and is counted RESOURCE_EXHAUSTED too: the
# handler cannot see which of the two core answered (neither the code nor the call's grpc-encoding reaches it).
CORE_REFUSAL = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestDeadline(grpc.aio.ServerInterceptor):
    """`max_wait_s` bounds the wait for the request (the client's deadline when shorter); `on_failed(method, code, seconds)`
    is told of each call this ends (metrics)."""

    def __init__(self, max_wait_s: float, on_failed: Callable[[str, str, float], None] | None = None) -> None:
        self.max_wait_s = max_wait_s
        self._on_failed = on_failed

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler  # streaming requests are read by their own handler, message by message
        method, started = details.method.rsplit("/", 1)[-1], time.perf_counter()
        read, ended = self._reader(method, started)

        async def whole_request(context: grpc.aio.ServicerContext) -> Any:
            request = await read(context)
            await ended(context)  # before the handler: the call is answered, and counted, once
            return request

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_response(_: object, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await whole_request(context), context)

            return grpc.stream_unary_rpc_method_handler(unary_response, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)  # fmt: skip
        streaming = handler.unary_stream
        if inspect.isasyncgenfunction(streaming):
            async def stream_response(_: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                responses = streaming(await whole_request(context), context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    # Closed now, not whenever the collector finds it: a stream the client left ends (and is counted) at once.
                    await responses.aclose()

            behaviour: Callable[..., Any] = stream_response
        else:  # a coroutine that writes through context.write (grpc_health's Watch)
            async def written_response(_: object, context: grpc.aio.ServicerContext) -> None:
                await streaming(await whole_request(context), context)

            behaviour = written_response
        return grpc.stream_stream_rpc_method_handler(behaviour, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)  # fmt: skip

    def _reader(self, method: str, started: float) -> tuple[Callable[[grpc.aio.ServicerContext], Awaitable[Any]],
                                                             Callable[[grpc.aio.ServicerContext], Awaitable[None]]]:  # fmt: skip
        """`read`: the request message, within the call's time; `ended`: the stream ends after it (a unary call carries
        one message: a second one is refused rather than dropped unread)."""
        read_by = [0.0]

        async def read(context: grpc.aio.ServicerContext) -> Any:
            remaining = context.time_remaining()
            # From the call's arrival: the wait for the message is part of the call's one maximum.
            wait_s = self.max_wait_s - (time.perf_counter() - started)
            wait_s = wait_s if remaining is None else min(remaining, wait_s)
            if wait_s <= 0:
                await self._fail(context, method, started, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the call's deadline had passed before its request message was read")  # fmt: skip
            read_by[0] = time.perf_counter() + wait_s
            request = await self._next(context, method, started, wait_s, "the request message did not arrive")
            if request is grpc.aio.EOF:
                await self._fail(context, method, started, grpc.StatusCode.INVALID_ARGUMENT,
                                 "the request stream ended before a whole request message (cut short, or none sent)",
                                 answered_by_core=CORE_REFUSAL)  # fmt: skip
            return request

        async def ended(context: grpc.aio.ServicerContext) -> None:
            # Bytes after the message that do not make a whole one end the stream as a cut-short message would:
            # grpc core drops them, and this sees the end.
            wait_s = max(read_by[0] - time.perf_counter(), 0.001)
            if await self._next(context, method, started, wait_s, "the request stream did not end after its message") is not grpc.aio.EOF:
                await self._fail(context, method, started, grpc.StatusCode.INVALID_ARGUMENT,
                                 "a unary call carries one request message; a second one arrived")  # fmt: skip

        return read, ended

    async def _next(self, context: grpc.aio.ServicerContext, method: str, started: float, wait_s: float, late: str) -> Any:
        """The next message, or EOF; DEADLINE_EXCEEDED ("`late` within `wait_s`") when neither has come in time."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the read as a task of its own, one more
            # task per call on the event loop that takes every call in.
            async with asyncio.timeout(wait_s):
                return await context.read()
        except asyncio.CancelledError:
            # The client cancelled, or grpc core ended the call itself before its message (an unknown
            # grpc-encoding: core answers INTERNAL, and cancels the handler): CANCELLED is what the server saw.
            if self._on_failed is not None:
                self._on_failed(method, grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
            raise
        except TimeoutError:
            await self._fail(context, method, started, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"{late} within {wait_s:.3g} s")  # fmt: skip

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, started: float, code: grpc.StatusCode, message: str,
                    answered_by_core: grpc.StatusCode | None = None) -> None:
        """Ends the call with `code`; counted under `answered_by_core` instead when grpc core had already answered it
        (our status could not be written)."""
        counted = code
        try:
            await abort(context, code, message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            if answered_by_core is not None:
                counted = answered_by_core
            raise
        finally:
            if self._on_failed is not None:
                self._on_failed(method, counted.name, time.perf_counter() - started)
