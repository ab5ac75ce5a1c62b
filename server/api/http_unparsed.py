"""Counting the HTTP requests aiohttp answers itself, 400 before any route, because it could not parse them."""

from __future__ import annotations

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from nmt_serve.server.models.metrics import Metrics

# aiohttp hands the error handler of an unparsable request a placeholder message with this method (and path "/"):
# the request's own method and path are not kept, so such a call cannot be counted under its route.
UNPARSED_METHOD = "UNKNOWN"


def unparsed_request_counter(metrics: Metrics) -> type[AbstractAccessLogger]:
    """An access-log class for web.AppRunner that counts aiohttp's own 400s in nmt_http_unparsed_requests_total and
    logs nothing: the calls that reach a route are counted by the API itself, with their method and code."""

    class UnparsedRequestCounter(AbstractAccessLogger):
        def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
            if request.method == UNPARSED_METHOD:
                metrics.http_unparsed.inc()

    return UnparsedRequestCounter
