"""A real Prometheus (the Debian binary) scrapes a real server through deploy/prometheus.yml, targets on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from nmt_serve.bench.balancer import free_port
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, query, server_settings, wait_for
from tests.test_alerts import REPLICA_SELECTOR

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed (apt-get install prometheus; .ci/run does)")


@pytest.fixture()
def prometheus_on(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[RunningServer, int]]:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
        config["global"]["scrape_interval"] = "1s"  # the shipped 5 s, shortened so the test is quick
        config["rule_files"] = [str(ROOT / "deploy" / rule_file) for rule_file in config["rule_files"]]  # relative to the shipped file
        for job in config["scrape_configs"]:
            # The compose file finds replicas through Docker's DNS; here the one replica is on loopback.
            job.pop("dns_sd_configs")
            job["static_configs"] = [{"targets": [f"127.0.0.1:{server.server.metrics_port}"]}]
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        process = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            ready = wait_for(lambda: _ready(port), 30)
            assert ready, (tmp_path / "prometheus.log").read_text()
            yield server, port
        finally:
            process.terminate()
            process.wait(10)
            log.close()


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
    except OSError:
        return False


def test_prometheus_scrapes_request_counts_the_client_saw(prometheus_on: tuple[RunningServer, int]) -> None:
    server, port = prometheus_on
    sent = {"OK": 0, "INVALID_ARGUMENT": 0}
    channel, stub = server.stub()
    with channel:
        for index in range(9):
            try:
                texts = ["Ich sehe den Hund."] if index % 3 else []
                stub.Translate(pb.TranslateRequest(texts=texts), timeout=30)
                sent["OK"] += 1
            except grpc.RpcError as error:
                sent[error.code().name] += 1
    assert sent == {"OK": 6, "INVALID_ARGUMENT": 3}

    def counts() -> dict[str, float] | None:
        by_code = 'sum by (code) (nmt_requests_total{job="nmt",method="Translate"})'
        found = {item["metric"]["code"]: float(item["value"][1]) for item in query(port, by_code)}
        return found if found == sent else None

    assert wait_for(counts) == sent, query(port, "nmt_requests_total")
    assert [float(item["value"][1]) for item in query(port, 'up{job="nmt"}')] == [1.0]
    # The histograms answer quantile queries, and the model is labelled.
    assert query(port, 'histogram_quantile(0.99, sum by (le) (nmt_request_duration_seconds_bucket{method="Translate"}))')
    info = query(port, "nmt_model_info")
    assert info and info[0]["metric"]["precision"] == "fp32"


def test_prometheus_loads_the_alert_rules(prometheus_on: tuple[RunningServer, int]) -> None:
    """deploy/alerts.yml loads, and with one healthy replica scraped, no replica alert fires."""
    _, port = prometheus_on
    shipped = {rule["alert"] for group in yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text(encoding="utf-8"))["groups"]
               for rule in group["rules"]}  # fmt: skip

    def loaded() -> dict[str, str] | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as response:
            groups = json.load(response)["data"]["groups"]
        states = {rule["name"]: rule["state"] for group in groups for rule in group["rules"] if rule["type"] == "alerting"}
        evaluated = all(rule.get("lastEvaluation", "").startswith("20") for group in groups for rule in group["rules"])
        return states if set(states) == shipped and evaluated else None

    assert wait_for(loaded, 30), "alert rules not loaded"
    # The shipped job gives its target the label the replica rules select (tests/test_alerts.py REPLICA_SELECTOR).
    assert wait_for(lambda: query(port, f"{REPLICA_SELECTOR} == 1"), 30)
    quiet = ("NmtReplicaDown", "NmtNoReplicaUp", "NmtReplicaNotReady", "NmtSelfCheckBeyondBound")
    # NmtNoReplicaUp is pending from an evaluation before the first scrape until the next one after it.
    assert wait_for(lambda: (states := loaded()) and {states[name] for name in quiet} == {"inactive"}, 30), loaded()
