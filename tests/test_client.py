"""TranslationClient: its retry policy is the published one; it rides over UNAVAILABLE (a server not yet admitting), nothing else."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from client.client import CHANNEL_OPTIONS, Options, TranslationClient
from protos.nmt.translation.v1 import translation_pb2 as pb
from protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import RunningServer, server_settings

SERVICE_CONFIG = Path(pb.__file__).with_name("service_config.json")


class RefusingServicer(pb_grpc.TranslationServiceServicer):
    """Answers every Translate with `code` and counts the attempts that reach it."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.attempts = 0

    def Translate(self, request: pb.TranslateRequest, context: grpc.ServicerContext) -> pb.TranslateResponse:
        self.attempts += 1
        context.abort(self.code, "refused by the test server")


@pytest.fixture(scope="module")
def refusing() -> Iterator[tuple[str, RefusingServicer]]:
    servicer = RefusingServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TranslationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_client_retries_unavailable_until_the_server_is_warm(tiny_model_dir: Path) -> None:
    running = RunningServer(server_settings(tiny_model_dir), hold_warm_up=True)
    with running:
        threading.Timer(0.3, running.release_warm_up).start()  # UNAVAILABLE ("warming up") for the first 0.3 s
        with TranslationClient(running.target) as client:
            nbest = client.translate(["Ich sehe den Hund."], timeout=30)
            assert len(nbest) == 1 and nbest[0][0].token_count > 0
            with pytest.raises(grpc.RpcError) as caught:  # INVALID_ARGUMENT is final: no retry hides it
                client.translate(["Hund"], Options(beam_size=0), timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_client_channel_carries_the_published_service_config() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.enable_retries"] == 1
    assert json.loads(options["grpc.service_config"]) == json.loads(SERVICE_CONFIG.read_text(encoding="utf-8"))


@pytest.mark.parametrize("code", [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK], ids=lambda code: code.name)
def test_client_retries_the_published_codes_the_published_number_of_times(
    refusing: tuple[str, RefusingServicer], code: grpc.StatusCode
) -> None:
    target, servicer = refusing
    [method] = json.loads(SERVICE_CONFIG.read_text(encoding="utf-8"))["methodConfig"]
    policy = method["retryPolicy"]
    servicer.code, servicer.attempts = code, 0
    with TranslationClient(target) as client, pytest.raises(grpc.RpcError, match=code.name) as caught:
        client.translate(["Hund"], timeout=30)
    assert caught.value.code() is code
    assert servicer.attempts == (policy["maxAttempts"] if code.name in policy["retryableStatusCodes"] else 1)
