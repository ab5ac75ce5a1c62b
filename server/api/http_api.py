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
from nmt_serve.server.api.arrivals import ARRIVED
from nmt_serve.server.api.auth import HTTP_REFUSAL, BearerTokenInterceptor
from nmt_serve.server.api.http_body import check_headers, parse_body, read_body
from nmt_serve.server.api.http_origin import OriginPolicy
from nmt_serve.server.api.http_schema import TIMEOUT_HEADER
from nmt_serve.server.api.http_status import COUNTED_AS, HttpAbort, error_body, error_headers, error_object, http_status
from nmt_serve.server.api.service import SERVICE_NAME, TranslationService, Unparsable
from nmt_serve.server.models.metrics import TRANSPORT, TRANSPORTS, Metrics
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

# The gRPC method each authenticated path stands for (metrics, access log, refusals).
METHODS = {"/v1/translate": "Translate", "/v1/translate/stream": "TranslateStream", "/v1/models": "ListModels"}
FULL_NAMES = {method: f"/{SERVICE_NAME}/{method}" for method in (*METHODS.values(), "GetModelInfo")}  # what early admission checks
MODEL_PATH = "/v1/models/"
SERVICED = web.RequestKey("serviced", bool)  # set once the servicer has the call: from then on it counts the call itself


class HttpContext:
    """What the servicer asks of a grpc.aio.ServicerContext, for one HTTP call; `deadline_s` is counted from its arrival."""

    def __init__(self, arrived: float, deadline_s: float | None) -> None:
        self._deadline = None if deadline_s is None else arrived + deadline_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def trailing_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        # The body carries the status's details (error_body); the trailer is gRPC's way of sending them.
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
        self.origin = OriginPolicy(settings)

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self.middleware)
        # No 100 Continue before the call's checks: read_body sends it once they have passed (a body over the
        # limit, or a call without its token, is refused without the client sending the body).
        app.router.add_post("/v1/translate", self.translate, expect_handler=no_early_continue)
        app.router.add_post("/v1/translate/stream", self.translate_stream, expect_handler=no_early_continue)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name}", self.model_info)
        if self.origin.origins:  # CORS: off unless --http-cors-origin names the pages that may call
            app.router.add_route("OPTIONS", "/v1/{path:.*}", self.origin.preflight)
            app.on_response_prepare.append(self.origin.add_cors_headers)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Every call to a /v1 route is counted once, whatever ends it: by the servicer once it has the call, else here."""
        TRANSPORT.set(TRANSPORTS[1])  # this request's task only: the servicer's counts carry transport="http"
        started, method = time.perf_counter(), None if request.method == "OPTIONS" else method_of(request.path)
        ARRIVED.set(time.monotonic())
        try:
            if method is not None:
                self.origin.check_host(request)
            if method is not None and self.auth is not None:
                self._check_token(request, method, started)
            if method is not None and self.admission is not None:
                self._admit(method)
            return await handler(request)
        except HttpAbort as error:
            if not error.counted and method is not None:
                self._count(method, COUNTED_AS.get(error.code, error.code), started)
            response = error_response(error)
            if not request.content.at_eof():
                response.force_close()  # the rest of the body is never read: the connection cannot carry another request
            return response
        except asyncio.CancelledError:  # the client left (while its body was read, say)
            if method is not None and not request.get(SERVICED):
                self._count(method, grpc.StatusCode.CANCELLED.name, started)
            raise
        except web.HTTPException:
            raise  # aiohttp's own answers (no route, wrong method): not calls of the API
        except Exception as error:  # noqa: BLE001 - answered with the JSON body, counted, never aiohttp's bare 500
            logger.warning("HTTP %s %s failed: %s: %s", request.method, request.path, type(error).__name__, error)
            if method is not None and not request.get(SERVICED):
                self._count(method, grpc.StatusCode.INTERNAL.name, started)
            return error_response(HttpAbort(grpc.StatusCode.INTERNAL.name, f"internal error ({type(error).__name__})"))

    def _count(self, method: str, code: str, started: float) -> None:
        self.metrics.answered(method, code, time.perf_counter() - started)

    def _check_token(self, request: web.Request, method: str, started: float) -> None:
        """Exactly one Authorization header, carrying the token (two are refused whatever they hold, as on the gRPC port)."""
        assert self.auth is not None
        given = request.headers.getall("Authorization", [])
        # aiohttp keeps bytes that are not UTF-8 as surrogates: encoded back as they came, they simply do not match.
        if len(given) != 1 or not self.auth.accepts(given[0].encode("utf-8", "surrogateescape")):
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
        request[SERVICED] = True
        return web.json_response(to_json(await self.service.Translate(message, context)))

    async def list_models(self, request: web.Request) -> web.Response:
        context = self._context(request)
        request[SERVICED] = True
        return web.json_response(to_json(await self.service.ListModels(pb.ListModelsRequest(), context)))

    async def model_info(self, request: web.Request) -> web.Response:
        message, context = pb.GetModelInfoRequest(model=request.match_info["name"]), self._context(request)
        request[SERVICED] = True
        return web.json_response(to_json(await self.service.GetModelInfo(message, context)))

    async def translate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one TranslateStreamResponse each; a failure before the first is an HTTP status, after it an
        `error` event. A client that goes away cancels the handler, and with it the stream's engine rows."""
        context = self._context(request)
        message = await self._read(request, pb.TranslateStreamRequest, context)
        stream: AsyncIterator[pb.TranslateStreamResponse] = self.service.TranslateStream(message, context)
        request[SERVICED] = True
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
                await response.write(event({"error": error_object(error.code, error.message)}, "error"))
            await response.write_eof()
            return response
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # ------------------------------------------------------------ helpers

    async def _read(self, request: web.Request, message_class: type[Message], context: HttpContext) -> Message | Unparsable:
        """The body as `message_class`: its headers checked before any of it is read, and all of it arrived within the
        call's deadline (--max-deadline-s at most, from the call's arrival)."""
        limit = self.settings.max_message_bytes
        encodings = check_headers(request, limit)
        remaining = context.time_remaining()
        deadline = (ARRIVED.get() or time.monotonic()) + self.settings.max_deadline_s
        if remaining is not None:
            deadline = min(deadline, time.monotonic() + remaining)
        body = await read_body(request, limit, deadline)
        return await parse_body(body, encodings, message_class, limit)

    def _context(self, request: web.Request) -> HttpContext:
        arrived = ARRIVED.get() or time.monotonic()
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return HttpContext(arrived, None)
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT.name, f"header {TIMEOUT_HEADER} must be a number of seconds above 0, got {raw[:80]!r}")
        return HttpContext(arrived, timeout_s)


async def no_early_continue(_: web.Request) -> None:
    """Sends nothing for `Expect: 100-continue`: read_body answers it once the call's checks have passed."""
    return None


def event(data: dict[str, Any], name: str = "") -> bytes:
    """One server-sent event; JSON holds no raw newline, so one data line carries it."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
