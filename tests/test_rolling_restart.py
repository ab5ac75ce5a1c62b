"""Replicas stopped and added behind the shipped balancer (deploy/nginx.conf run by deploy/nginx-upstreams.sh, the
Debian nginx) on loopback, under load from clients that never retry: no call may fail."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt_serve.bench.balancer import NGINX, free_port, http_ok, nginx_config
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import wait_for

ROOT = Path(__file__).resolve().parent.parent
SETTLE_S = 1.0
pytestmark = pytest.mark.skipif(NGINX is None or shutil.which("curl") is None,
                                reason="nginx and curl needed (apt-get install nginx curl; .ci/run does)")  # fmt: skip


class Replica:
    """One nmt-serve process on a free loopback port, draining with a settle period as docker-compose runs it."""

    def __init__(self, model_dir: Path, work: Path, name: str, port: int | None = None) -> None:
        self.port, self.metrics_port = port or free_port(), free_port()
        self.log = work / f"{name}.log"
        self.process = subprocess.Popen([sys.executable, "-m", "nmt_serve.server.main", str(model_dir), "--port", str(self.port),
                                         "--metrics-port", str(self.metrics_port), "--threads", "1", "--engines", "1", "--grace-s", "10",
                                         "--drain-settle-s", str(SETTLE_S), "--access-log", "0"],
                                        cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        assert wait_for(lambda: self.translated() is not None, 60), self.log.read_text()

    def translated(self) -> float | None:
        """Translate calls this replica answered OK, from its /metrics; None while it does not answer."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("nmt_requests_total{") and 'method="Translate"' in line and 'code="OK"' in line)  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


class Load:
    """`clients` threads calling Translate through `target` back to back, without retries, until stop()."""

    def __init__(self, target: str, clients: int = 6) -> None:
        self.codes: Counter[str] = Counter()
        self.failures: list[tuple[float, str]] = []  # (time.time(), "CODE: details") of each failed call
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # One channel per client, as separate client processes would have; no retry policy.
        self._threads = [threading.Thread(target=self._run, args=(target, index), daemon=True) for index in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, target: str, index: int) -> None:
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            while not self._stop.is_set():
                try:
                    stub.Translate(pb.TranslateRequest(texts=[f"Ich sehe den Hund {index}."],
                                                       options=pb.DecodingOptions(min_output_tokens=8, max_output_tokens=8)), timeout=30)  # fmt: skip
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                    with self._lock:
                        self.failures.append((time.time(), f"{code}: {error.details()}"))
                with self._lock:
                    self.codes[code] += 1

    def stop(self) -> Counter[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return self.codes


@pytest.fixture()
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[dict]:
    replicas: list[Replica] = []
    balancer: subprocess.Popen | None = None
    try:
        replicas += [Replica(tiny_model_dir, tmp_path, f"replica{index}") for index in range(2)]
        spare_port = free_port()  # listed from the start, as a name resolving to a replica not yet started
        listen, health, placeholder = free_port(), free_port(), free_port()
        # deploy/nginx.conf on loopback, its upstream line "server 127.0.0.1:<placeholder> ...;", which the script
        # replaces as it replaces "server translator:50051 ...;" in the containers.
        template = nginx_config(tmp_path, [placeholder], listen, health)
        env = os.environ | {"NMT_NGINX_TEMPLATE": str(template), "NMT_NGINX": str(NGINX), "NMT_NGINX_WORK": str(tmp_path / "run"),
                            "NMT_UPSTREAM_NAME": "127.0.0.1", "NMT_UPSTREAM_PORT": str(placeholder), "NMT_RESOLVE_INTERVAL_S": "0.5",
                            "NMT_UPSTREAM_ADDRESSES": " ".join(f"127.0.0.1:{port}" for port in (replicas[0].port, replicas[1].port, spare_port))}  # fmt: skip
        balancer_log = tmp_path / "balancer.log"
        balancer = subprocess.Popen(["sh", str(ROOT / "deploy" / "nginx-upstreams.sh")], env=env, stdout=balancer_log.open("w"),
                                    stderr=subprocess.STDOUT)  # fmt: skip
        assert wait_for(lambda: http_ok(f"http://127.0.0.1:{health}/healthz"), 30), balancer_log.read_text()
        yield {"target": f"127.0.0.1:{listen}", "replicas": replicas, "spare_port": spare_port, "work": tmp_path, "log": balancer_log}
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(30)
        for replica in replicas:
            replica.stop()


def test_rolling_restart_replica_stopped_under_load_fails_no_call_of_a_client_without_retries(stack: dict) -> None:
    victim, survivor = stack["replicas"]
    load = Load(stack["target"])
    try:
        assert wait_for(lambda: (victim.translated() or 0) > 0 and (survivor.translated() or 0) > 0, 30), "load did not reach both replicas"
        victim.process.send_signal(signal.SIGTERM)
        assert victim.process.wait(30) == 0, victim.log.read_text()
        served_after = survivor.translated() or 0
        assert wait_for(lambda: (survivor.translated() or 0) > served_after + 20, 30), "the survivor stopped serving"
    finally:
        codes = load.stop()
    assert set(codes) == {"OK"}, (codes, load.failures[:5], stack["log"].read_text())
    assert "refuses new connections" in victim.log.read_text()


def test_rolling_restart_replica_added_under_load_receives_calls(stack: dict, tiny_model_dir: Path) -> None:
    load = Load(stack["target"])
    added = None
    try:
        added = Replica(tiny_model_dir, stack["work"], "added", port=stack["spare_port"])
        assert wait_for(lambda: (added.translated() or 0) > 0, 30), stack["log"].read_text()
    finally:
        codes = load.stop()
        if added is not None:
            added.stop()
    assert set(codes) == {"OK"}, (codes, stack["log"].read_text())
    assert "(reloaded)" in stack["log"].read_text()
