"""The one place where failures become gRPC status codes (docs/api.md has the table)."""

from __future__ import annotations

import logging

import grpc

from nmt_serve.server.engine.jobs import Outcome
from nmt_serve.server.engine.scheduler import Rejected, RequestFailed
from nmt_serve.server.models.requests import InvalidRequest, UnknownModel, clipped

logger = logging.getLogger(__name__)


class NotReady(Exception):
    """The model is still loading or warming up."""


class MessageTooLarge(Exception):
    """A request message over --max-message-bytes."""


REJECTION_CODES = {
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "queue_tokens": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "draining": grpc.StatusCode.UNAVAILABLE,
    "expired": grpc.StatusCode.DEADLINE_EXCEEDED,
}
OUTCOME_CODES = {
    Outcome.EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Outcome.CANCELLED: grpc.StatusCode.CANCELLED,
    Outcome.FAILED: grpc.StatusCode.INTERNAL,
    Outcome.OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


# Whatever a message quotes, it stays far below a client's metadata limit (16 KiB by default).
MAX_DETAIL_CHARS = 1000


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """A deliberate code and a bounded message for every failure; anything unforeseen is INTERNAL, never UNKNOWN."""
    code, message = _status_for(error)
    return code, clipped(message, MAX_DETAIL_CHARS)


def _status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, MessageTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, UnknownModel):
        return grpc.StatusCode.NOT_FOUND, str(error)
    if isinstance(error, NotReady):
        return grpc.StatusCode.UNAVAILABLE, str(error) or "model is warming up; retry shortly"
    if isinstance(error, Rejected):
        return REJECTION_CODES.get(error.reason, grpc.StatusCode.UNAVAILABLE), str(error)
    if isinstance(error, RequestFailed):
        code = OUTCOME_CODES.get(error.outcome, grpc.StatusCode.INTERNAL)
        # Engine errors can carry ONNX Runtime internals; the client gets a stable message, the log the detail.
        return code, "translation failed inside the engine" if code is grpc.StatusCode.INTERNAL else str(error)
    logger.error("unexpected error answered as INTERNAL", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})"
