"""Hostile HTTP requests against a real server: media types, content encodings, Expect, auth headers, JSON shapes, Host
and CORS; each gets a 4xx with the JSON error body and is counted once with the code the client got."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from nmt_serve.server.api.fault_logs import LOGGERS, OneLineFaults, quiet_transport_faults
from nmt_serve.server.api.http_status import PAYLOAD_TOO_LARGE, UNSUPPORTED_MEDIA_TYPE
from tests.serving import RunningServer, scrape, scrape_until, total
from tests.test_http import GERMAN, call, http_settings

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
BODY = json.dumps({"texts": GERMAN[:1], "options": {"max_output_tokens": 4}}).encode()


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(http_settings(tiny_model_dir)) as server:
        yield server


def raw(server: RunningServer, head: str, body: bytes = b"", wait_for_continue: bool = False) -> tuple[str, bytes, bytes]:
    """(status line of the final answer, every byte received, the final answer's body) of one request; the server closes
    the connection after it (Connection: close, or an answer that leaves the body unread)."""
    with socket.create_connection(("127.0.0.1", server.server.http.port), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        received = b""
        while wait_for_continue and b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        try:
            sock.sendall(body)
        except OSError:
            pass  # closed after an answer that did not want the body
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    final = received.removeprefix(CONTINUE)
    answer_head, _, answer_body = final.partition(b"\r\n\r\n")
    return answer_head.split(b"\r\n")[0].decode(), received, answer_body


def post(path: str, body: bytes, *headers: str) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}", "Connection: close", *headers]
    return "\n".join(lines) + "\n"


def counted(server: RunningServer, code: str, before: float) -> float:
    samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_requests_total", code=code, transport="http") > before)
    return total(samples, "nmt_requests_total", code=code, transport="http") - before


def count_of(server: RunningServer, code: str) -> float:
    return total(scrape(server.server.metrics_port), "nmt_requests_total", code=code, transport="http")


# ---------------------------------------------------------------- media type and encodings


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_http_body_must_be_json_or_415(running: RunningServer, content_type: str | None) -> None:
    """A page's form or text post needs no CORS preflight: the API takes JSON only."""
    before = count_of(running, "INVALID_ARGUMENT")
    headers = [f"Content-Type: {content_type}"] if content_type else []
    status, _, body = raw(running, post("/v1/translate", BODY, *headers), BODY)
    error = json.loads(body)["error"]
    assert status.startswith("HTTP/1.1 415") and error["code"] == UNSUPPORTED_MEDIA_TYPE and "Content-Type must be application/json" in error["message"]
    assert counted(running, "INVALID_ARGUMENT", before) == 1


@pytest.mark.parametrize(("encoding", "encode"), [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", lambda data: zlib.compress(data)[2:-4])])
def test_http_compressed_bodies_are_decoded(running: RunningServer, encoding: str, encode) -> None:  # type: ignore[no-untyped-def]
    body = encode(BODY)
    status, _, answer = raw(running, post("/v1/translate", body, "Content-Type: application/json", f"Content-Encoding: {encoding}"), body)
    assert status.startswith("HTTP/1.1 200") and len(json.loads(answer)["translations"]) == 1


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_http_body_that_does_not_decode_is_400_and_counted(running: RunningServer, encoding: str) -> None:
    before = count_of(running, "INVALID_ARGUMENT")
    body = b"\x1f\x8b\x08\x00 this is not gzip data" if encoding == "gzip" else b"\x78\x9c not deflate"
    status, _, answer = raw(running, post("/v1/translate", body, "Content-Type: application/json", f"Content-Encoding: {encoding}"), body)
    error = json.loads(answer)["error"]
    assert status.startswith("HTTP/1.1 400") and error["code"] == "INVALID_ARGUMENT" and f"not valid {encoding} data" in error["message"]
    assert counted(running, "INVALID_ARGUMENT", before) == 1


@pytest.mark.parametrize("encoding", ["snappy", "br", "zstd", "gzip, snappy"])
def test_http_unsupported_encoding_is_415_with_the_json_body(running: RunningServer, encoding: str) -> None:
    status, _, answer = raw(running, post("/v1/translate", BODY, "Content-Type: application/json", f"Content-Encoding: {encoding}"), BODY)
    error = json.loads(answer)["error"]
    assert status.startswith("HTTP/1.1 415") and error["code"] == UNSUPPORTED_MEDIA_TYPE
    assert f"Content-Encoding '{encoding.split(', ')[-1]}' is not supported" in error["message"]


def test_http_gzip_bomb_stops_at_the_message_limit(running: RunningServer) -> None:
    bomb = gzip.compress(b" " * (4 * running.server.settings.max_message_bytes))  # a few kB that decode to 1 MiB
    status, _, answer = raw(running, post("/v1/translate", bomb, "Content-Type: application/json", "Content-Encoding: gzip"), bomb)
    assert status.startswith("HTTP/1.1 413") and json.loads(answer)["error"]["code"] == PAYLOAD_TOO_LARGE


# ---------------------------------------------------------------- Expect and the body read


def test_http_expect_continue_on_an_oversized_body_gets_413_alone(running: RunningServer) -> None:
    head = post("/v1/translate", b"", "Content-Type: application/json", "Expect: 100-continue").replace("Content-Length: 0", "Content-Length: 100000000")
    status, received, _ = raw(running, head)
    assert status.startswith("HTTP/1.1 413") and b"100 Continue" not in received


def test_http_expect_continue_is_answered_once_the_checks_pass(running: RunningServer) -> None:
    status, received, answer = raw(running, post("/v1/translate", BODY, "Content-Type: application/json", "Expect: 100-continue"), BODY,
                                   wait_for_continue=True)  # fmt: skip
    assert received.startswith(CONTINUE) and status.startswith("HTTP/1.1 200") and json.loads(answer)["translations"]


def test_http_client_leaving_while_its_body_is_read_is_counted_cancelled(running: RunningServer) -> None:
    before = count_of(running, "CANCELLED")
    with socket.create_connection(("127.0.0.1", running.server.http.port), timeout=10) as sock:
        sock.sendall(post("/v1/translate", b"x" * 100, "Content-Type: application/json").replace("\n", "\r\n").encode() + b"\r\n{\"texts\"")
    assert counted(running, "CANCELLED", before) == 1


# ---------------------------------------------------------------- JSON shapes


@pytest.mark.parametrize(("body", "named"), [
    (b'"Hallo"', "the body must be a JSON object, got a string"),
    (b"null", "the body must be a JSON object, got null"),
    (b"[]", "the body must be a JSON object, got an array"),
    (b'{"texts": ["Hund"], "options": []}', "options must be a JSON object, got an array"),
    (b'{"texts": "Hund"}', "texts must be a JSON array, got a string"),
    (b'{"texts": ["Hund"], "options": 7}', "options must be a JSON object, got a number"),
    (b"[" * 100000 + b"]" * 100000, "the body is not JSON"),
])  # fmt: skip
def test_http_body_of_the_wrong_shape_is_400_naming_the_field(running: RunningServer, body: bytes, named: str) -> None:
    status, _, data = call(running, "POST", "/v1/translate", body)
    error = json.loads(data)["error"]
    assert (status, error["code"]) == (400, "INVALID_ARGUMENT") and error["message"].startswith(f"request is not a valid TranslateRequest: {named}")
    assert "TypeError" not in error["message"] and 'named "H"' not in error["message"]


# ---------------------------------------------------------------- Authorization


def test_http_authorization_non_ascii_or_twice_is_401(tiny_model_dir: Path) -> None:
    with RunningServer(http_settings(tiny_model_dir, auth_token="s3cret")) as server:
        status, _, answer = raw(server, post("/v1/translate", BODY, "Content-Type: application/json") + "Authorization: Bearer s3cr\xe9t\n", BODY)
        assert status.startswith("HTTP/1.1 401") and json.loads(answer)["error"]["code"] == "UNAUTHENTICATED"
        for first, second in (("Bearer s3cret", "Bearer wrong"), ("Bearer wrong", "Bearer s3cret")):
            headers = ["Content-Type: application/json", f"Authorization: {first}", f"Authorization: {second}"]
            assert raw(server, post("/v1/translate", BODY, *headers), BODY)[0].startswith("HTTP/1.1 401")
        assert raw(server, post("/v1/translate", BODY, "Content-Type: application/json", "Authorization: Bearer s3cret"), BODY)[0].startswith("HTTP/1.1 200")


# ---------------------------------------------------------------- Host and CORS


@pytest.mark.parametrize(("host", "status"), [("localhost:8000", 200), ("127.0.0.1", 200), ("[::1]:8000", 200), ("evil.example", 403),
                                              ("rebind.attacker.example:8000", 403)])  # fmt: skip
def test_http_host_is_an_address_localhost_or_allowed(running: RunningServer, host: str, status: int) -> None:
    answer = call(running, "POST", "/v1/translate", BODY, {"Host": host})
    assert answer[0] == status
    if status == 403:
        assert json.loads(answer[2])["error"]["code"] == "PERMISSION_DENIED" and "--http-allowed-hosts" in json.loads(answer[2])["error"]["message"]
    assert call(running, "GET", "/healthz", headers={"Host": host})[0] == 200  # probes answer whatever the name


def test_http_cors_is_off_by_default(running: RunningServer) -> None:
    status, headers, _ = call(running, "OPTIONS", "/v1/translate", headers={"Origin": "https://page.example", "Access-Control-Request-Method": "POST"})
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    assert "Access-Control-Allow-Origin" not in call(running, "POST", "/v1/translate", BODY, {"Origin": "https://page.example"})[1]


def test_http_allowed_hosts_and_cors_origin_flags(tiny_model_dir: Path) -> None:
    settings = http_settings(tiny_model_dir, http_allowed_hosts="translate.example,.corp.example", http_cors_origin="https://page.example")
    with RunningServer(settings) as server:
        for host, status in (("translate.example", 200), ("a.corp.example:8000", 200), ("evil.example", 403)):
            assert call(server, "POST", "/v1/translate", BODY, {"Host": host})[0] == status, host
        origin = {"Origin": "https://page.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        status, headers, _ = call(server, "OPTIONS", "/v1/translate", headers=origin)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://page.example" and "Content-Type" in headers["Access-Control-Allow-Headers"]
        status, headers, _ = call(server, "POST", "/v1/translate", BODY, {"Origin": "https://page.example"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://page.example"
        assert call(server, "OPTIONS", "/v1/translate", headers={**origin, "Origin": "https://other.example"})[0] == 403
        assert "Access-Control-Allow-Origin" not in call(server, "POST", "/v1/translate", BODY, {"Origin": "https://other.example"})[1]


# ---------------------------------------------------------------- logging


@pytest.fixture()
def fresh_fault_filters() -> None:
    """The filters' rate limit starts anew: an earlier test's faults do not hold back this one's first line."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for existing in [item for item in logger.filters if isinstance(item, OneLineFaults)]:
            logger.removeFilter(existing)
    quiet_transport_faults()


def test_http_malformed_requests_log_one_warning_line_without_a_traceback(running: RunningServer, caplog: pytest.LogCaptureFixture,
                                                                          fresh_fault_filters: None) -> None:  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", running.server.http.port), timeout=10) as sock:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.0 400")
    records = [record for record in caplog.records if record.name == "aiohttp.server"]
    assert [(record.levelname, record.exc_info) for record in records] == [("WARNING", None)]
    assert "Error handling request" in records[0].getMessage() and "BadHttpMessage" in records[0].getMessage()


def test_grpc_stream_cut_off_logs_one_warning_line(caplog: pytest.LogCaptureFixture, fresh_fault_filters: None) -> None:
    """What grpcio logs for each stream the drain cuts off at the end of the grace period, and a servicer's real error."""
    logger = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(5):
            try:
                raise asyncio.CancelledError()
            except asyncio.CancelledError:
                logger.exception("Exception not handled by _handle_exceptions in servicer method [%s]", "/x/TranslateStream")
        try:
            raise KeyError("a bug")
        except KeyError:
            logger.exception("Unexpected error in servicer method")
    levels = [(record.levelname, record.exc_info is not None) for record in caplog.records]
    assert levels == [("WARNING", False), ("ERROR", True)]
    assert caplog.records[0].getMessage() == "Exception not handled by _handle_exceptions in servicer method [/x/TranslateStream]: CancelledError"
