"""The HTTP server beside gRPC, on the same event loop: the /v1 API, probes, the OpenAPI document and the page at /."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from nmt_serve.server.api.admission import EarlyAdmission
from nmt_serve.server.api.http_api import HttpApi
from nmt_serve.server.api.http_schema import openapi_document
from nmt_serve.server.api.http_unparsed import unparsed_request_counter
from nmt_serve.server.api.request_ids import echo_http_request_id, http_request_ids
from nmt_serve.server.api.service import TranslationService
from nmt_serve.server.models.metrics import Metrics
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger("nmt-serve")

STATIC = Path(__file__).with_name("static")  # package data: the page, plain HTML and JS
API_VERSION = "v1"
# How long a stop waits for handlers still running before cancelling them: the drain stops the HTTP server only once
# the scheduler's calls have finished or the grace period is over, so what is left is answers being written, or calls
# to cut off without adding to the grace period.
STOP_WAIT_S = 1.0
KEEPALIVE_S = 75.0  # nginx's default keepalive_timeout


class HttpServer:
    """`ready()` says whether the server takes translations (warm, not draining): /readyz answers 200 only then."""

    def __init__(self, service: TranslationService, settings: ServerSettings, metrics: Metrics, ready: Callable[[], bool],
                 admission: EarlyAdmission | None = None) -> None:
        self.settings = settings
        self.ready = ready
        self.port = 0
        # The body limit is the gRPC message limit, for bodies of unknown length too (server/api/http_api.py checks declared ones).
        app = web.Application(client_max_size=settings.max_message_bytes, middlewares=[http_request_ids])
        app.on_response_prepare.append(echo_http_request_id)
        HttpApi(service, settings, metrics, admission).add_routes(app)
        app.router.add_get("/healthz", self.live)
        app.router.add_get("/readyz", self.readiness)
        self._openapi = openapi_document(API_VERSION)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/", self.page)
        app.router.add_static("/static/", STATIC)
        # A client that goes away cancels its handler, and with it the call's engine rows (not only at the next write).
        # No lingering: a body left unread (one refused for its size) is not read and thrown away, its connection is
        # closed once the answer is out.
        # An idle keep-alive connection is closed after KEEPALIVE_S (aiohttp's own default is about an hour).
        # No decoding by aiohttp: server/api/http_body.py undoes a body's Content-Encoding itself, bounded, with a JSON error
        # for one it does not take.
        # No access log line (server/models/access_log.py writes the calls'); aiohttp's access-log hook counts the requests
        # it could not parse, the only ones that never reach a handler.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=logger, access_log_class=unparsed_request_counter(metrics),
                                     lingering_time=0, keepalive_timeout=KEEPALIVE_S, shutdown_timeout=min(settings.grace_s, STOP_WAIT_S),
                                     auto_decompress=False)  # fmt: skip

    async def start(self) -> int:
        """Listens on --http-host:--http-port; returns the bound port."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port, reuse_port=False, ssl_context=self._tls())
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    def _tls(self) -> ssl.SSLContext | None:
        """With --tls-cert and --tls-key, the HTTP port speaks TLS only, with the gRPC port's certificate: the token
        a client sends is never readable on the wire, whichever port it uses."""
        if not self.settings.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        return context

    async def stop(self) -> None:
        """Stops listening, lets running handlers finish (at most STOP_WAIT_S), then closes every connection."""
        await self._runner.cleanup()

    async def live(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def readiness(self, _: web.Request) -> web.Response:
        if self.ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready"}, status=503, headers={"Retry-After": "1"})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    async def page(self, _: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")
