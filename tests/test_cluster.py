"""The deploy files with local processes: two nmt-serve replicas behind the Debian nginx (deploy/nginx.conf) and
the Debian prometheus (deploy/prometheus.yml), all on loopback; docker-compose.yml validated by docker-compose."""

from __future__ import annotations

import concurrent.futures
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
from tests.serving import query, wait_for

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
    assert set(published) == {"balancer-gpu", "balancer-cpu", "prometheus", "grafana"}
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
    assert [str(port) for port in services["balancer-cpu"]["ports"]] == ["127.0.0.2:8080:8080/tcp"]
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
    for balancer, translator in (("balancer-gpu", "translator-gpu"), ("balancer-cpu", "translator-cpu")):
        assert services[balancer]["depends_on"][translator]["condition"] == "service_healthy"
    assert services["loadtest"]["profiles"] == ["loadtest"] and "balancer:8080" in services["loadtest"]["command"]
    assert any("deploy/grafana/provisioning" in str(volume) for volume in services["grafana"]["volumes"])
    # Prometheus gets the alert rules next to its config, where deploy/prometheus.yml's rule_files looks.
    assert any(str(volume).endswith("deploy/alerts.yml:/etc/prometheus/alerts.yml:ro") for volume in services["prometheus"]["volumes"])


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


def test_dockerfile_builds_cpu_and_gpu_targets_torch_free_and_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, flags=re.MULTILINE)
    assert {"cpu", "gpu"} <= set(stages)
    for stage in ("cpu", "gpu"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        installs = re.findall(r"pip install '\.\[([\w-]+)\]'", body)
        assert installs and all(extra.startswith("serve") for extra in installs), installs  # the torch-free extras
        assert re.search(r"^USER (?!root)\w+", body, flags=re.MULTILINE), f"{stage} runs as root"
        assert 'HEALTHCHECK' in body and '"nmt-health"' in body
    assert not re.search(r"\b(curl|wget)\b", text), "the image must not download binaries"
    # Every file the image copies exists in the repository.
    for source in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.MULTILINE):
        assert (ROOT / source).exists(), source
