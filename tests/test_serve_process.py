"""nmt-serve as its own process: SIGTERM under load, bad model dirs, TLS, the client CLI."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmt_serve.bench.balancer import free_port
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from nmt_serve.server.main import DRAIN_QUIET_MAX_S, DRAIN_QUIET_S
from tests.serving import NO_OPENSSL, RunningServer, Samples, scrape_until, self_signed_certificate, server_settings, total, wait_for

ROOT = Path(__file__).resolve().parent.parent


def start_server(model_dir: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """The server's output goes to a file, not a pipe: a pipe nobody reads while the clients run fills after ~64 kB
    of access log, and the server's next log write would block its event loop."""
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    with server_log(tmp_path).open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "nmt_serve.server.main", str(model_dir), "--port", "0", "--port-file", str(port_file),
                                    "--threads", "1", "--metrics-port", "0", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"nmt-serve did not start:\n{server_log(tmp_path).read_text()}")
        time.sleep(0.05)
    return process, f"127.0.0.1:{port_file.read_text()}"


def server_log(tmp_path: Path) -> Path:
    return tmp_path / "server.log"


def finished_output(process: subprocess.Popen, log: Path) -> str:
    """The server's whole output once it has exited (within 30 s)."""
    process.wait(timeout=30)
    return log.read_text()


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen
    target: str
    metrics_port: int
    log: Path


@pytest.fixture()
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    metrics_port = free_port()
    process, target = start_server(tiny_model_dir, tmp_path, "--grace-s", "20", "--max-queued-requests", "512", "--max-rows", "16",
                                   "--metrics-port", str(metrics_port))  # fmt: skip
    yield Served(process, target, metrics_port, server_log(tmp_path))
    if process.poll() is None:
        process.kill()
        process.wait()


def admitted(samples: Samples) -> float:
    """Translate requests admitted so far: waiting to join, in the batch, or answered."""
    answered = sum(value for (name, labels), value in samples.items() if name == "nmt_requests_total" and ("method", "Translate") in labels)
    return total(samples, "nmt_queue_depth") + total(samples, "nmt_active_requests") + answered


def test_serve_sigterm_under_load_loses_no_admitted_request(served: Served) -> None:
    process, target = served.process, served.target
    request = pb.TranslateRequest(texts=["Ich sehe den Hund."], options=pb.DecodingOptions(beam_size=4, min_output_tokens=90, max_output_tokens=90))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        # 16 rows per step (4 requests) make 256 requests take seconds even on the tiny model.
        calls = [stub.Translate.future(request, timeout=60) for _ in range(256)]
        # Every call admitted (a busy machine can take seconds to deliver 256 calls) before the SIGTERM.
        assert admitted(scrape_until(served.metrics_port, lambda samples: admitted(samples) >= len(calls), 60)) >= len(calls)
        assert not all(call.done() for call in calls), "the load finished before SIGTERM; make it longer"
        process.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING, 30)
        with pytest.raises(grpc.RpcError) as refused:  # new calls are refused while in-flight ones finish
            stub.Translate(request, timeout=10)
        results = [call.result() for call in calls]  # raises if any admitted call failed
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert all(len(result.translations[0].hypotheses[0].text) > 0 for result in results)
    output = finished_output(process, served.log)
    assert process.returncode == 0, output
    assert "draining" in output and "stopped" in output


def retry_until_refused(target: str, back_off_s: float, signalled: threading.Event, codes: Counter[str]) -> None:
    """One client: Translate again and again, backing off `back_off_s` after an UNAVAILABLE, until the port refuses
    the connection after the SIGTERM; every status it receives is counted in `codes` ("refused" for that last one)."""
    request = pb.TranslateRequest(texts=["Hund"], options=pb.DecodingOptions(max_output_tokens=2))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                stub.Translate(request, timeout=20)
                codes["OK"] += 1
            except grpc.RpcError as error:
                shutting_down = "shutting down" in (error.details() or "")
                if error.code() is grpc.StatusCode.UNAVAILABLE and not shutting_down:
                    if signalled.is_set():  # the port is closed: this server is gone
                        codes["refused"] += 1
                        return
                    codes["UNAVAILABLE before the signal"] += 1
                else:
                    codes[error.code().name] += 1
                time.sleep(back_off_s)


@pytest.mark.parametrize("back_off_s", [0.0, 0.1])
def test_serve_sigterm_answers_clients_retrying_at_once_with_results_or_unavailable_never_cancelled(tiny_model_dir: Path, tmp_path: Path,
                                                                                                      back_off_s: float) -> None:
    """Clients that retry an UNAVAILABLE after `back_off_s` (0: at once) keep calling through a SIGTERM: each call is
    answered with its result or UNAVAILABLE, never CANCELLED (grpc core cancels the calls it holds unhanded when the
    server stops, and those reaching it on an open connection during the stop, grpc/grpc#41785)."""
    process, target = start_server(tiny_model_dir, tmp_path, "--grace-s", "10")
    codes: Counter[str] = Counter()
    signalled = threading.Event()
    clients = [threading.Thread(target=retry_until_refused, args=(target, back_off_s, signalled, codes)) for _ in range(16)]
    try:
        for client in clients:
            client.start()
        assert wait_for(lambda: codes["OK"] >= 32, 30), f"the clients got no answers: {codes}"
        signalled.set()
        process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(60)
        output = finished_output(process, server_log(tmp_path))
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert codes["UNAVAILABLE"] > 0 and codes["refused"] == len(clients), codes
    assert set(codes) <= {"OK", "UNAVAILABLE", "refused"}, codes


def test_serve_drain_closes_the_port_only_once_calls_stop_arriving(tiny_model_dir: Path) -> None:
    """grpc core ends calls it holds unhanded at server stop CANCELLED (grpc/grpc#41785); the drain therefore keeps
    answering UNAVAILABLE until no call has arrived for DRAIN_QUIET_S, at most DRAIN_QUIET_MAX_S. Arrivals are
    simulated by setting the clock's last arrival (a thread that calls could be descheduled on a busy machine)."""
    with RunningServer(server_settings(tiny_model_dir, grace_s=30.0)) as running:
        running.server.arrivals.last_arrival = time.monotonic() + 3600  # calls keep arriving
        running.server.request_stop()
        time.sleep(DRAIN_QUIET_MAX_S / 2)
        assert running.is_running(), "the port closed while calls were still arriving"
        channel, stub = running.stub()
        with channel, pytest.raises(grpc.RpcError) as refused:
            stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        running.server.arrivals.last_arrival = time.monotonic() - DRAIN_QUIET_S  # and now they have stopped
        assert wait_for(lambda: not running.is_running(), 10), "the drain did not stop once calls stopped arriving"

    # Arrivals that never stop hold the port open DRAIN_QUIET_MAX_S, not the whole grace period.
    with RunningServer(server_settings(tiny_model_dir, grace_s=30.0)) as running:
        running.server.arrivals.last_arrival = time.monotonic() + 3600
        started = time.monotonic()
        running.server.request_stop()
        assert wait_for(lambda: not running.is_running(), 20), "the drain waited past DRAIN_QUIET_MAX_S"
        assert time.monotonic() - started >= DRAIN_QUIET_MAX_S


def test_serve_refusals_of_the_last_drain_phase_are_held_until_the_port_closes(tiny_model_dir: Path) -> None:
    """While the drain waits for calls to stop arriving, refusals are held and answered together just before the port
    closes: a client that backs off after its UNAVAILABLE is then waiting, not sending, when grpc core stops (a call
    core holds unhanded at that moment ends CANCELLED, grpc/grpc#41785)."""
    with RunningServer(server_settings(tiny_model_dir, grace_s=30.0)) as running:
        running.server.arrivals.last_arrival = time.monotonic() + 3600  # calls keep arriving: the phase lasts its maximum
        running.server.request_stop()
        assert wait_for(lambda: running.server.admission.holding, 10)
        channel, stub = running.stub()
        with channel, pytest.raises(grpc.RpcError) as refused:
            stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        assert not running.server.admission.holding, "answered while refusals were still held"
        assert wait_for(lambda: not running.is_running(), 10)


def test_serve_calls_cut_off_at_the_end_of_the_grace_period_are_logged_and_counted(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    request = pb.TranslateRequest(texts=["Ich sehe den Hund."], options=pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90))
    with RunningServer(server_settings(tiny_model_dir, grace_s=0.1)) as running:
        decoder = running.server.runtime.decoder
        run = decoder.run_with_iobinding

        def slow_run(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.05)  # 90 steps: 4.5 s, far past the 0.1 s grace period
            return run(*args, **kwargs)

        decoder.run_with_iobinding = slow_run  # type: ignore[method-assign]
        channel, stub = running.stub()
        with channel:
            call = stub.Translate.future(request, timeout=60)
            assert wait_for(lambda: running.server.scheduler.in_flight > 0, 10)
            running.server.request_stop()
            assert wait_for(lambda: not running.is_running(), 20)
            with pytest.raises(grpc.RpcError) as cut_off:
                call.result(timeout=10)
    # Answered by its handler, retryable, not cancelled by grpcio's stop.
    assert cut_off.value.code() is grpc.StatusCode.UNAVAILABLE and "grace period" in cut_off.value.details()
    assert "1 call(s) still running cut off" in caplog.text
    assert 'nmt_requests_total{code="UNAVAILABLE",method="Translate"' in running.server.metrics.exposition()
    assert "nmt_cut_off_calls_total 1.0" in running.server.metrics.exposition()


def copy_model_dir(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def run_bad(model_dir: Path) -> tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", "nmt_serve.server.main", str(model_dir), "--port", "0", "--metrics-port", "-1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def test_serve_missing_model_dir_exits_non_zero_naming_it(tmp_path: Path) -> None:
    code, output = run_bad(tmp_path / "nowhere")
    assert code != 0 and "nowhere" in output


def test_serve_corrupt_file_exits_non_zero_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = copy_model_dir(tiny_model_dir, tmp_path)
    with (model / "decoder.onnx").open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00garbage\x00")
    code, output = run_bad(model)
    assert code != 0 and "decoder.onnx" in output


def test_serve_corrupt_tokenizer_with_a_matching_hash_exits_non_zero_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.runtime.manifest import sha256_file

    model = copy_model_dir(tiny_model_dir, tmp_path)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = sha256_file(model / "tokenizer.json")  # the hash check passes
    (model / "manifest.json").write_text(json.dumps(manifest))
    code, output = run_bad(model)
    assert code == 1 and "tokenizer.json" in output.replace(str(model), "")


def test_serve_wrong_manifest_version_exits_non_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = copy_model_dir(tiny_model_dir, tmp_path)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["format_version"] = 99
    (model / "manifest.json").write_text(json.dumps(manifest))
    code, output = run_bad(model)
    assert code != 0 and "manifest.json" in output and "99" in output


def test_translate_cli_prints_translations(served: Served) -> None:
    target = served.target
    cli = [sys.executable, "-m", "nmt_serve.client.cli", "--target", target]
    result = subprocess.run([*cli, "Ich sehe den Hund.", ""], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split("\n")) == 3 and result.stdout.split("\n")[0] != ""  # the tiny model says little, but something
    piped = subprocess.run([*cli, "--json", "--beam", "2", "--nbest", "2"], input="Ich sehe den Hund.\nWir mag Kaffee.\n", cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [line["source"] for line in lines] == ["Ich sehe den Hund.", "Wir mag Kaffee."]
    assert all(len(line["hypotheses"]) == 2 for line in lines)
    streamed = subprocess.run([*cli, "--stream", "Ich sehe den Hund."], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert streamed.stdout == result.stdout.split("\n")[0] + "\n"
    bad = subprocess.run([*cli, "--beam", "0", "Hund"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "beam_size" in bad.stderr


@pytest.mark.skipif(NO_OPENSSL, reason="openssl binary not installed (apt-get install openssl)")
def test_serve_tls_port_refuses_plaintext(tiny_model_dir: Path, tmp_path: Path) -> None:
    key, cert = self_signed_certificate(tmp_path)
    with RunningServer(server_settings(tiny_model_dir, tls_cert=str(cert), tls_key=str(key))) as server:
        request = pb.TranslateRequest(texts=["Hund"])
        with grpc.insecure_channel(server.target) as plain:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.TranslationServiceStub(plain).Translate(request, timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(server.target, credentials) as secure:
            assert pb_grpc.TranslationServiceStub(secure).Translate(request, timeout=30).translations


def test_serve_drain_begins_the_grpc_stop_before_releasing_the_held_refusals(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients retrying after the released refusals must find the port closed, not a server stopping: the gRPC stop
    (GOAWAY, port closed) begins before the release, and the HTTP server's stop (up to a second with calls still
    writing) comes before both."""
    from grpc.aio._server import Server as AioServer

    events: list[str] = []
    grpc_stop = AioServer.stop

    async def recorded_grpc_stop(self, grace):  # type: ignore[no-untyped-def]
        events.append("grpc stop")
        return await grpc_stop(self, grace)

    monkeypatch.setattr(AioServer, "stop", recorded_grpc_stop)
    with RunningServer(server_settings(tiny_model_dir, http_port=free_port())) as running:
        http_stop, release = running.server.http.stop, running.server.admission.release

        async def recorded_http_stop() -> None:
            events.append("http stop")
            await http_stop()

        async def recorded_release(*args, **kwargs):  # type: ignore[no-untyped-def]
            events.append("release")
            await release(*args, **kwargs)

        running.server.http.stop = recorded_http_stop  # type: ignore[method-assign]
        running.server.admission.release = recorded_release  # type: ignore[method-assign]
        running.server.request_stop()
        assert wait_for(lambda: not running.is_running(), 20)
    assert events == ["http stop", "grpc stop", "release"]
