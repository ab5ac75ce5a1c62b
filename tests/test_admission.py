"""Calls refused at arrival when the queue is full: before their message is read, counted once per call."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.service import SERVICE_NAME
from tests.raw_http2 import END_HEADERS, HEADERS, call, frame, request_headers
from tests.serving import RunningServer, first_message, held_engines, scrape_until, server_settings, total, wait_for

LONG = pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90)


def test_early_admission_refuses_before_reading_the_message(tiny_model_dir: Path) -> None:
    settings = server_settings(tiny_model_dir, max_queued_requests=1, max_rows=1, max_deadline_s=30.0)
    with RunningServer(settings) as server:
        channel, stub = server.stub()
        with channel:
            # The engine steps only when let through, so the holder keeps its place, however fast the CPU, until both
            # other calls have been refused.
            with held_engines(server) as gate:
                holder = stub.TranslateStream(pb.TranslateStreamRequest(text="Ich sehe den Hund.", options=LONG), timeout=60)
                first_message(holder, gate)  # the one place in the queue is taken
                # Headers and no message: a call that had to be read first would wait out the 30 s maximum.
                ending = call(server.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(f"/{SERVICE_NAME}/Translate")), wait_s=10)
                with pytest.raises(grpc.RpcError, match="queue full") as caught:
                    stub.Translate(pb.TranslateRequest(texts=["Hund"] * 4), timeout=10)
                holder.cancel()
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_rejected_total", reason="queue_full") >= 2)
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], ending
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert total(samples, "nmt_rejected_total", reason="queue_full") == 2  # calls, not texts: the refused Translate held four
    assert total(samples, "nmt_requests_total", code="RESOURCE_EXHAUSTED", method="Translate") == 2


def test_early_admission_lets_calls_in_once_a_place_frees(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=1, max_rows=1)) as server:
        channel, stub = server.stub()
        with channel:
            # The engine steps only when let through, so the holder cannot finish, however fast the CPU, before the
            # second call has been refused.
            with held_engines(server) as gate:
                holder = stub.TranslateStream(pb.TranslateStreamRequest(text="Ich sehe den Hund.", options=LONG), timeout=60)
                first_message(holder, gate)
                with pytest.raises(grpc.RpcError, match="queue full"):
                    stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=10)
                holder.cancel()
            assert wait_for(lambda: server.server.scheduler.in_flight == 0, 10)
            assert stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=30).translations
