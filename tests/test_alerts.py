"""deploy/alerts.yml: promtool checks the rules and runs their unit tests (deploy/alerts_test.yml)."""

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
