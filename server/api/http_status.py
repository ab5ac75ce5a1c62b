"""The one table from gRPC status codes to HTTP statuses (docs/http.md has it too), and the JSON error body."""

from __future__ import annotations

import json

import grpc

from nmt_serve.server.api.error_details import RETRY_DELAY_S, details_json

# Every status the service answers maps to one HTTP status; one not listed is 500. Three answers are the HTTP transport's
# own, with codes of their own: a request body over the limit (grpcio answers RESOURCE_EXHAUSTED to that message) is
# PAYLOAD_TOO_LARGE, a body that has not arrived within the call's deadline (the gRPC port's DEADLINE_EXCEEDED
# for a message that never came) is REQUEST_TIMEOUT, and a body in a media type or content encoding the server does
# not take is UNSUPPORTED_MEDIA_TYPE.
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
# The gRPC code each of them is counted under in nmt_requests_total, so that a query sums both transports alike.
COUNTED_AS = {PAYLOAD_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED.name, REQUEST_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED.name,
              UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT.name}  # fmt: skip
HTTP_STATUS = {
    grpc.StatusCode.OK.name: 200,
    grpc.StatusCode.INVALID_ARGUMENT.name: 400,
    grpc.StatusCode.UNAUTHENTICATED.name: 401,
    grpc.StatusCode.PERMISSION_DENIED.name: 403,  # a Host the server does not answer for (server/api/http_origin.py)
    grpc.StatusCode.NOT_FOUND.name: 404,
    REQUEST_TIMEOUT: 408,
    PAYLOAD_TOO_LARGE: 413,
    UNSUPPORTED_MEDIA_TYPE: 415,
    grpc.StatusCode.RESOURCE_EXHAUSTED.name: 429,
    grpc.StatusCode.CANCELLED.name: 499,  # nginx's "client closed request": the client left, nobody reads it
    grpc.StatusCode.UNAVAILABLE.name: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED.name: 504,
}
OTHER_STATUS = 500
# Statuses a client should retry later, and after how long (seconds): the delay the gRPC status's RetryInfo gives.
RETRY_AFTER_S = {HTTP_STATUS[code]: delay for code, delay in RETRY_DELAY_S.items()}


class HttpAbort(Exception):
    """A call answered with a status other than OK: `code` is a gRPC status code's name or one of the transport's own.
    `counted`: the servicer or the admission check has counted the call already; else the middleware counts it."""

    def __init__(self, code: str, message: str, counted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.counted = counted


def http_status(code: str) -> int:
    """The HTTP status of a gRPC status code's name (or of PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, UNSUPPORTED_MEDIA_TYPE)."""
    return HTTP_STATUS.get(code, OTHER_STATUS)


def error_object(code: str, message: str) -> dict:
    """{"code": ..., "message": ..., "details": [...]}: the gRPC code's name, so that a client handles both transports
    alike, and the google.rpc details the gRPC status carries, in their proto3 JSON form (server/api/error_details.py)."""
    return {"code": code, "message": message, "details": details_json(code, message)}


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": error_object(code, message)}).encode()


def error_headers(status: int) -> dict[str, str]:
    retry = RETRY_AFTER_S.get(status)
    return {"Retry-After": str(retry)} if retry is not None else {}
