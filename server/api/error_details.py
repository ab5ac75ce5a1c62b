"""Machine-readable error details, the google.rpc way: a refused call's status carries a google.rpc.Status in the
`grpc-status-details-bin` trailer (grpcio-status reads it: `rpc_status.from_call`), and the HTTP error body carries
the same details in their proto3 JSON form. INVALID_ARGUMENT gets a BadRequest with one field violation per problem
the message names; a status worth retrying (a full queue, a draining or warming server) gets a RetryInfo with the
delay the HTTP API's Retry-After header gives."""

from __future__ import annotations

import re
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb

# Seconds a client should wait before retrying, by gRPC code: a full queue drains within a few steps, a draining or
# warming server is replaced by its balancer within about a second. The HTTP Retry-After header uses the same table.
RETRY_DELAY_S = {grpc.StatusCode.RESOURCE_EXHAUSTED.name: 1, grpc.StatusCode.UNAVAILABLE.name: 1}

# Each problem a message names starts with its field path (texts[3], options.beam_size), after at most a short
# label ("invalid options: options.beam_size ..."): a request field, list indexes and sub-fields.
_REQUEST_FIELDS = sorted({field.name for message in (pb.TranslateRequest, pb.TranslateStreamRequest, pb.GetModelInfoRequest)
                          for field in message.DESCRIPTOR.fields}, key=len, reverse=True)  # fmt: skip
_LEADING_FIELD_PATH = re.compile(rf"^(?:[a-z ]+: )?((?:{'|'.join(_REQUEST_FIELDS)})(?:\[\d+\])?(?:\.\w+(?:\[\d+\])?)*)(?![\w(])")
# Problems of one message are joined with "; "; a part that does not start with a field path continues the part
# before it ("texts hold 70 sentences; ...; send fewer texts per request").
_PROBLEM_SEPARATOR = "; "


def field_violations(message: str) -> list[tuple[str, str]]:
    """(field path, description) per problem `message` names; the path is "" for a problem of the request as a whole."""
    violations: list[tuple[str, str]] = []
    for part in message.split(_PROBLEM_SEPARATOR):
        found = _LEADING_FIELD_PATH.match(part)
        if found is None and violations:
            field, description = violations.pop()
            violations.append((field, description + _PROBLEM_SEPARATOR + part))
        else:
            violations.append((found.group(1) if found else "", part))
    return violations


def details_for(code: str, message: str) -> list[Message]:
    """The google.rpc detail messages of a status: `code` is a gRPC status code's name."""
    if code == grpc.StatusCode.INVALID_ARGUMENT.name:
        violations = [error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                      for field, description in field_violations(message)]  # fmt: skip
        return [error_details_pb2.BadRequest(field_violations=violations)]
    if code in RETRY_DELAY_S:
        return [error_details_pb2.RetryInfo(retry_delay=Duration(seconds=RETRY_DELAY_S[code]))]
    return []


def packed(details: list[Message]) -> list[any_pb2.Any]:
    anys = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        anys.append(holder)
    return anys


def details_json(code: str, message: str) -> list[dict[str, Any]]:
    """The details as the HTTP error body writes them: proto3 JSON of each Any ({"@type": ..., "fieldViolations": ...})."""
    return [json_format.MessageToDict(holder) for holder in packed(details_for(code, message))]


async def abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and `message`, the details in the status trailer beside what the call's trailing
    metadata holds already (its request id). The HTTP API's context takes the same call and writes its own body."""
    status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=packed(details_for(code.name, message))))
    trailing = tuple(context.trailing_metadata() or ()) + tuple(status.trailing_metadata)
    await context.abort(code, message, trailing_metadata=trailing)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
