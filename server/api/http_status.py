"""The one table from gRPC status codes to HTTP statuses (docs/http.md has it too), and the JSON error body."""

from __future__ import annotations

import json

import grpc

# Every status the service answers maps to one HTTP status; one not listed is 500. Two answers are the HTTP transport's
# own, with codes of their own: a request body over the limit (grpcio answers RESOURCE_EXHAUSTED to that message) is
# PAYLOAD_TOO_LARGE, and a body that has not arrived within the call's deadline (the gRPC port's DEADLINE_EXCEEDED
# for a message that never came) is REQUEST_TIMEOUT.
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
# The gRPC code each of them is counted under in nmt_requests_total, so that a query sums both transports alike.
COUNTED_AS = {PAYLOAD_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED.name, REQUEST_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED.name}
HTTP_STATUS = {
    grpc.StatusCode.OK.name: 200,
    grpc.StatusCode.INVALID_ARGUMENT.name: 400,
    grpc.StatusCode.UNAUTHENTICATED.name: 401,
    grpc.StatusCode.NOT_FOUND.name: 404,
    REQUEST_TIMEOUT: 408,
    PAYLOAD_TOO_LARGE: 413,
    grpc.StatusCode.RESOURCE_EXHAUSTED.name: 429,
    grpc.StatusCode.CANCELLED.name: 499,  # nginx's "client closed request": the client left, nobody reads it
    grpc.StatusCode.UNAVAILABLE.name: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED.name: 504,
}
OTHER_STATUS = 500
# Statuses a client should retry later, and after how long (seconds): a full queue drains within a few steps,
# a draining or warming server is replaced by its balancer within about a second.
RETRY_AFTER_S = {429: 1, 503: 1}


def http_status(code: str) -> int:
    """The HTTP status of a gRPC status code's name (or of PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT)."""
    return HTTP_STATUS.get(code, OTHER_STATUS)


def error_body(code: str, message: str) -> bytes:
    """{"error": {"code": ..., "message": ...}}: the gRPC code's name, so that a client handles both transports alike."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def error_headers(status: int) -> dict[str, str]:
    retry = RETRY_AFTER_S.get(status)
    return {"Retry-After": str(retry)} if retry is not None else {}
