"""Metrics of a real server scraped over HTTP; the dashboard and the Prometheus config use only what it exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.models.metrics import LATENCY_SLO_SECONDS, REQUEST_BUCKETS, Metrics
from nmt_serve.server.settings import ServerSettings
from tests.serving import RunningServer, Samples, first_message, held_engines, scrape_until, server_settings, total

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "nmt-serve.json"


@pytest.fixture(scope="module")
def metered(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=64)) as server:
        yield server


def test_metrics_count_what_the_client_saw(metered: RunningServer) -> None:
    channel, stub = metered.stub()
    with channel:
        for _ in range(3):
            stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund.", "Wir mag Kaffee."]), timeout=30)
        list(stub.TranslateStream(pb.TranslateStreamRequest(text="Ich sehe den Hund."), timeout=30))
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                stub.Translate(pb.TranslateRequest(), timeout=30)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    manifest = metered.server.runtime.manifest

    def settled(found: Samples) -> bool:
        # The step that finishes a request is counted when the step ends, a moment after its answer left.
        generated, output = total(found, "nmt_generated_tokens_total"), total(found, "nmt_output_tokens_sum")
        return total(found, "nmt_requests_total", method="Translate", code="INVALID_ARGUMENT") == 2 and generated >= output

    samples = scrape_until(metered.server.metrics_port, settled)

    def value(name: str, **labels: str) -> float:
        """Every call here named the served model (by leaving the field empty), so each sample carries its name."""
        return samples.get((name, tuple(sorted({"model": manifest.model_name, **labels}.items()))), 0.0)

    assert value("nmt_requests_total", transport="grpc", method="Translate", code="OK") == 3
    assert value("nmt_requests_total", transport="grpc", method="Translate", code="INVALID_ARGUMENT") == 2
    assert value("nmt_requests_total", transport="grpc", method="TranslateStream", code="OK") == 1
    assert value("nmt_requests_total", transport="grpc", method="GetModelInfo", code="OK") == 1
    assert value("nmt_request_duration_seconds_count", transport="grpc", method="Translate") == 5
    # Seven texts reached the engine: 3 x 2 unary + 1 streamed.
    assert value("nmt_input_tokens_count") == value("nmt_output_tokens_count") == value("nmt_queue_wait_seconds_count") == 7
    assert value("nmt_time_to_first_token_seconds_count") == 7
    steps = value("nmt_decode_step_duration_seconds_count")
    assert steps > 0 and value("nmt_batch_rows_count") == steps and value("nmt_generated_tokens_total") >= value("nmt_output_tokens_sum")
    assert 0 <= value("nmt_padding_ratio_sum") <= steps
    assert value("nmt_queue_depth") == 0 and value("nmt_active_requests") == 0
    info = {"version": manifest.model_version, "precision": "fp32", "provider": "CPUExecutionProvider"}
    assert value("nmt_model_info", **info) == 1
    assert total(samples, "process_resident_memory_bytes") > 0  # process metrics come with the server's registry


def test_rejections_are_counted_by_reason(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=1, max_rows=1)) as server:
        channel, stub = server.stub()
        long = pb.TranslateStreamRequest(text="Ich sehe den Hund.", options=pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90))
        with channel, held_engines(server) as gate:  # a few steps only: the holder keeps its place however fast the CPU
            holder = stub.TranslateStream(long, timeout=30)
            first_message(holder, gate)  # decoding: the queue's only place is taken
            with pytest.raises(grpc.RpcError) as caught:
                stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=30)
            holder.cancel()
        exhausted = {"code": "RESOURCE_EXHAUSTED", "method": "Translate"}
        samples = scrape_until(server.server.metrics_port, lambda found: total(found, "nmt_requests_total", **exhausted) > 0)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert total(samples, "nmt_rejected_total", reason="queue_full") >= 1
    assert total(samples, "nmt_requests_total", **exhausted) == 1


def test_metrics_count_a_cancelled_stream_as_cancelled(metered: RunningServer) -> None:
    def count(samples: Samples, code: str) -> float:
        return total(samples, "nmt_requests_total", code=code, method="TranslateStream")

    port = metered.server.metrics_port
    before = scrape_until(port, lambda found: True)
    long = pb.TranslateStreamRequest(text="Ich sehe den Hund.", options=pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90))
    with held_engines(metered) as gate:  # a few steps at a time: neither stream can finish its 90 before it is cancelled
        cancelled_channel, stub = metered.stub()
        call = stub.TranslateStream(long, timeout=30)
        first_message(call, gate)  # decoding has started
        call.cancel()
        killed_channel, stub = metered.stub()  # a client that goes away mid-stream: its connection closes
        call = stub.TranslateStream(long, timeout=30)
        first_message(call, gate)
        killed_channel.close()
        cancelled_channel.close()
    samples = scrape_until(port, lambda found: count(found, "CANCELLED") >= count(before, "CANCELLED") + 2)
    assert count(samples, "CANCELLED") == count(before, "CANCELLED") + 2
    assert count(samples, "OK") == count(before, "OK")


def test_metrics_count_unauthenticated_calls(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, auth_token="s3cret")) as server:
        channel, stub = server.stub()
        with channel:
            with pytest.raises(grpc.RpcError, match="bearer token"):
                stub.Translate(pb.TranslateRequest(texts=["Hund"]), timeout=10)
            with pytest.raises(grpc.RpcError, match="bearer token"):
                list(stub.TranslateStream(pb.TranslateStreamRequest(text="Hund"), timeout=10))
        # Refused before the message (and its model field) was read: counted under no model.
        keys = [("nmt_requests_total", (("code", "UNAUTHENTICATED"), ("method", method), ("model", ""), ("transport", "grpc"))) for method in ("Translate", "TranslateStream")]
        samples = scrape_until(server.server.metrics_port, lambda found: all(key in found for key in keys))
    assert [samples.get(key) for key in keys] == [1, 1]
    assert samples[("nmt_request_duration_seconds_count", (("method", "Translate"), ("model", ""), ("transport", "grpc")))] == 1


def test_latency_buckets_include_the_documented_slo() -> None:
    assert LATENCY_SLO_SECONDS in REQUEST_BUCKETS


def test_dashboard_uses_only_exported_metric_names() -> None:
    exported = Metrics().names()
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"\b(nmt_[a-z_]+)\b", expr)}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    # Every metric the server defines is on the dashboard.
    families = {name.removesuffix(suffix) for name in used for suffix in ("_bucket", "_sum", "_count", "_total", "_info") if name.endswith(suffix)} | used
    for metric in ("nmt_requests", "nmt_request_duration_seconds", "nmt_time_to_first_token_seconds", "nmt_queue_wait_seconds",
                   "nmt_queue_depth", "nmt_batch_rows", "nmt_decode_step_duration_seconds", "nmt_generated_tokens", "nmt_padding_ratio",
                   "nmt_rejected"):  # fmt: skip
        assert metric in families, metric


def test_prometheus_config_scrapes_the_default_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    ports = [sd["port"] for job in config["scrape_configs"] for sd in job["dns_sd_configs"]]
    assert ports == [ServerSettings().metrics_port]


def test_dashboard_filters_by_instance_and_splits_latency_by_method() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert "instance" in variables and variables["instance"]["includeAll"]
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    # Every selector of a server metric is narrowed to the chosen replicas.
    selectors = re.findall(r"\bnmt_[a-z_]+(\{[^}]*\})?", expressions and "\n".join(expressions))
    assert selectors and all('instance=~"$instance"' in selector for selector in selectors), selectors
    latency = [expr for expr in expressions if "nmt_request_duration_seconds_bucket" in expr and "histogram_quantile" in expr]
    assert latency and all("by (method, le)" in expr for expr in latency), latency
