"""The HTTP/JSON API's handlers: each calls the gRPC servicer's own method, so limits, validation, status codes and
metrics are the gRPC API's; only the transport differs (JSON bodies, server-sent events, server/api/http_status.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.admission import EarlyAdmission
from nmt_serve.server.api.auth import HTTP_REFUSAL, BearerTokenInterceptor
from nmt_serve.server.api.http_status import COUNTED_AS, PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, error_body, error_headers, http_status
from nmt_serve.server.api.service import SERVICE_NAME, TranslationService, Unparsable
from nmt_serve.server.models.metrics import TRANSPORT, TRANSPORTS, Metrics
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "Request-Timeout"  # seconds; the HTTP counterpart of a gRPC deadline (none: the server's default)
# The gRPC method each authenticated path stands for (metrics, access log, refusals).
METHODS = {"/v1/translate": "Translate", "/v1/translate/stream": "TranslateStream", "/v1/models": "ListModels"}
FULL_NAMES = {method: f"/{SERVICE_NAME}/{method}" for method in (*METHODS.values(), "GetModelInfo")}  # what early admission checks
MODEL_PATH = "/v1/models/"


class HttpAbort(Exception):
    """A call answered with a status other than OK: `code` is a gRPC status code's name (or PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT).
    `counted`: the servicer or the admission check has counted the call already; else the middleware counts it."""

    def __init__(self, code: str, message: str, counted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.counted = counted


class HttpContext:
    """What the servicer asks of a grpc.aio.ServicerContext, for one HTTP call."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise HttpAbort(code.name, details, counted=True)  # the servicer counts every call it answers


def to_json(message: Message) -> dict[str, Any]:
    """proto3 JSON with the proto's field names (docs/api.md's), every field present."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def error_response(error: HttpAbort) -> web.Response:
    status = http_status(error.code)
    return web.Response(status=status, body=error_body(error.code, error.message), content_type="application/json",
                        headers=error_headers(status))  # fmt: skip


def method_of(path: str) -> str | None:
    return "GetModelInfo" if path.startswith(MODEL_PATH) else METHODS.get(path)


class HttpApi:
    """The /v1 routes and the middleware every request passes (transport label, token, errors)."""

    def __init__(self, service: TranslationService, settings: ServerSettings, metrics: Metrics, admission: EarlyAdmission | None = None) -> None:
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self.admission = admission  # refuses translations at arrival when no place is left, before the body is read
        self.auth = BearerTokenInterceptor(settings.auth_token) if settings.auth_token else None  # its check only; counted below

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self.middleware)
        app.router.add_post("/v1/translate", self.translate)
        app.router.add_post("/v1/translate/stream", self.translate_stream)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name}", self.model_info)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        TRANSPORT.set(TRANSPORTS[1])  # this request's task only: the servicer's counts carry transport="http"
        started, method = time.perf_counter(), method_of(request.path)
        try:
            if method is not None and self.auth is not None:
                self._check_token(request, method, started)
            if method is not None and self.admission is not None:
                self._admit(method)
            return await handler(request)
        except HttpAbort as error:
            if not error.counted and method is not None:
                self.metrics.answered(method, COUNTED_AS.get(error.code, error.code), time.perf_counter() - started)
            response = error_response(error)
            if error.code in COUNTED_AS:
                response.force_close()  # the rest of the body is never read: the connection cannot carry another request
            return response

    def _check_token(self, request: web.Request, method: str, started: float) -> None:
        assert self.auth is not None
        if not self.auth.accepts(request.headers.get("Authorization", "").encode()):
            self.metrics.refused(method, time.perf_counter() - started)
            raise HttpAbort(grpc.StatusCode.UNAUTHENTICATED.name, HTTP_REFUSAL, counted=True)

    def _admit(self, method: str) -> None:
        """As the gRPC port's early admission: a translation that finds no place left is refused before its body is read."""
        assert self.admission is not None
        refused = self.admission.refusal_now(FULL_NAMES[method])
        if refused is not None:
            raise HttpAbort(refused[0].name, refused[1], counted=True)

    # ------------------------------------------------------------ routes

    async def translate(self, request: web.Request) -> web.Response:
        context = self._context(request)
        message = await self._read(request, pb.TranslateRequest, context)
        return web.json_response(to_json(await self.service.Translate(message, context)))

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(to_json(await self.service.ListModels(pb.ListModelsRequest(), self._context(request))))

    async def model_info(self, request: web.Request) -> web.Response:
        message = pb.GetModelInfoRequest(model=request.match_info["name"])
        return web.json_response(to_json(await self.service.GetModelInfo(message, self._context(request))))

    async def translate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one TranslateStreamResponse each; a failure before the first is an HTTP status, after it an
        `error` event. A client that goes away cancels the handler, and with it the stream's engine rows."""
        context = self._context(request)
        message = await self._read(request, pb.TranslateStreamRequest, context)
        stream: AsyncIterator[pb.TranslateStreamResponse] = self.service.TranslateStream(message, context)
        try:
            first = await anext(stream)  # validation, admission and the first step: an error here still gets its status
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no"})  # fmt: skip
            await response.prepare(request)
            await response.write(event(to_json(first)))
            try:
                async for reply in stream:
                    await response.write(event(to_json(reply)))
            except HttpAbort as error:
                await response.write(event({"error": {"code": error.code, "message": error.message}}, "error"))
            await response.write_eof()
            return response
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # ------------------------------------------------------------ helpers

    async def _read(self, request: web.Request, message_class: type[Message], context: HttpContext) -> Message | Unparsable:
        """The body as `message_class`; a declared length over the limit is refused before any of the body is read, and
        a body still incomplete at the call's deadline (--max-deadline-s at most) is REQUEST_TIMEOUT: aiohttp itself
        waits for a stalled body as long as the client keeps the connection open."""
        limit = self.settings.max_message_bytes
        too_large = (f"request body has {{}} bytes; the limit is {limit} bytes (max_message_bytes, set by nmt-serve --max-message-bytes); "
                     "send fewer or shorter texts per request")  # fmt: skip
        if request.content_length is not None and request.content_length > limit:
            raise HttpAbort(PAYLOAD_TOO_LARGE, too_large.format(request.content_length))
        remaining = context.time_remaining()
        wait_s = self.settings.max_deadline_s if remaining is None else min(remaining, self.settings.max_deadline_s)
        try:
            async with asyncio.timeout(wait_s):
                body = await request.read()  # a chunked body stops at the app's client_max_size, the same limit
        except web.HTTPRequestEntityTooLarge:
            raise HttpAbort(PAYLOAD_TOO_LARGE, too_large.format(f"more than {limit}")) from None
        except TimeoutError:
            raise HttpAbort(REQUEST_TIMEOUT, f"the request body did not arrive within {wait_s:.3g} s") from None
        try:
            return json_format.Parse(body.decode("utf-8"), message_class())
        except (json_format.ParseError, UnicodeDecodeError) as error:
            return Unparsable(message_class.DESCRIPTOR.name, error)

    def _context(self, request: web.Request) -> HttpContext:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return HttpContext(None)
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT.name, f"header {TIMEOUT_HEADER} must be a number of seconds above 0, got {raw[:80]!r}")
        return HttpContext(timeout_s)


def event(data: dict[str, Any], name: str = "") -> bytes:
    """One server-sent event; JSON holds no raw newline, so one data line carries it."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
