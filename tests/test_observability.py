"""Request ids (gRPC metadata and HTTP header, echoed and logged), the JSON log format, nmt_build_info and no _created
series, against real servers on loopback."""

from __future__ import annotations

import http.client
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import grpc
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from nmt_serve.bench.balancer import free_port
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from nmt_serve.server.api.request_ids import HEADER
from nmt_serve.server.models.metrics import BUILD_COMMIT_VARIABLE, Metrics
from tests.serving import RunningServer, server_settings, wait_for

ROOT = Path(__file__).resolve().parent.parent
GENERATED = re.compile(r"[0-9a-f]{32}")
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir, http_port=free_port(), auth_token=TOKEN)) as server:
        yield server


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [record.request for record in caplog.records if record.name == "nmt_serve.access"]  # type: ignore[attr-defined]


def echoed(metadata: tuple) -> list[str]:
    return [value for key, value in metadata if key == HEADER]


@pytest.mark.parametrize(("offered", "kept"), [("trace-4bf92f3577b34da6", True), ("two words", False), ("x" * 129, False), (None, False)])
def test_request_id_grpc_echoed_and_logged(running: RunningServer, caplog: pytest.LogCaptureFixture, offered: str | None, kept: bool) -> None:
    metadata = [("authorization", f"Bearer {TOKEN}")] + ([(HEADER, offered)] if offered is not None else [])
    channel, stub = running.stub()
    with channel, caplog.at_level(logging.INFO, logger="nmt_serve.access"):
        _, call = stub.Translate.with_call(pb.TranslateRequest(texts=["Hund."]), metadata=metadata, timeout=30)
    (request_id,) = echoed(call.initial_metadata())
    assert request_id == offered if kept else GENERATED.fullmatch(request_id)
    (record,) = access_records(caplog)
    assert (record["request_id"], record["method"], record["code"], record["transport"]) == (request_id, "Translate", "OK", "grpc")


def test_request_id_grpc_on_calls_refused_before_the_servicer(running: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """The token check refuses the call in an interceptor after the request id's: the refusal carries the id too."""
    channel, stub = running.stub()
    with channel, caplog.at_level(logging.INFO, logger="nmt_serve.access"), pytest.raises(grpc.RpcError) as refused:
        stub.Translate(pb.TranslateRequest(texts=["Hund."]), metadata=[(HEADER, "refused-1")], timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    # Trailers only: initial metadata before a refusal would stop clients retrying what their policy retries.
    assert echoed(refused.value.initial_metadata()) == []  # type: ignore[attr-defined]
    assert echoed(refused.value.trailing_metadata()) == ["refused-1"]  # type: ignore[attr-defined]
    assert [(record["request_id"], record["code"]) for record in access_records(caplog)] == [("refused-1", "UNAUTHENTICATED")]
    with grpc.insecure_channel(running.target) as health_channel:  # open services answer with an id as well
        _, call = health_pb2_grpc.HealthStub(health_channel).Check.with_call(health_pb2.HealthCheckRequest(), timeout=10)
    assert GENERATED.fullmatch(echoed(call.initial_metadata())[0])


def post(server: RunningServer, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=30)  # type: ignore[union-attr]
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    answer = response.status, {key.lower(): value for key, value in response.getheaders()}, response.read()
    connection.close()
    return answer


@pytest.mark.parametrize(("path", "body"), [("/v1/translate", {"texts": ["Hund."]}), ("/v1/translate/stream", {"text": "Hund."})])
def test_request_id_http_echoed_and_logged(running: RunningServer, caplog: pytest.LogCaptureFixture, path: str, body: dict) -> None:
    authorization = {"Authorization": f"Bearer {TOKEN}"}
    with caplog.at_level(logging.INFO, logger="nmt_serve.access"):
        given = post(running, path, body, authorization | {"X-Request-Id": "req-42"})
        generated = post(running, path, body, authorization)
        refused = post(running, path, body, {"X-Request-Id": "req-43"})
    assert (given[0], given[1]["x-request-id"]) == (200, "req-42")
    assert generated[0] == 200 and GENERATED.fullmatch(generated[1]["x-request-id"])
    assert (refused[0], refused[1]["x-request-id"]) == (401, "req-43")
    logged = [(record["request_id"], record["code"], record["transport"]) for record in access_records(caplog)]
    assert logged == [("req-42", "OK", "http"), (generated[1]["x-request-id"], "OK", "http"), ("req-43", "UNAUTHENTICATED", "http")]


def test_log_format_json_one_object_per_line_with_request_fields(tiny_model_dir: Path, tmp_path: Path) -> None:
    """nmt-serve --log-format json as a process: its log lines are JSON objects (the native libraries' own lines aside)."""
    port_file, log = tmp_path / "port", tmp_path / "server.log"
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "nmt_serve.server.main", str(tiny_model_dir), "--port", "0", "--port-file", str(port_file),
                                    "--metrics-port", "-1", "--http-port", "0", "--threads", "1", "--log-format", "json"], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    try:
        assert wait_for(lambda: port_file.exists() and port_file.read_text(), 60), log.read_text()
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(texts=["Hund."]), metadata=[(HEADER, "json-1")], timeout=30)
    finally:
        process.terminate()
        assert process.wait(30) == 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    # onnxruntime's and grpc core's own loggers write to stderr directly, in their formats.
    objects = [json.loads(line) for line in lines if line.startswith("{")]
    native = [line for line in lines if not line.startswith("{")]
    assert all("onnxruntime" in line or re.match(r"[EWI]\d{4} ", line) for line in native), native
    assert objects and all({"time", "level", "logger", "message"} <= set(line) for line in objects)
    assert any(line["logger"] == "nmt-serve" and line["message"].startswith("serving ") for line in objects)
    (access,) = [line for line in objects if line["logger"] == "nmt_serve.access"]
    assert {key: access[key] for key in ("request_id", "method", "code", "texts", "transport")} == \
        {"request_id": "json-1", "method": "Translate", "code": "OK", "texts": 1, "transport": "grpc"}
    assert access["level"] == "INFO" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", access["time"])


def test_log_format_setting_validated() -> None:
    with pytest.raises(ValueError, match=r"--log-format must be one of text, json, got 'xml'"):
        server_settings(Path("unused"), log_format="xml").validate()


def test_metrics_build_info_and_no_created_series(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUILD_COMMIT_VARIABLE, "0123abc")
    exposition = Metrics().exposition()
    families = {family.name: family for family in text_string_to_metric_families(exposition)}
    (sample,) = families["nmt_build_info"].samples
    assert sample.value == 1 and sample.labels["version"] == version("nmt-serve") and sample.labels["commit"] == "0123abc"
    assert sample.labels["onnxruntime"] == ort.__version__ and "CPUExecutionProvider" in sample.labels["providers"].split(",")
    assert "_created" not in exposition
