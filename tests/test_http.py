"""The HTTP/JSON API against a real server on loopback: every endpoint, the status table row by row, SSE, metrics, OpenAPI."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from nmt_serve.bench.balancer import free_port
from nmt_serve.client.http_caller import TRANSPORT_CODES, HttpCallError
from nmt_serve.client.loadtest import SAMPLE_TEXTS
from nmt_serve.client.loadtest import main as loadtest_main
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api import http_server
from nmt_serve.server.api.http_api import TIMEOUT_HEADER, to_json
from nmt_serve.server.api.http_schema import openapi_document
from nmt_serve.server.api.http_status import COUNTED_AS, HTTP_STATUS, OTHER_STATUS, PAYLOAD_TOO_LARGE, REQUEST_TIMEOUT, http_status
from nmt_serve.server.settings import parse_settings
from tests.serving import NO_OPENSSL, RunningServer, held_engines, scrape_until, self_signed_certificate, server_settings, total, wait_for

GERMAN = ["Ich sehe den Hund.", "Wir mag Kaffee heute."]
LONG = {"min_output_tokens": 90, "max_output_tokens": 90}  # keeps a request in the batch for 90 steps


def http_settings(model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return server_settings(model_dir, http_port=free_port(), **overrides)


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(http_settings(tiny_model_dir)) as server:
        yield server


def call(server: RunningServer, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
         ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=30)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    result = response.status, dict(response.getheaders()), response.read()
    connection.close()
    return result


def error_of(server: RunningServer, path: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict, dict[str, str]]:
    status, response_headers, data = call(server, "POST", path, body, headers)
    return status, json.loads(data)["error"], response_headers


def events(data: bytes) -> list[tuple[str, dict]]:
    """(event name, JSON data) of each server-sent event."""
    found = []
    for block in data.decode().split("\n\n"):
        if block.strip():
            lines = dict(line.split(": ", 1) for line in block.splitlines())
            found.append((lines.get("event", ""), json.loads(lines["data"])))
    return found


# ---------------------------------------------------------------- endpoints


@pytest.mark.parametrize(("beam", "nbest"), [(1, 1), (3, 2)])
def test_http_translate_equals_grpc(running: RunningServer, beam: int, nbest: int) -> None:
    channel, stub = running.stub()
    with channel:
        expected = stub.Translate(pb.TranslateRequest(texts=GERMAN, options=pb.DecodingOptions(beam_size=beam, num_hypotheses=nbest)), timeout=30)
    status, headers, data = call(running, "POST", "/v1/translate", {"texts": GERMAN, "options": {"beam_size": beam, "num_hypotheses": nbest}})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(data) == to_json(expected)
    assert json_format.ParseDict(json.loads(data), pb.TranslateResponse()) == expected


@pytest.mark.parametrize("beam", [1, 2])
def test_http_stream_events_end_with_the_grpc_nbest(running: RunningServer, beam: int) -> None:
    channel, stub = running.stub()
    with channel:
        expected = list(stub.TranslateStream(pb.TranslateStreamRequest(text=GERMAN[0], options=pb.DecodingOptions(beam_size=beam)), timeout=30))
    status, headers, data = call(running, "POST", "/v1/translate/stream", {"text": GERMAN[0], "options": {"beam_size": beam}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    got = events(data)
    assert [name for name, _ in got] == [""] * len(got) and got[-1][1]["final"]
    assert [json_format.ParseDict(body, pb.TranslateStreamResponse()) for _, body in got] == expected
    assert "".join(body["text_delta"] for _, body in got) == got[-1][1]["hypotheses"][0]["text"]


def test_http_models_and_model_info(running: RunningServer) -> None:
    name = running.server.models.default.name
    status, _, data = call(running, "GET", "/v1/models")
    listed = json.loads(data)
    assert status == 200 and listed["default_model"] == name and [model["name"] for model in listed["models"]] == [name]
    status, _, data = call(running, "GET", f"/v1/models/{name}")
    assert status == 200 and json.loads(data) == listed["models"][0]
    assert json.loads(data)["limits"]["max_beam_size"] == 4


def test_http_probes_live_and_ready(running: RunningServer) -> None:
    assert call(running, "GET", "/healthz")[0] == 200
    assert call(running, "GET", "/readyz")[0] == 200


def test_http_page_and_its_script_are_served(running: RunningServer) -> None:
    status, headers, data = call(running, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"/v1/translate/stream" in call(running, "GET", "/static/page.js")[2]
    assert b'src="/static/page.js"' in data and b"http" not in data.replace(b"http-equiv", b"")  # no CDN


def test_http_openapi_document_is_valid_and_generated_from_the_proto(running: RunningServer) -> None:
    from openapi_spec_validator import validate

    status, _, data = call(running, "GET", "/openapi.json")
    document = json.loads(data)
    assert status == 200 and document == json.loads(json.dumps(openapi_document("v1")))
    validate(document)
    schemas = document["components"]["schemas"]
    assert set(schemas["TranslateRequest"]["properties"]) == {field.name for field in pb.TranslateRequest.DESCRIPTOR.fields}
    assert set(schemas["DecodingOptions"]["properties"]) == {field.name for field in pb.DecodingOptions.DESCRIPTOR.fields}
    assert set(document["paths"]["/v1/translate"]["post"]["responses"]) == {str(status) for status in {*HTTP_STATUS.values(), OTHER_STATUS}}
    for path, operations in document["paths"].items():
        if path.startswith("/v1/"):
            (operation,) = operations.values()
            assert TIMEOUT_HEADER in {parameter["name"] for parameter in operation["parameters"] if parameter["in"] == "header"}, path


def test_http_port_flag_defaults_to_8000_and_names_its_range() -> None:
    assert parse_settings([], environ={}).http_port == 8000
    assert parse_settings(["--http-port", "0"], environ={}).http_port == 0  # off
    with pytest.raises(ValueError, match=r"--http-port must be between 0 \(off\) and 65535, got 70000"):
        parse_settings(["--http-port", "70000"], environ={})


# ---------------------------------------------------------------- the status table, row by row


def test_http_client_counts_the_transport_codes_as_the_server_does() -> None:
    assert TRANSPORT_CODES == COUNTED_AS
    assert HttpCallError(REQUEST_TIMEOUT, "slow body").code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert HttpCallError(PAYLOAD_TOO_LARGE, "big body").code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_http_status_table_maps_each_code_once() -> None:
    assert http_status("OK") == 200 and http_status("CANCELLED") == 499 and http_status(PAYLOAD_TOO_LARGE) == 413
    assert http_status(REQUEST_TIMEOUT) == 408
    for code in ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED", "FAILED_PRECONDITION"):
        assert http_status(code) == OTHER_STATUS == 500


@pytest.mark.parametrize(("body", "named"), [
    ({"texts": GERMAN, "options": {"beam_size": 9}}, "options.beam_size must be between 1 and 4 (max_beam_size, set by nmt-serve --max-beam-size), got 9"),
    ({"texts": []}, "texts must hold between 1 and 16 texts, got 0"),
    ({"texts": ["x" * 401]}, "texts[0] has 401 characters; the limit is 400 (max_chars_per_text, set by nmt-serve --max-chars-per-text); split the text into shorter texts"),
    ({"texts": GERMAN, "beam": 2}, "request is not a valid TranslateRequest"),
    (b"{not json", "request is not a valid TranslateRequest"),
])  # fmt: skip
def test_http_invalid_argument_is_400_naming_the_field(running: RunningServer, body: object, named: str) -> None:
    status, error, _ = error_of(running, "/v1/translate", body)
    assert (status, error["code"]) == (400, "INVALID_ARGUMENT") and named in error["message"]


def test_http_bad_timeout_header_is_400(running: RunningServer) -> None:
    status, error, _ = error_of(running, "/v1/translate", {"texts": GERMAN}, {TIMEOUT_HEADER: "soon"})
    assert status == 400 and TIMEOUT_HEADER in error["message"]


def test_http_unknown_model_is_404(running: RunningServer) -> None:
    status, error, _ = error_of(running, "/v1/translate", {"texts": GERMAN, "model": "no-such-model"})
    assert (status, error["code"]) == (404, "NOT_FOUND") and "no-such-model" in error["message"]
    assert call(running, "GET", "/v1/models/no-such-model")[0] == 404


def test_http_expired_deadline_is_504(running: RunningServer) -> None:
    status, error, _ = error_of(running, "/v1/translate", {"texts": GERMAN * 8, "options": LONG}, {TIMEOUT_HEADER: "0.001"})
    assert (status, error["code"]) == (504, "DEADLINE_EXCEEDED")


def test_http_declared_oversized_body_is_413_before_it_is_read(running: RunningServer) -> None:
    """A declared 1 GB body: the answer comes after a few bytes of it, and the server closes the connection."""
    with socket.create_connection(("127.0.0.1", running.server.http.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{\"texts\"")
        answer = b""
        while chunk := sock.recv(65536):  # returns b"" once the server closed: it is not waiting for the rest
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["code"] == PAYLOAD_TOO_LARGE
    assert b"1000000000 bytes; the limit is 262144 bytes (max_message_bytes, set by nmt-serve --max-message-bytes); send fewer or shorter texts" in body


def test_http_chunked_oversized_body_is_413_once_the_limit_has_arrived(running: RunningServer) -> None:
    """No declared length: the answer comes once the limit (262144 bytes) has arrived, the rest never sent."""
    with socket.create_connection(("127.0.0.1", running.server.http.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(33):  # 33 x 8 KiB > 256 KiB
            sock.sendall(b"2000\r\n" + b"a" * 8192 + b"\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["code"] == PAYLOAD_TOO_LARGE


def test_http_unparsable_requests_are_counted_once_each(tiny_model_dir: Path) -> None:
    """aiohttp answers a request it cannot parse with its own 400 before any route: such calls are counted in
    nmt_http_unparsed_requests_total (their path is unknown), and a call that reached a route is not counted there."""
    bad_requests = [b"POST /v1/translate HTTP/1.1\r\nHost: localhost\r\nno colon in this header\r\n\r\n",
                    b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: -5\r\n\r\n"]  # fmt: skip
    with RunningServer(http_settings(tiny_model_dir)) as server:
        for raw in bad_requests:
            with socket.create_connection(("127.0.0.1", server.server.http.port), timeout=30) as sock:
                sock.sendall(raw)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")  # aiohttp's placeholder answers in HTTP/1.0
        assert call(server, "GET", "/v1/models")[0] == 200
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_http_unparsed_requests_total") >= 2)
    assert total(samples, "nmt_http_unparsed_requests_total") == 2


def test_http_stalled_body_is_408_at_the_deadline(tiny_model_dir: Path) -> None:
    """Headers declaring 100 bytes, 8 of them sent, the connection kept open: answered at the call's deadline (its
    Request-Timeout, or --max-deadline-s without one), and the connection closed; aiohttp alone would wait for ever."""
    answers = []
    with RunningServer(http_settings(tiny_model_dir, default_deadline_s=1.0, max_deadline_s=2.0)) as server:
        for timeout in ("1", None):
            with socket.create_connection(("127.0.0.1", server.server.http.port), timeout=30) as sock:
                head = ("POST /v1/translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                        + (f"{TIMEOUT_HEADER}: {timeout}\r\n" if timeout else "") + "\r\n")  # fmt: skip
                sock.sendall(head.encode() + b'{"texts"')
                answer = b""
                while chunk := sock.recv(65536):  # b"" once the server closed
                    answer += chunk
            status_line, _, body = answer.partition(b"\r\n\r\n")
            answers.append((status_line.split(b"\r\n")[0], json.loads(body)["error"]))
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_requests_total", code="DEADLINE_EXCEEDED") >= 2)
    assert [line for line, _ in answers] == [b"HTTP/1.1 408 Request Timeout"] * 2
    assert [error["code"] for _, error in answers] == [REQUEST_TIMEOUT] * 2
    assert [error["message"] for _, error in answers] == [f"the request body did not arrive within {wait} s" for wait in (1, 2)]
    assert total(samples, "nmt_requests_total", method="Translate", code="DEADLINE_EXCEEDED", transport="http") == 2


def test_http_connection_whose_headers_never_complete_is_closed(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request headers trickling in and never finished: the server closes the connection once the keep-alive timeout
    (shortened here from 75 s) has passed, as it closes idle ones."""
    monkeypatch.setattr(http_server, "KEEPALIVE_S", 1.0)
    with RunningServer(http_settings(tiny_model_dir)) as server:
        with socket.create_connection(("127.0.0.1", server.server.http.port), timeout=0.3) as sock:
            sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: localhost\r\n")
            closed = False
            for _ in range(20):  # a header line every 0.3 s for up to 6 s: a timer that restarted on each would never fire
                try:
                    closed = sock.recv(65536) == b""
                    if closed:
                        break
                    pytest.fail("the server answered a request whose headers never ended")
                except TimeoutError:
                    try:
                        sock.sendall(b"X-Slow: 1\r\n")
                    except OSError:  # reset: closed between two lines
                        closed = True
                        break
            assert closed  # closed with no answer while the header lines kept coming


def test_http_bearer_token_is_401_without_it(tiny_model_dir: Path) -> None:
    with RunningServer(http_settings(tiny_model_dir, auth_token="s3cret")) as server:
        for path, body in (("/v1/translate", {"texts": GERMAN}), ("/v1/translate/stream", {"text": GERMAN[0]})):
            status, error, _ = error_of(server, path, body, {"Authorization": "Bearer wrong"})
            assert (status, error["code"]) == (401, "UNAUTHENTICATED")
        assert call(server, "GET", "/v1/models")[0] == 401
        assert call(server, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert call(server, "POST", "/v1/translate", {"texts": GERMAN}, {"Authorization": "Bearer s3cret"})[0] == 200
        assert call(server, "GET", "/readyz")[0] == 200  # probes stay open, as gRPC health does
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_requests_total", code="UNAUTHENTICATED") >= 3)
        assert total(samples, "nmt_requests_total", code="UNAUTHENTICATED", transport="http") == 3


def test_http_full_queue_is_429_with_retry_after(tiny_model_dir: Path) -> None:
    """Eight calls against a queue of two, the engines held: the two admitted stay in it, the six others are refused."""
    with RunningServer(http_settings(tiny_model_dir, max_queued_requests=2)) as server, held_engines(server) as gate:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(call, server, "POST", "/v1/translate", {"texts": GERMAN[:1], "options": LONG}) for _ in range(8)]
            assert wait_for(lambda: sum(future.done() for future in pending) == 6, 30), [future.done() for future in pending]
            gate.open()
            answers = [future.result() for future in pending]
    refused = [(json.loads(data)["error"], headers) for status, headers, data in answers if status == 429]
    assert refused, answers
    assert all(error["code"] == "RESOURCE_EXHAUSTED" and headers["Retry-After"] == "1" for error, headers in refused)
    assert sorted(status for status, _, _ in answers) == [200] * 2 + [429] * 6


@pytest.mark.parametrize(("path", "method"), [("/v1/translate", "Translate"), ("/v1/translate/stream", "TranslateStream")])
def test_http_full_queue_is_refused_before_the_body_is_read(tiny_model_dir: Path, path: str, method: str) -> None:
    """Headers declaring a body, none of it sent: with no place left the answer is 429 at once; a server that read
    the body first would still be waiting for it."""
    with RunningServer(http_settings(tiny_model_dir, max_queued_requests=1)) as server, held_engines(server) as gate:
        channel, stub = server.stub()
        with channel:
            holder = stub.Translate.future(pb.TranslateRequest(texts=GERMAN[:1]), timeout=60)
            assert wait_for(lambda: server.server.scheduler.refusal() is not None, 10)
            connection = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=10)
            connection.putrequest("POST", path)
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", "100")
            connection.endheaders()
            response = connection.getresponse()
            status, error = response.status, json.loads(response.read())["error"]
            connection.close()
            gate.open()
            assert holder.result().translations  # the admitted call is served once the engines go on
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_rejected_total", reason="queue_full") >= 1)
    assert (status, error["code"]) == (429, "RESOURCE_EXHAUSTED") and "queue full" in error["message"]
    assert total(samples, "nmt_rejected_total", reason="queue_full") == 1
    assert total(samples, "nmt_requests_total", method=method, code="RESOURCE_EXHAUSTED", transport="http") == 1


def test_http_refusals_before_the_servicer_are_counted(tiny_model_dir: Path) -> None:
    """A body over the limit and a bad timeout header never reach the servicer; each is still one call in nmt_requests_total
    (the oversized body under RESOURCE_EXHAUSTED, what grpcio answers it over gRPC)."""
    with RunningServer(http_settings(tiny_model_dir)) as server:
        with socket.create_connection(("127.0.0.1", server.server.http.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 413")
        assert error_of(server, "/v1/translate/stream", {"text": GERMAN[0]}, {TIMEOUT_HEADER: "soon"})[0] == 400
        samples = scrape_until(server.server.metrics_port,
                               lambda found: total(found, "nmt_requests_total", transport="http") >= 2)  # fmt: skip
    assert total(samples, "nmt_requests_total", method="Translate", code="RESOURCE_EXHAUSTED", transport="http") == 1
    assert total(samples, "nmt_requests_total", method="TranslateStream", code="INVALID_ARGUMENT", transport="http") == 1
    assert total(samples, "nmt_requests_total", transport="http") == 2


@pytest.mark.skipif(NO_OPENSSL, reason="openssl binary not installed (apt-get install openssl)")
def test_http_port_speaks_tls_only_when_the_grpc_port_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    key, cert = self_signed_certificate(tmp_path)
    with RunningServer(http_settings(tiny_model_dir, tls_cert=str(cert), tls_key=str(key))) as server:
        port = server.server.http.port
        secure = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ssl.create_default_context(cafile=str(cert)))
        secure.request("POST", "/v1/translate", body=json.dumps({"texts": GERMAN}), headers={"Content-Type": "application/json"})
        answer = secure.getresponse()
        assert answer.status == 200 and len(json.loads(answer.read())["translations"]) == 2
        secure.close()
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # the TLS handshake fails: no HTTP answer comes back
            plain.request("GET", "/v1/models")
            plain.getresponse()
        plain.close()


def test_http_warming_up_is_503_and_not_ready(tiny_model_dir: Path) -> None:
    with RunningServer(http_settings(tiny_model_dir), hold_warm_up=True) as server:
        assert wait_for(lambda: server.server.http is not None and server.server.http.port, 30)
        assert call(server, "GET", "/healthz")[0] == 200 and call(server, "GET", "/readyz")[0] == 503
        status, error, headers = error_of(server, "/v1/translate", {"texts": GERMAN})
        assert (status, error["code"], headers["Retry-After"]) == (503, "UNAVAILABLE", "1")
        assert call(server, "GET", "/v1/models")[0] == 200  # answers during warm-up, as ListModels does
        server.release_warm_up()


def test_http_draining_is_503(tiny_model_dir: Path) -> None:
    with RunningServer(http_settings(tiny_model_dir, grace_s=10.0)) as server:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, held_engines(server) as gate:
            held = pool.submit(call, server, "POST", "/v1/translate", {"texts": GERMAN[:1], "options": LONG})
            assert wait_for(lambda: server.server.scheduler.in_flight == 1, 30)  # held in the queue until the gate opens
            server.server.request_stop()  # the drain waits for the call in flight, refusing new ones meanwhile
            assert wait_for(lambda: server.server.scheduler.draining, 30)
            status, error, _ = error_of(server, "/v1/translate", {"texts": GERMAN[:1]})
            assert (status, error["code"]) == (503, "UNAVAILABLE") and call(server, "GET", "/readyz")[0] == 503
            gate.open()
            assert held.result()[0] == 200  # the call in flight finished within the drain
        port = server.server.http.port
        assert wait_for(lambda: not server.is_running(), 30)
        with pytest.raises(ConnectionRefusedError):  # the drain closed the HTTP port with the gRPC one
            socket.create_connection(("127.0.0.1", port), timeout=5)


# ---------------------------------------------------------------- cancellation and metrics


def test_http_cancelled_stream_frees_its_engine_rows(running: RunningServer) -> None:
    """Mirrors test_service_cancelled_stream_leaves_the_batch: the client closes the connection after the first event."""
    scheduler = running.server.scheduler
    with held_engines(running) as gate, socket.create_connection(("127.0.0.1", running.server.http.port), timeout=10) as sock:
        body = json.dumps({"text": GERMAN[0], "options": LONG}).encode()
        sock.sendall(b"POST /v1/translate/stream HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))  # fmt: skip
        received = b""
        sock.settimeout(0.5)
        for _ in range(60):  # one engine step at a time until decoding has produced a first event
            gate.allow(1)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, received
            received += chunk
            if b"data: " in received:
                break
        assert b"data: " in received, received
        assert scheduler.running == 1  # a few of its 90 steps done, no step let through since: still in the batch
    deadline = time.monotonic() + 5
    while (scheduler.running or scheduler.queue_depth) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0 and scheduler.queue_depth == 0
    samples = scrape_until(running.server.metrics_port, lambda found: total(found, "nmt_requests_total", code="CANCELLED", transport="http") > 0)
    assert total(samples, "nmt_requests_total", method="TranslateStream", code="CANCELLED", transport="http") == 1


def test_http_metrics_carry_the_transport_label(running: RunningServer) -> None:
    def counts(found: dict) -> tuple[float, float]:
        return (total(found, "nmt_requests_total", method="ListModels", code="OK", transport="http"),
                total(found, "nmt_requests_total", method="ListModels", code="OK", transport="grpc"))  # fmt: skip

    before = counts(scrape_until(running.server.metrics_port, lambda _: True))
    call(running, "GET", "/v1/models")
    channel, stub = running.stub()
    with channel:
        stub.ListModels(pb.ListModelsRequest(), timeout=10)
    samples = scrape_until(running.server.metrics_port, lambda found: counts(found) == (before[0] + 1, before[1] + 1))
    assert counts(samples) == (before[0] + 1, before[1] + 1)
    assert total(samples, "nmt_request_duration_seconds_count", method="ListModels", transport="http") >= 1
    assert grpc.StatusCode.OK.name in HTTP_STATUS


@pytest.mark.parametrize("stream", [False, True])
def test_http_loadtest_reports_over_http(running: RunningServer, tmp_path: Path, stream: bool) -> None:
    out = tmp_path / "report.json"
    code = loadtest_main(["--http", "--target", f"127.0.0.1:{running.server.http.port}", "--concurrency", "3", "--requests", "12",
                          "--texts", str(SAMPLE_TEXTS), "--wait-ready", "10", "--json", str(out), *(["--stream"] if stream else [])])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0 and report["codes"] == {"OK": 12} and "HTTP/JSON" in report["mode"]
    assert (report["first_token_s"] != {}) is stream
