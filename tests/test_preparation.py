"""A large request is prepared (split, tokenized) off the event loop: health answers on both ports meanwhile."""

from __future__ import annotations

import concurrent.futures
import http.client
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.models import preparation
from tests.serving import RunningServer, server_settings
from tests.test_http import free_port

HOLD_S = 20.0  # a preparation held this long would hold the health probes with it, were it on the event loop


def test_preparation_of_a_large_request_leaves_health_answering(tiny_model_dir: Path) -> None:
    started, release = threading.Event(), threading.Event()
    with RunningServer(server_settings(tiny_model_dir, http_port=free_port())) as server:
        model = server.server.models.default
        translate = model.reader.translate

        def held(request: pb.TranslateRequest):  # type: ignore[no-untyped-def]
            started.set()
            release.wait(HOLD_S)  # blocks the thread it runs on
            return translate(request)

        model.reader.translate = held  # type: ignore[method-assign]
        texts = ["Ich sehe den Hund.\n" * 8] * 8  # 64 sentences, the queue's places; over preparation.INLINE_BYTES
        assert pb.TranslateRequest(texts=texts).ByteSize() > preparation.INLINE_BYTES
        channel, stub = server.stub()
        with channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stub.Translate, pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(max_output_tokens=4)), timeout=60)
            assert started.wait(30)
            try:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=HOLD_S / 4)
                probe = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=HOLD_S / 4)
                probe.request("GET", "/healthz")
                live = probe.getresponse().status
                probe.close()
            finally:
                release.set()
            assert check.status == health_pb2.HealthCheckResponse.SERVING and live == 200
            assert len(answer.result().translations) == 8


def test_preparation_thread_hands_the_gil_back_within_a_millisecond(tiny_model_dir: Path) -> None:
    """The event loop waits at most the interpreter's switch interval for the GIL while a large request is prepared."""
    with RunningServer(server_settings(tiny_model_dir)):
        assert sys.getswitchinterval() <= preparation.GIL_SWITCH_S
