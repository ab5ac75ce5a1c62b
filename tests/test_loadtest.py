"""nmt-loadtest and nmt-health against a real server on loopback."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from nmt_serve.bench.balancer import free_port
from nmt_serve.client.health import main as health_main
from nmt_serve.client.loadtest import SAMPLE_TEXTS, TextPicker, load_texts
from nmt_serve.client.loadtest import main as loadtest_main
from tests.serving import RunningServer, server_settings


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=4)) as server:
        yield server


def test_closed_loop_counts_every_call_and_reads_server_deltas(target: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = loadtest_main(["--target", target.target, "--concurrency", "3", "--requests", "30", "--json", str(out), "--texts", str(SAMPLE_TEXTS),
                          "--metrics-url", f"http://127.0.0.1:{target.server.metrics_port}/metrics", "--wait-ready", "10"])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0 and report["requests"] == 30 and report["codes"] == {"OK": 30}
    assert report["latency_s"]["p50"] <= report["latency_s"]["p99"] <= report["latency_s"]["max"]
    assert report["server"]["nmt_batch_rows"] >= 1 and "nmt_queue_wait_seconds" in report["server"]


def test_open_loop_overload_counts_rejections_apart_from_errors(target: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    # 400 calls in about 0.1 s against a queue of 4: most are refused, none is an error.
    code = loadtest_main(["--target", target.target, "--rate", "4000", "--requests", "400", "--json", str(out), "--texts", str(SAMPLE_TEXTS)])
    report = json.loads(out.read_text())
    assert code == 0 and report["errors"] == 0 and report["rejected"] > 0
    assert report["codes"]["OK"] + report["rejected"] == 400


def test_burst_reports_refused_and_admitted_latency_apart(target: RunningServer, tmp_path: Path) -> None:
    out, markdown = tmp_path / "report.json", tmp_path / "report.md"
    # 60 calls at once against a queue of 4: most are refused, the rest answered.
    code = loadtest_main(["--target", target.target, "--burst", "60", "--json", str(out), "--markdown", str(markdown), "--texts", str(SAMPLE_TEXTS)])
    report = json.loads(out.read_text())
    assert code == 0 and report["mode"] == "burst of 60 calls at once" and report["errors"] == 0
    assert report["codes"]["OK"] + report["rejected"] == 60 and report["rejected"] > 0
    assert report["rejection_latency_s"]["p50"] <= report["rejection_latency_s"]["p99"] and report["latency_s"]["p99"] > 0
    assert "Refused (RESOURCE_EXHAUSTED) after: p50" in markdown.read_text()


def test_streaming_reports_time_to_first_token(target: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    assert loadtest_main(["--target", target.target, "--stream", "--requests", "10", "--markdown", str(out), "--texts", str(SAMPLE_TEXTS)]) == 0
    assert "Time to first token" in out.read_text() and "| 10 |" in out.read_text()


def test_repeat_fraction_reports_the_share_of_calls_that_repeated_a_text(target: RunningServer, tmp_path: Path) -> None:
    out, markdown = tmp_path / "report.json", tmp_path / "report.md"
    code = loadtest_main(["--target", target.target, "--concurrency", "2", "--requests", "40", "--repeat-fraction", "0.8", "--texts-per-call", "2", "--json", str(out),
                          "--markdown", str(markdown), "--texts", str(SAMPLE_TEXTS)])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0 and report["codes"] == {"OK": 40} and report["picked"] == 80 and 40 <= report["repeated"] <= 79
    assert f"Repeated texts: {report['repeated']} of the 80 texts sent" in markdown.read_text()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.8, 1.0])
def test_text_picker_repeats_only_texts_already_sent_and_sends_new_ones_in_order(fraction: float) -> None:
    texts = [f"Satz {number}." for number in range(50)]
    picker = TextPicker(texts, random.Random(3), fraction)
    seen: list[str] = []
    repeats = 0
    for _ in range(40):
        text = picker.pick()
        if text in seen:
            repeats += 1
        else:
            assert text == texts[len(seen)]
            seen.append(text)
    assert picker.repeated == repeats and picker.sent == seen
    assert repeats == {0.0: 0, 1.0: 39}.get(fraction, repeats) and (0 < repeats < 39 or fraction in (0.0, 1.0))


def test_text_picker_repeats_once_every_text_was_sent() -> None:
    picker = TextPicker(["a", "b"], random.Random(0), 0.0)
    assert [picker.pick() for _ in range(2)] == ["a", "b"] and {picker.pick() for _ in range(5)} <= {"a", "b"} and picker.repeated == 5


def test_repeat_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(SystemExit, match="--repeat-fraction must be between 0 and 1, got 1.5"):
        loadtest_main(["--repeat-fraction", "1.5", "--requests", "1"])


def test_texts_from_a_tsv_use_its_first_column(tmp_path: Path) -> None:
    tsv = tmp_path / "test.tsv"
    tsv.write_text("Hund\tdog\n\nKatze\tcat\n", encoding="utf-8")
    assert load_texts(tsv) == ["Hund", "Katze"]


def test_health_command(target: RunningServer) -> None:
    assert health_main(["--target", target.target]) == 0
    assert health_main(["--target", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
