"""Every call ends within the server's maximum deadline, whatever the client sends: raw HTTP/2 against a real server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.arrivals import ARRIVED
from nmt_serve.server.api.service import SERVICE_NAME
from tests.raw_http2 import DATA, END_HEADERS, END_STREAM, HEADERS, call, frame, grpc_message, request_headers
from tests.serving import RunningServer, server_settings

MAX_DEADLINE_S = 2.0
WAIT_S = 4 * MAX_DEADLINE_S  # generous: the test is that the call ends at all, not how fast
TRANSLATE = f"/{SERVICE_NAME}/Translate"
STREAM = f"/{SERVICE_NAME}/TranslateStream"
CHECK = f"/{health.SERVICE_NAME}/Check"


@pytest.fixture(scope="module")
def bounded(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir, default_deadline_s=1.0, max_deadline_s=MAX_DEADLINE_S)) as server:
        yield server


@pytest.mark.parametrize("path", [TRANSLATE, STREAM, CHECK])
def test_request_deadline_a_message_cut_short_is_invalid_argument(bounded: RunningServer, path: str) -> None:
    """The frame declares 100 bytes, carries 10 and ends the stream; the client set no deadline."""
    ending = call(bounded.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(path)),
                  frame(DATA, END_STREAM, 1, grpc_message(b"x" * 10, declared=100)), wait_s=WAIT_S)  # fmt: skip
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.INVALID_ARGUMENT.value[0], ending


@pytest.mark.parametrize("path", [TRANSLATE, STREAM, CHECK])
def test_request_deadline_a_request_that_never_comes_ends_at_the_maximum(bounded: RunningServer, path: str) -> None:
    """Headers, then nothing: no message, no end of stream, no grpc-timeout."""
    ending = call(bounded.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(path)), wait_s=WAIT_S)
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ending


def test_request_deadline_caps_a_longer_client_deadline(tiny_model_dir: Path) -> None:
    # Four rows per step: sixteen beam-4 texts of 90 tokens take over a thousand steps, far past 50 ms.
    settings = server_settings(tiny_model_dir, default_deadline_s=0.05, max_deadline_s=0.05, max_rows=4)
    request = pb.TranslateRequest(texts=["Ich sehe den Hund."] * 16, options=pb.DecodingOptions(beam_size=4, min_output_tokens=90, max_output_tokens=90))
    with RunningServer(settings) as server:
        channel, stub = server.stub()
        with channel, pytest.raises(grpc.RpcError) as caught:
            stub.Translate(request, timeout=600)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


def test_request_deadline_leaves_ordinary_calls_alone(bounded: RunningServer) -> None:
    channel, stub = bounded.stub()
    with channel:
        assert stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=30).translations[0].hypotheses
        messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text="Hund"), timeout=30))
        assert messages[-1].final
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).limits.max_texts == bounded.server.settings.max_texts


def test_unknown_compression_is_answered_by_grpc_core_before_nmt_serve_can(bounded: RunningServer) -> None:
    """grpc core refuses a grpc-encoding it does not know while parsing the headers ("Error parsing 'grpc-encoding'
    metadata"): INTERNAL, not the UNIMPLEMENTED of the gRPC compression spec. The interceptors still see the call,
    without the header, and core cancels the handler at once: nmt-serve cannot change the code (it counts the call
    CANCELLED when the cancel reaches its request read, which races with core). This pins the code for the API docs."""
    body = pb.TranslateRequest(texts=["Hallo"]).SerializeToString()
    ending = call(bounded.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(TRANSLATE, ("grpc-encoding", "snappy"))),
                  frame(DATA, END_STREAM, 1, grpc_message(body, compressed=True)), wait_s=WAIT_S)  # fmt: skip
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.INTERNAL.value[0], ending
    assert b"grpc-encoding" in ending.trailers
    channel, stub = bounded.stub()
    with channel:
        assert stub.Translate(pb.TranslateRequest(texts=["Hallo"]), timeout=30).translations


def test_request_deadline_a_unary_call_with_two_messages_is_invalid_argument(bounded: RunningServer) -> None:
    one = grpc_message(pb.TranslateRequest(texts=["Hallo"]).SerializeToString())
    ending = call(bounded.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(TRANSLATE)), frame(DATA, END_STREAM, 1, one + one),
                  wait_s=WAIT_S)  # fmt: skip
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.INVALID_ARGUMENT.value[0], ending
    assert b"a unary call carries one request message; a second one arrived" in ending.trailers


def test_request_deadline_a_call_arriving_after_its_deadline_is_told_so(bounded: RunningServer) -> None:
    """grpc-timeout of 1 ns: the deadline has passed by the time the handler reads."""
    ending = call(bounded.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(TRANSLATE, ("grpc-timeout", "1n"))), wait_s=WAIT_S)
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ending
    assert b"within 0 s" not in ending.trailers


def test_service_deadline_is_counted_from_the_call_arrival(bounded: RunningServer) -> None:
    """A call whose message took most of --max-deadline-s to arrive has only the rest of it left to decode."""
    settings = bounded.server.settings
    arrived = time.monotonic() - 0.75 * settings.max_deadline_s
    token = ARRIVED.set(arrived)
    try:
        for remaining in (None, 10 * settings.max_deadline_s):
            deadline = bounded.server.service._deadline(FixedRemaining(remaining))  # type: ignore[arg-type]
            assert deadline <= arrived + settings.max_deadline_s, remaining
    finally:
        ARRIVED.reset(token)


class FixedRemaining:
    """The one thing the servicer's deadline asks of a context."""

    def __init__(self, remaining_s: float | None) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


def test_request_deadline_a_call_without_its_token_is_refused_without_its_message(tiny_model_dir: Path) -> None:
    """Headers without a token and no message: refused at once, not after waiting for a message it will never use."""
    settings = server_settings(tiny_model_dir, default_deadline_s=1.0, max_deadline_s=MAX_DEADLINE_S, auth_token="s3cret")
    with RunningServer(settings) as server:
        for path in (TRANSLATE, STREAM):
            ending = call(server.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(path)), wait_s=WAIT_S)
            assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.UNAUTHENTICATED.value[0], ending
