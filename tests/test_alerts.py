"""deploy/alerts.yml: promtool checks the rules and runs their unit tests (deploy/alerts_test.yml); amtool checks
deploy/alertmanager.yml and routes every alert through it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from nmt_serve.server.models.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)")
# How the rules on `up` tell nmt-serve's targets from any other: a target label, not a job name (deploy/alerts.yml).
REPLICA_SELECTOR = 'up{app_kubernetes_io_name="nmt-serve"}'


def rules() -> list[dict]:
    config = yaml.safe_load((DEPLOY / "alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in config["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=DEPLOY, capture_output=True, text=True, timeout=60)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_unit_tests_pass() -> None:
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=DEPLOY, capture_output=True, text=True, timeout=60)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_for_severity_and_annotations() -> None:
    for rule in rules():
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text(encoding="utf-8"))["tests"]
    firing, quiet = set(), set()
    for case in tests:
        for expectation in case["alert_rule_test"]:
            (firing if expectation.get("exp_alerts") else quiet).add(expectation["alertname"])
    names = {rule["alert"] for rule in rules()}
    assert names == firing and names <= quiet, (names - firing, names - quiet)


def test_rules_use_only_exported_metrics_and_are_loaded() -> None:
    exported = Metrics().names()
    used = {name for rule in rules() for name in re.findall(r"\b(nmt_[a-z_]+)\b", rule["expr"])}
    assert used and used <= exported, sorted(used - exported)
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    assert config["rule_files"] == ["alerts.yml"]


def test_rules_select_replicas_by_the_label_prometheus_sets_not_by_job() -> None:
    """A job name differs between the compose Prometheus and a cluster's, so no rule names one; every `up` selector is
    the one label, which deploy/prometheus.yml sets on its job and Kubernetes' pod label gives."""
    for rule in rules():
        assert "job=" not in rule["expr"], rule["alert"]
        assert set(re.findall(r"\bup\{[^}]*\}", rule["expr"])) <= {REPLICA_SELECTOR}, rule["alert"]
    assert sum(REPLICA_SELECTOR in rule["expr"] for rule in rules()) == 3
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    label, value = re.fullmatch(r'up\{(\w+)="([^"]+)"\}', REPLICA_SELECTOR).groups()  # type: ignore[union-attr]
    assert {"target_label": label, "replacement": value} in job["relabel_configs"]
    # The same label from the pods' app.kubernetes.io/name, as Prometheus sanitises label names.
    pod_labels = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text(encoding="utf-8"))["spec"]["template"]["metadata"]["labels"]
    assert {re.sub(r"[^a-zA-Z0-9_]", "_", name): pod_value for name, pod_value in pod_labels.items()}[label] == value


@needs_amtool
def test_alertmanager_config_is_valid() -> None:
    result = subprocess.run([AMTOOL, "check-config", "alertmanager.yml"], cwd=DEPLOY, capture_output=True, text=True, timeout=60)  # type: ignore[list-item]
    assert result.returncode == 0, result.stdout + result.stderr


@needs_amtool
@pytest.mark.parametrize("alert", [rule["alert"] for rule in rules()])
def test_alertmanager_routes_every_alert_to_a_receiver(alert: str) -> None:
    labels = next(rule["labels"] for rule in rules() if rule["alert"] == alert)
    result = subprocess.run([AMTOOL, "config", "routes", "test", "--config.file=alertmanager.yml", f"alertname={alert}",
                             *(f"{name}={value}" for name, value in labels.items())], cwd=DEPLOY, capture_output=True, text=True, timeout=60)  # type: ignore[list-item]  # fmt: skip
    receivers = {receiver["name"] for receiver in yaml.safe_load((DEPLOY / "alertmanager.yml").read_text(encoding="utf-8"))["receivers"]}
    assert result.returncode == 0 and result.stdout.strip() in receivers, result.stdout + result.stderr
