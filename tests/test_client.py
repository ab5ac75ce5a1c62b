"""TranslationClient: its retry policy rides over UNAVAILABLE (a server not yet admitting), nothing else."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from client.client import Options, TranslationClient
from tests.serving import RunningServer, server_settings


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
