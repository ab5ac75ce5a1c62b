"""google.rpc error details: BadRequest field violations and RetryInfo in the gRPC status trailer (read with
grpcio-status) and the same details in the HTTP error body, on a real server on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.error_details import details_json, field_violations
from tests.serving import RunningServer, held_engines, server_settings, wait_for
from tests.test_http import call, http_settings

BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


@pytest.mark.parametrize(("message", "expected"), [
    ("texts must hold at most 4 texts (max_texts, set by nmt-serve --max-texts), got 5; send fewer texts per request",
     [("texts", "texts must hold at most 4 texts (max_texts, set by nmt-serve --max-texts), got 5; send fewer texts per request")]),
    ("texts[3] has 900 characters; the limit is 800", [("texts[3]", "texts[3] has 900 characters; the limit is 800")]),
    ("invalid options: options.beam_size must be at most 8; options.nbest must not exceed options.beam_size",
     [("options.beam_size", "invalid options: options.beam_size must be at most 8"),
      ("options.nbest", "options.nbest must not exceed options.beam_size")]),
    ("text has 70 sentences; the limit is 64", [("text", "text has 70 sentences; the limit is 64")]),
    ("the request message is not a TranslateRequest", [("", "the request message is not a TranslateRequest")]),
])  # fmt: skip
def test_each_problem_of_a_message_is_a_violation_of_the_field_it_starts_with(message: str, expected: list[tuple[str, str]]) -> None:
    assert field_violations(message) == expected


def test_only_invalid_argument_and_retryable_codes_carry_details() -> None:
    assert [detail["@type"] for detail in details_json("INVALID_ARGUMENT", "texts must hold 1 text")] == [BAD_REQUEST]
    assert details_json("RESOURCE_EXHAUSTED", "queue full") == [{"@type": RETRY_INFO, "retryDelay": "1s"}]
    assert details_json("UNAVAILABLE", "draining") == [{"@type": RETRY_INFO, "retryDelay": "1s"}]
    assert details_json("NOT_FOUND", "model x is not served") == []
    assert details_json("PAYLOAD_TOO_LARGE", "body over 1 MB") == []  # retrying the same body cannot help


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(http_settings(tiny_model_dir, max_texts=4)) as server:
        yield server


def grpc_error(server: RunningServer, request: pb.TranslateRequest) -> grpc.RpcError:
    channel, stub = server.stub()
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.Translate(request, timeout=30)
    return caught.value


def unpacked(error: grpc.RpcError, kind: type) -> object:
    status = rpc_status.from_call(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    assert (status.code, status.message) == (error.code().value[0], error.details())
    (detail,) = status.details
    found = kind()
    assert detail.Unpack(found), detail.type_url
    return found


def test_grpc_invalid_argument_names_the_field_in_a_bad_request(running: RunningServer) -> None:
    error = grpc_error(running, pb.TranslateRequest(texts=["Hallo"] * 5))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    bad_request = unpacked(error, error_details_pb2.BadRequest)
    assert [(violation.field, violation.description) for violation in bad_request.field_violations] == [("texts", error.details())]
    # The details trailer comes beside the request id, not instead of it.
    assert any(key == "x-request-id" for key, _ in error.trailing_metadata())


def test_grpc_bad_options_name_the_option(running: RunningServer) -> None:
    error = grpc_error(running, pb.TranslateRequest(texts=["Hallo"], options=pb.DecodingOptions(beam_size=1000)))
    bad_request = unpacked(error, error_details_pb2.BadRequest)
    assert [violation.field for violation in bad_request.field_violations] == ["options.beam_size"]


def test_http_error_body_carries_the_same_details(running: RunningServer) -> None:
    error = grpc_error(running, pb.TranslateRequest(texts=["Hallo"] * 5))
    status, _, data = call(running, "POST", "/v1/translate", {"texts": ["Hallo"] * 5})
    body = json.loads(data)["error"]
    assert status == 400 and body["message"] == error.details()
    grpc_details = [json_format.MessageToDict(detail) for detail in rpc_status.from_call(error).details]
    assert body["details"] == grpc_details == [{"@type": BAD_REQUEST, "fieldViolations": [{"field": "texts", "description": error.details()}]}]


def test_a_full_queue_tells_both_transports_when_to_retry(tiny_model_dir: Path) -> None:
    with RunningServer(http_settings(tiny_model_dir, max_queued_requests=1)) as server, held_engines(server):
        channel, stub = server.stub()
        with channel:
            holder = stub.Translate.future(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=60)
            assert wait_for(lambda: server.server.scheduler.refusal() is not None, 10)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=10)
            status, headers, data = call(server, "POST", "/v1/translate", {"texts": ["Hund"]})
            holder.cancel()
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = unpacked(caught.value, error_details_pb2.RetryInfo)
    assert retry.retry_delay.seconds == 1
    assert status == 429 and headers["Retry-After"] == "1"
    assert json.loads(data)["error"]["details"] == [{"@type": RETRY_INFO, "retryDelay": "1s"}]
