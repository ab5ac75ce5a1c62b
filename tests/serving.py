"""A real nmt-serve Server on a loopback port, run in a thread of the test process (for fault injection)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from nmt_serve.server.main import Server
from nmt_serve.server.settings import ServerSettings


def server_settings(model_dir: Path, **overrides: object) -> ServerSettings:
    """Port 0 (any free one), one ORT thread, small limits so that edges are cheap to reach; no translation cache, so a
    repeated text reaches the engine again (tests of the cache turn it on)."""
    base = ServerSettings(model_dir=model_dir, port=0, threads=1, max_texts=16, max_chars_per_text=400, max_beam_size=4,
                          max_message_bytes=256 * 1024, max_queued_requests=64, grace_s=5.0, default_deadline_s=20.0,
                          metrics_port=0, http_port=0, cache_mb=0)  # fmt: skip
    return dataclasses.replace(base, **overrides)


class RunningServer:
    """Context manager; `hold_warm_up` keeps the server in its warm-up phase until `release_warm_up()`."""

    def __init__(self, settings: ServerSettings, hold_warm_up: bool = False) -> None:
        self.server = Server(settings)
        self._release = threading.Event()
        if hold_warm_up:
            warm_up = self.server.runtime.warm_up

            def held() -> float:
                self._release.wait(30)
                return warm_up()

            self.server.runtime.warm_up = held  # type: ignore[method-assign]
        else:
            self._release.set()
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.run(install_signals=False)), daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def is_running(self) -> bool:
        """False once `Server.run` has returned (a drain has finished)."""
        return self._thread.is_alive()

    def release_warm_up(self) -> None:
        self._release.set()

    def __enter__(self) -> RunningServer:
        self._thread.start()
        if self._release.is_set():
            assert self.server.serving.wait(30), "server did not become ready"
        else:
            while not self.server.port:  # bound before warm-up starts
                threading.Event().wait(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self._release.set()
        self.server.request_stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "server did not stop"

    def stub(self) -> tuple[grpc.Channel, pb_grpc.TranslationServiceStub]:
        channel = grpc.insecure_channel(self.target)
        return channel, pb_grpc.TranslationServiceStub(channel)


class StepGate:
    """Engine steps wait here until let through: `allow(n)` lets n more steps pass, `open()` every one from then on.
    Tests hold calls in the queue or the batch with it, so what they check does not depend on how fast the CPU steps."""

    MAX_WAIT_S = 30.0  # a test that forgets to open the gate ends slowly instead of hanging
    TRICKLE_S = 0.01  # first_message lets one step through this often

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._allowed = 0
        self._open = False

    def allow(self, steps: int = 1) -> None:
        with self._condition:
            self._allowed += steps
            self._condition.notify_all()

    def open(self) -> None:
        with self._condition:
            self._open = True
            self._condition.notify_all()

    def pass_through(self) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._open or self._allowed > 0, self.MAX_WAIT_S)
            if not self._open and self._allowed > 0:
                self._allowed -= 1


def first_message(call: Iterator[Any], gate: StepGate) -> Any:
    """The stream's first message, letting engine steps through one at a time until it comes: a fixed number could
    go to another engine still stepping a stream that was just cancelled (it leaves that engine at its next step)."""
    arrived = threading.Event()

    def let_steps_through() -> None:
        while not arrived.is_set():
            gate.allow(1)
            arrived.wait(StepGate.TRICKLE_S)

    feeder = threading.Thread(target=let_steps_through)
    feeder.start()
    try:
        return next(call)
    finally:
        arrived.set()
        feeder.join()


@contextlib.contextmanager
def held_engines(server: RunningServer, models: tuple[str, ...] = ()) -> Iterator[StepGate]:
    """Every engine step of `models` (default: every model) first passes a StepGate; on exit the gate opens and the
    engines step freely again."""
    gate, held = StepGate(), []
    for model in server.server.models:
        if models and model.name not in models:
            continue
        for engine in model.scheduler.engines:
            step = engine.step

            def gated(step: Callable[[], None] = step) -> None:
                gate.pass_through()
                step()

            engine.step = gated  # type: ignore[method-assign]
            held.append(engine)
    try:
        yield gate
    finally:
        gate.open()
        for engine in held:
            del engine.step  # the class's own method again


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(check, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}  # fmt: skip


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every label set holding `labels` (a metric's other labels, such as model, summed over)."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items() if sample == name and wanted <= set(sample_labels))


def scrape_until(port: int, ready: Callable[[Samples], bool], timeout_s: float = 10.0) -> Samples:
    """A failed call's status can reach the client a moment before the server counts it."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


NO_OPENSSL = shutil.which("openssl") is None  # skip reason: "openssl binary not installed (apt-get install openssl)"


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(key, certificate) PEM files for localhost and 127.0.0.1, valid one day, made by the openssl binary."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, env={**os.environ, "OPENSSL_CONF": "/dev/null"})  # fmt: skip
    return key, cert
