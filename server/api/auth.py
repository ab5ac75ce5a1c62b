"""Optional bearer-token check: calls without `authorization: Bearer <token>` get UNAUTHENTICATED."""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from nmt_serve.server.api.error_details import abort

# Load balancers and orchestrators probe health without credentials; reflection only describes the API.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"  # served beside v1alpha (server/api/reflection.py)
OPEN_SERVICES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/", f"/{REFLECTION_V1}/")


REFUSAL = "missing or wrong bearer token in the authorization metadata"
HTTP_REFUSAL = "missing or wrong bearer token in the Authorization header"  # the HTTP API's (server/api/http_api.py)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`on_refused(method, seconds)` is told of each refused call (metrics), `method` being the bare method name."""

    def __init__(self, token: str, on_refused: Callable[[str, float], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

    def accepts(self, authorization: bytes) -> bool:
        """Whether an authorization value (gRPC metadata or HTTP header) carries the token."""
        # Constant-time comparison: the token must not leak through response timing.
        return hmac.compare_digest(authorization, self._expected)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        # Exactly one authorization entry, carrying the token: with two, which one counts would be a guess (the HTTP
        # port refuses two Authorization headers alike).
        given = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        if len(given) == 1 and self.accepts(given[0].encode("utf-8", "surrogateescape") if isinstance(given[0], str) else given[0]):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # unknown method: grpcio answers UNIMPLEMENTED
        started, method = time.perf_counter(), details.method.rsplit("/", 1)[-1]

        async def refuse(_: object, context: grpc.aio.ServicerContext) -> None:
            if self._on_refused is not None:
                self._on_refused(method, time.perf_counter() - started)
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        # Request-streaming handlers that never read: the message is left unread, so a refusal costs no read and
        # waits for no message (the request deadline passes such handlers by), as the early admission's refusals.
        if handler.response_streaming:
            async def refuse_stream(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
                await refuse(request, context)
                yield  # pragma: no cover - abort raises first

            return grpc.stream_stream_rpc_method_handler(refuse_stream, response_serializer=handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
