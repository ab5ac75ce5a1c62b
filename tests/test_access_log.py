"""The access log: one line per finished call with method, model, status, seconds and the number of texts, never a text."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import grpc
import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, server_settings

SECRET = "Geheimnisvoller Satz."


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "nmt_serve.access"]


def test_access_log_one_line_per_call_with_code_and_text_count(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nmt_serve.access"), RunningServer(server_settings(tiny_model_dir)) as running:
        channel, stub = running.stub()
        with channel:
            stub.Translate(pb.TranslateRequest(texts=[SECRET, "Hund."]), timeout=30)
            with pytest.raises(grpc.RpcError):
                stub.Translate(pb.TranslateRequest(texts=[SECRET], options=pb.DecodingOptions(beam_size=99)), timeout=30)
            list(stub.TranslateStream(pb.TranslateStreamRequest(text=SECRET), timeout=30))
        lines = access_lines(caplog)
    model = running.server.runtime.manifest.model_name
    assert re.fullmatch(rf"Translate model={model} code=OK seconds=\d+\.\d{{4}} texts=2 request_id=[0-9a-f]{{32}}", lines[0])
    assert re.fullmatch(rf"Translate model={model} code=INVALID_ARGUMENT seconds=\d+\.\d{{4}} texts=1 request_id=[0-9a-f]{{32}}", lines[1])
    assert re.fullmatch(rf"TranslateStream model={model} code=OK seconds=\d+\.\d{{4}} texts=1 request_id=[0-9a-f]{{32}}", lines[2])
    assert len(lines) == 3 and not any(SECRET in line or "Geheim" in line for line in caplog.messages)


def test_access_log_off_writes_nothing(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nmt_serve.access"), RunningServer(server_settings(tiny_model_dir, access_log=0)) as running:
        channel, stub = running.stub()
        with channel:
            stub.Translate(pb.TranslateRequest(texts=["Hund."]), timeout=30)
    assert access_lines(caplog) == []


def test_access_log_setting_validated() -> None:
    with pytest.raises(ValueError, match="--access-log must be 0 \\(off\\) or 1 \\(on\\), got 2"):
        server_settings(Path("unused"), access_log=2).validate()
