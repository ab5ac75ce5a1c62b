"""The deploy files with local processes: two nmt-serve replicas behind the Debian nginx (deploy/nginx.conf) and
the Debian prometheus (deploy/prometheus.yml), all on loopback; docker-compose.yml validated by docker-compose."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from nmt_serve.bench.balancer import NGINX, Balancer, free_port, http_ok
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import RunningServer, held_engines, query, server_settings, wait_for

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose; .ci/run does)")
def compose_config(**settings: str) -> subprocess.CompletedProcess:
    """`docker-compose config` with only `settings` among the compose file's variables set."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("NMT_", "GRAFANA_"))} | settings
    return subprocess.run([COMPOSE, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)  # type: ignore[list-item]


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose; .ci/run does)")
def test_compose_defaults_are_safe() -> None:
    # Grafana's admin password is required: no default credentials.
    missing = compose_config()
    assert missing.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in missing.stderr
    result = compose_config(GRAFANA_ADMIN_PASSWORD="not-a-default")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    published = {name: [str(port) for port in service["ports"]] for name, service in services.items() if service.get("ports")}
    assert set(published) == {"balancer-gpu", "balancer-cpu", "prometheus", "alertmanager", "grafana"}
    # Every published port is bound to loopback unless NMT_BIND says otherwise.
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports), published
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "not-a-default" and grafana["GF_USERS_ALLOW_SIGN_UP"] == "false"
    for name in ("translator-gpu", "translator-cpu"):
        environment = services[name]["environment"]
        assert environment["NMT_AUTH_TOKEN"] == environment["NMT_TLS_CERT"] == environment["NMT_TLS_KEY"] == ""
    # The bind address, the token and the TLS files are compose settings.
    chosen = compose_config(GRAFANA_ADMIN_PASSWORD="x", NMT_BIND="127.0.0.2", NMT_AUTH_TOKEN="t0ken",
                            NMT_TLS_CERT="/run/nmt-tls/cert.pem", NMT_TLS_KEY="/run/nmt-tls/key.pem")  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr
    services = yaml.safe_load(chosen.stdout)["services"]
    assert [str(port) for port in services["balancer-cpu"]["ports"]] == ["127.0.0.2:8080:8080/tcp", "127.0.0.2:8000:8000/tcp"]
    # The balancer's host ports are settings too.
    moved = compose_config(GRAFANA_ADMIN_PASSWORD="x", NMT_BALANCER_PORT="18080", NMT_BALANCER_HTTP_PORT="18000")
    assert [str(port) for port in yaml.safe_load(moved.stdout)["services"]["balancer-cpu"]["ports"]] == \
        ["127.0.0.1:18080:8080/tcp", "127.0.0.1:18000:8000/tcp"]
    environment = services["translator-cpu"]["environment"]
    assert (environment["NMT_AUTH_TOKEN"], environment["NMT_TLS_CERT"], environment["NMT_TLS_KEY"]) == \
        ("t0ken", "/run/nmt-tls/cert.pem", "/run/nmt-tls/key.pem")
    assert any(str(volume).endswith(":/run/nmt-tls:ro") for volume in services["translator-cpu"]["volumes"])


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose; .ci/run does)")
def test_compose_file_is_valid_and_wires_the_stack() -> None:
    result = compose_config(GRAFANA_ADMIN_PASSWORD="not-a-default")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    gpu = services["translator-gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "resources" not in services["translator-cpu"].get("deploy", {})
    for name in ("translator-gpu", "translator-cpu"):
        service = services[name]
        assert service["deploy"]["replicas"] >= 2 and "translator" in service["networks"]["default"]["aliases"]
        grace = float(service["environment"]["NMT_GRACE_S"])
        assert int(re.fullmatch(r"(\d+)s", service["stop_grace_period"]).group(1)) > grace  # type: ignore[union-attr]
        assert service["healthcheck"]["test"][1] == "nmt-health"
        # The HTTP/JSON API listens on the container network, where the balancer's HTTP upstream finds it.
        assert (service["environment"]["NMT_HTTP_HOST"], service["environment"]["NMT_HTTP_PORT"]) == ("0.0.0.0", "8000")
    for balancer, translator in (("balancer-gpu", "translator-gpu"), ("balancer-cpu", "translator-cpu")):
        assert services[balancer]["depends_on"][translator]["condition"] == "service_healthy"
    assert services["loadtest"]["profiles"] == ["loadtest"] and "balancer:8080" in services["loadtest"]["command"]
    assert any("deploy/grafana/provisioning" in str(volume) for volume in services["grafana"]["volumes"])
    # Prometheus gets the alert rules next to its config, where deploy/prometheus.yml's rule_files looks.
    assert any(str(volume).endswith("deploy/alerts.yml:/etc/prometheus/alerts.yml:ro") for volume in services["prometheus"]["volumes"])
    # ... and sends the alerts to the Alertmanager service, whose one receiver is the alert-receiver service.
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    (alertmanagers,) = prometheus["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    assert any(str(volume).endswith("deploy/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro") for volume in services["alertmanager"]["volumes"])
    alertmanager = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text(encoding="utf-8"))
    (receiver,) = alertmanager["receivers"]
    assert receiver["webhook_configs"][0]["url"] == "http://alert-receiver:9095/" and "alert-receiver" in services


def start_replica(model_dir: Path, work: Path, name: str) -> tuple[subprocess.Popen, int, int]:
    port_file, metrics_port = work / f"{name}.port", free_port()
    log = (work / f"{name}.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "nmt_serve.server.main", str(model_dir), "--port", "0", "--port-file", str(port_file),
                                "--metrics-port", str(metrics_port), "--threads", "1", "--grace-s", "10"],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    assert wait_for(lambda: port_file.exists() and port_file.read_text(), 60), (work / f"{name}.log").read_text()
    return process, int(port_file.read_text()), metrics_port


@pytest.fixture()
def cluster(tiny_model_dir: Path, tmp_path: Path) -> Iterator[dict]:
    if NGINX is None or PROMETHEUS is None:
        pytest.skip("nginx and prometheus binaries needed (apt-get install nginx prometheus; .ci/run does)")
    processes: list[subprocess.Popen] = []
    try:
        replicas = [start_replica(tiny_model_dir, tmp_path, f"replica{index}") for index in range(2)]
        processes += [process for process, _, _ in replicas]
        balancer = Balancer([f"127.0.0.1:{port}" for _, port, _ in replicas], tmp_path)
        processes.append(balancer.process)
        prometheus_config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
        prometheus_config["global"]["scrape_interval"] = "1s"
        prometheus_config["rule_files"] = [str(ROOT / "deploy" / "alerts.yml")]
        for job in prometheus_config["scrape_configs"]:
            job.pop("dns_sd_configs")
            job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics}" for _, _, metrics in replicas]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config), encoding="utf-8")
        prometheus_port = free_port()
        processes.append(subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",  # type: ignore[list-item]
                                           f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        assert wait_for(lambda: http_ok(f"http://127.0.0.1:{prometheus_port}/-/ready"), 30)
        yield {"balancer": balancer.target, "replicas": replicas, "prometheus": prometheus_port, "work": tmp_path}
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def translate_with_retries(stub: pb_grpc.TranslationServiceStub, text: str, attempts: int = 5) -> list[str]:
    """Codes of every attempt; UNAVAILABLE (a replica draining or gone) and CANCELLED (sent by a stopping replica,
    grpc/grpc#41785) are retried with exponential backoff from 0.1 s, as client/client.py's retry policy does."""
    codes = []
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.1 * 2 ** (attempt - 1))
        try:
            stub.Translate(pb.TranslateRequest(texts=[text], options=pb.DecodingOptions(min_output_tokens=40, max_output_tokens=40)), timeout=30)
            codes.append("OK")
            return codes
        except grpc.RpcError as error:
            codes.append(error.code().name)
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                return codes
    return codes


def test_load_through_nginx_reaches_both_replicas_and_survives_losing_one(cluster: dict) -> None:
    with grpc.insecure_channel(cluster["balancer"]) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            warm = list(pool.map(lambda i: translate_with_retries(stub, f"Ich sehe den Hund {i}."), range(40)))
        assert all(codes == ["OK"] for codes in warm), warm

        # Both replicas served: per-replica nmt_requests_total, as Prometheus scraped it.
        def per_instance() -> dict[str, float] | None:
            found = {item["metric"]["instance"]: float(item["value"][1])
                     for item in query(cluster["prometheus"], 'sum by (instance) (nmt_requests_total{method="Translate",code="OK"})')}  # fmt: skip
            return found if len(found) == 2 and sum(found.values()) == 40 else None

        counts = wait_for(per_instance, 30)
        assert counts and all(value > 0 for value in counts.values()), query(cluster["prometheus"], "nmt_requests_total")

        # Stop one replica (SIGTERM: it drains) while 120 calls run through the balancer.
        victim = cluster["replicas"][0][0]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(translate_with_retries, stub, f"Wir mag Kaffee {i}.") for i in range(120)]
            time.sleep(0.3)
            victim.send_signal(signal.SIGTERM)
            results = [future.result() for future in futures]
    assert victim.wait(30) == 0
    failed_first = [(index, codes) for index, codes in enumerate(results) if codes[0] != "OK"]
    # Report exactly which calls needed a retry and why; every call ends OK after the client's retries. The drain
    # makes a CANCELLED rare (tests/test_serve_process.py, the drain tests), but grpc core can still send one to a call
    # that arrives in the instant the server stops.
    print(f"calls retried after the replica stopped: {failed_first}")
    assert all(codes[-1] == "OK" for codes in results), failed_first
    assert {code for codes in results for code in codes} <= {"OK", "UNAVAILABLE", "CANCELLED"}


LONG = {"min_output_tokens": 90, "max_output_tokens": 90}  # keeps a stream decoding for 90 steps


def post_json(target: str, path: str, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(*target.split(":"), timeout=60)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return connection.getresponse()


def next_event(response: http.client.HTTPResponse) -> dict:
    """The JSON data of the next server-sent event."""
    data = None
    while (line := response.readline()) not in (b"\n", b""):
        if line.startswith(b"data: "):
            data = json.loads(line[len(b"data: "):])
    assert data is not None, "the stream ended"
    return data


@pytest.mark.skipif(NGINX is None, reason="nginx binary needed (apt-get install nginx; .ci/run does)")
def test_http_api_through_nginx_answers_and_streams_each_event_as_it_is_decoded(tiny_model_dir: Path, tmp_path: Path) -> None:
    """deploy/nginx.conf's HTTP server in front of a replica's --http-port: a translation is the replica's own answer,
    and a stream's first event reaches the client while the replica's engine is held, its call unfinished. The stream's
    location turns buffering off itself, not only through the replica's X-Accel-Buffering header."""
    stream_location = (ROOT / "deploy" / "nginx.conf").read_text(encoding="utf-8").split("location = /v1/translate/stream {", 1)[1]
    assert "proxy_buffering off;" in stream_location.split("}", 1)[0]
    with RunningServer(server_settings(tiny_model_dir, http_port=free_port())) as server:
        balancer = Balancer([server.target], tmp_path, http_targets=[f"127.0.0.1:{server.server.http.port}"])  # type: ignore[union-attr]
        try:
            body = {"texts": ["Ich sehe den Hund."], "options": {"beam_size": 2}}
            through, direct = post_json(balancer.http_target, "/v1/translate", body), post_json(f"127.0.0.1:{server.server.http.port}", "/v1/translate", body)  # type: ignore[union-attr]
            assert (through.status, json.loads(through.read())) == (direct.status, json.loads(direct.read()))
            with held_engines(server) as gate, concurrent.futures.ThreadPoolExecutor(1) as pool:
                response = pool.submit(post_json, balancer.http_target, "/v1/translate/stream", {"text": "Wir mag Kaffee.", "options": LONG})
                first = pool.submit(lambda: next_event(response.result()))
                # Steps one at a time until the first event is through: far fewer than the stream's 90.
                for _ in range(45):
                    if concurrent.futures.wait([first], timeout=0.5).done:
                        break
                    gate.allow(1)
                assert first.result(timeout=60)["text_delta"] and not first.result()["final"]
                assert server.server.service.calls_running == 1, "the first event came only once the call had ended"
                assert response.result().getheader("Content-Type").startswith("text/event-stream")
                gate.open()
                rest = [next_event(response.result())]
                while not rest[-1]["final"]:
                    rest.append(next_event(response.result()))
            (best, *_) = rest[-1]["hypotheses"]
            assert best["token_count"] == 90 and first.result()["text_delta"] + "".join(event["text_delta"] for event in rest) == best["text"]
        finally:
            balancer.stop()


def test_dockerfile_builds_cpu_and_gpu_targets_torch_free_and_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, flags=re.MULTILINE)
    assert {"cpu", "gpu"} <= set(stages)
    for stage in ("cpu", "gpu"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        installs = re.findall(r'pip install "\$\(ls /tmp/dist/nmt_serve-\*\.whl\)\[([\w-]+)\]"', body)
        assert installs and all(extra.startswith("serve") for extra in installs), installs  # the torch-free extras
        # The wheel built in its own stage, nothing else of the sources: no build/, egg-info or source tree in the image.
        assert "COPY --from=source" not in body and "--mount=type=bind,from=dist,source=/dist" in body
        labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', body))
        assert {labels[f"org.opencontainers.image.{name}"] for name in ("version", "revision", "source")} == {"${VERSION}", "${REVISION}", "${SOURCE}"}
        assert re.search(r"^USER (?!root)\w+", body, flags=re.MULTILINE), f"{stage} runs as root"
        assert 'HEALTHCHECK' in body and '"nmt-health"' in body
    assert not re.search(r"\b(curl|wget)\b", text), "the image must not download binaries"
    # The GPU image's onnxruntime-gpu is built for its CUDA major (1.26 and older: CUDA 12; 1.27 and newer: CUDA 13).
    cuda_major = int(re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", text, flags=re.MULTILINE).group(1))  # type: ignore[union-attr]
    onnxruntime_gpu = re.search(r'^ARG ONNXRUNTIME_GPU="([^"]+)"', text, flags=re.MULTILINE).group(1)  # type: ignore[union-attr]
    assert onnxruntime_gpu == {12: "onnxruntime-gpu>=1.20,<1.27", 13: "onnxruntime-gpu>=1.27"}[cuda_major]
    assert '"${ONNXRUNTIME_GPU}"' in text.split(" AS gpu\n", 1)[1]
    # Every file the image copies exists in the repository.
    for source in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.MULTILINE):
        assert (ROOT / source).exists(), source
