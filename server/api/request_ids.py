"""Request ids: the client's `x-request-id` (gRPC metadata or HTTP header) when it is one, else a new one; set for the
call's task (the access log writes it) and sent back with the answer (gRPC initial metadata, HTTP header)."""

from __future__ import annotations

import inspect
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from nmt_serve.server.models.access_log import REQUEST_ID

HEADER = "x-request-id"  # gRPC metadata keys are lower case; HTTP headers match it whatever their case
# Taken as it comes: up to 128 visible ASCII characters (a UUID, a trace id, a balancer's id). Anything else, spaces
# and control characters included, would let a client write into the log lines: it gets a new id instead.
ACCEPTED = re.compile(r"[!-~]{1,128}")
HTTP_KEY = web.RequestKey("request_id", str)  # where the HTTP request keeps its id, for the response's header


def request_id(offered: str | None) -> str:
    """`offered` when it is an id ACCEPTED takes, else a new one (32 hex digits)."""
    return offered if offered is not None and ACCEPTED.fullmatch(offered) else uuid.uuid4().hex


class RequestIds(grpc.aio.ServerInterceptor):
    """The first interceptor: every call has its id from here on, refusals by the later interceptors included."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        offered = next((value for key, value in details.invocation_metadata or () if key == HEADER), None)
        call_id = request_id(offered if isinstance(offered, str) else None)
        REQUEST_ID.set(call_id)  # this call's task: the interceptors after this one and the handler
        handler = await continuation(details)
        return None if handler is None else echoing(handler, call_id)


def echoing(handler: grpc.RpcMethodHandler, call_id: str) -> grpc.RpcMethodHandler:
    """`handler` sending the request id back: in the initial metadata with the first response, and in the trailing
    metadata of every answer. A call refused before any response (warming up, queue full, bad token) ends with
    trailers only: initial metadata sent before the refusal would commit the call, and gRPC clients then no longer
    retry an UNAVAILABLE or a RESOURCE_EXHAUSTED that their retry policy covers."""
    metadata = ((HEADER, call_id),)
    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler), ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler), ("stream_stream", grpc.stream_stream_rpc_method_handler))  # fmt: skip
    kind, wrap = next((kind, wrap) for kind, wrap in kinds if getattr(handler, kind) is not None)
    behaviour = getattr(handler, kind)
    if inspect.isasyncgenfunction(behaviour):
        async def responses(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            context.set_trailing_metadata(metadata)
            first, responses = True, behaviour(request, context)
            try:
                async for response in responses:
                    if first:
                        await context.send_initial_metadata(metadata)
                        first = False
                    yield response
            finally:
                await responses.aclose()  # a stream the client left ends, and is counted, at once

        echoed: Callable[..., Any] = responses
    else:  # a coroutine: one response returned (sent after it returns), or responses written through context.write
        async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            context.set_trailing_metadata(metadata)
            result = await behaviour(request, context)
            if result is not None:
                await context.send_initial_metadata(metadata)
            return result

        echoed = answer
    return wrap(echoed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


@web.middleware
async def http_request_ids(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The HTTP server's first middleware: the request's id for its task and for the response's header."""
    request[HTTP_KEY] = call_id = request_id(request.headers.get(HEADER))
    REQUEST_ID.set(call_id)
    return await handler(request)


async def echo_http_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer carries the id, a stream's too (its headers go out before its events)."""
    if HTTP_KEY in request:
        response.headers["X-Request-Id"] = request[HTTP_KEY]
