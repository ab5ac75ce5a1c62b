"""Writes deploy/k8s/monitoring/prometheusrule.yaml: deploy/alerts.yml's rule groups as a Prometheus Operator PrometheusRule.

    python3 scripts/prometheus_rule.py           # rewrite the file (make k8s-rules)
    python3 scripts/prometheus_rule.py --check   # exit 1 when the file is not what deploy/alerts.yml gives

One source for the rules: tests/test_k8s.py runs --check, so the PrometheusRule cannot drift from the rules that
promtool tests (deploy/alerts_test.yml). Needs PyYAML.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "alerts.yml"
TARGET = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
HEADER = ("# Generated from deploy/alerts.yml by scripts/prometheus_rule.py (make k8s-rules): edit the rules there, where promtool\n"
          "# tests them (deploy/alerts_test.yml), and regenerate. The rules on `up` select app_kubernetes_io_name=\"nmt-serve\",\n"
          "# which podmonitor.yaml's podTargetLabels gives every target.\n")


class RuleDumper(yaml.SafeDumper):
    """Multi-line strings (the longer expressions) as literal blocks, as deploy/alerts.yml writes them."""


RuleDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def prometheus_rule() -> str:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "nmt-serve", "labels": {"app.kubernetes.io/name": "nmt-serve"}}, "spec": {"groups": groups}}
    return HEADER + yaml.dump(rule, Dumper=RuleDumper, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str]) -> int:
    text = prometheus_rule()
    if argv == ["--check"]:
        if TARGET.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{TARGET.relative_to(ROOT)} differs from what deploy/alerts.yml gives: run python3 scripts/prometheus_rule.py\n")
            return 1
        return 0
    if argv:
        sys.stderr.write("usage: prometheus_rule.py [--check]\n")
        return 2
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
