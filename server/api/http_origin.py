"""Which web pages may use the HTTP API: the Host a call names (against DNS rebinding) and CORS (off unless configured).

Why: with no token set, any page the operator opens could post to a server on localhost, and a name that a rebinding
DNS server points at 127.0.0.1 would make the answers readable to that page. The API takes JSON bodies only
(server/api/http_body.py), so a page's post needs a CORS preflight, which the server answers only for the origins
--http-cors-origin names; and a call naming a Host the server does not answer for is refused.
"""

from __future__ import annotations

import ipaddress

import grpc
from aiohttp import web

from nmt_serve.server.api.http_status import HttpAbort
from nmt_serve.server.models.requests import clipped
from nmt_serve.server.settings import ServerSettings

ANY = "*"
LOCAL_NAMES = ("localhost",)  # and its subdomains (RFC 6761: they resolve to loopback only)
PREFLIGHT_MAX_AGE_S = 600
ALLOWED_METHODS = "GET, POST"
ALLOWED_HEADERS = "Authorization, Content-Type, Request-Timeout, X-Request-Id"
EXPOSED_HEADERS = "X-Request-Id, Retry-After"


def host_name(host: str) -> str:
    """The name or address of a Host header value, without its port (an IPv6 address comes in brackets)."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip().lower() for part in value.split(",") if part.strip())


class OriginPolicy:
    """Host names (`--http-allowed-hosts`) and CORS origins (`--http-cors-origin`); both lists are comma-separated, `*` is any."""

    def __init__(self, settings: ServerSettings) -> None:
        bound = settings.http_host.lower()
        self.hosts = comma_list(settings.http_allowed_hosts) + (() if is_address(bound) or not bound else (bound,))
        self.origins = comma_list(settings.http_cors_origin)

    def host_allowed(self, host: str | None) -> bool:
        """An address (a call that reached a bound address by it), localhost, or a name of the list (".example.com": the
        domain and its subdomains); a call without Host (HTTP/1.0) is no browser's."""
        if host is None or ANY in self.hosts:
            return True
        name = host_name(host).lower().rstrip(".")
        if is_address(name) or name in LOCAL_NAMES or name.endswith(".localhost"):
            return True
        return any(name == allowed or (allowed.startswith(".") and (name.endswith(allowed) or name == allowed[1:])) for allowed in self.hosts)

    def check_host(self, request: web.Request) -> None:
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            raise HttpAbort(grpc.StatusCode.PERMISSION_DENIED.name,
                            f"Host {clipped(host or '')!r} is not a name this server answers for; call it by its address or localhost, "
                            "or add the name to nmt-serve --http-allowed-hosts")  # fmt: skip

    def allowed_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`, or None (no CORS answer)."""
        if origin is None or not self.origins:
            return None
        if ANY in self.origins:
            return ANY
        return origin if origin.lower().rstrip("/") in self.origins else None

    async def add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: /v1 answers readable by the configured origins' pages."""
        allowed = self.allowed_origin(request.headers.get("Origin")) if request.path.startswith("/v1/") else None
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
            response.headers.add("Vary", "Origin")

    async def preflight(self, request: web.Request) -> web.Response:
        """OPTIONS on a /v1 route: 204 with what an allowed origin may send; 403 for any other origin."""
        if self.allowed_origin(request.headers.get("Origin")) is None:
            return web.Response(status=403)
        return web.Response(status=204, headers={"Access-Control-Allow-Methods": ALLOWED_METHODS, "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                                                 "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})  # fmt: skip
