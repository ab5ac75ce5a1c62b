"""--max-connection-age-s: the server closes old connections gracefully, so long-lived clients reconnect (and re-resolve)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from nmt_serve.server.settings import parse_settings
from tests.serving import RunningServer, server_settings

CALLS = 12
PAUSE_S = 0.25  # calls spread over ~3 s: several times the 0.5 s age below


def connections_seen(target: str) -> tuple[int, set[str]]:
    """How many times one client channel became READY while making CALLS calls, and the calls' codes."""
    ready, codes, lock = [0], set(), threading.Lock()

    def on_change(state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            with lock:
                ready[0] += 1

    with grpc.insecure_channel(target) as channel:
        channel.subscribe(on_change, try_to_connect=True)
        stub = pb_grpc.TranslationServiceStub(channel)
        for _ in range(CALLS):
            try:
                stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=20)
                codes.add("OK")
            except grpc.RpcError as error:
                codes.add(error.code().name)
            time.sleep(PAUSE_S)
        channel.unsubscribe(on_change)
    return ready[0], codes


@pytest.mark.parametrize("age_s", [0.0, 0.5])
def test_connections_older_than_the_age_are_replaced_without_failing_a_call(tiny_model_dir: Path, age_s: float) -> None:
    with RunningServer(server_settings(tiny_model_dir, max_connection_age_s=age_s)) as running:
        ready, codes = connections_seen(running.target)
    assert codes == {"OK"}
    if age_s:
        assert ready >= 3, ready  # ~3 s of calls on a 0.5 s age: the connection was replaced several times
    else:
        assert ready == 1, ready  # without an age, one connection serves every call


def test_negative_connection_age_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--max-connection-age-s must be at least 0, got -1"):
        parse_settings(["--max-connection-age-s", "-1"], environ={})
