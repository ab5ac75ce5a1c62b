"""nmt-cache-report end to end on a tiny model and a small help tree: both servers measured, each row with the CPU its
server and the load client spent per call, and the report saying what else loaded the machine."""

from __future__ import annotations

import random
import re
from pathlib import Path

from nmt_serve.bench.cache_report import Contender, main
from nmt_serve.client.loadtest import Outcome, TextPicker

WORDS = ("Hund", "Katze", "Bahnhof", "Kaffee", "Zug", "Garten", "Tisch", "Buch")


def write_help_tree(root: Path, count: int) -> None:
    """One page per language whose paragraphs carry the same ids: `count` German sentences of three words or more."""
    german = "".join(f'<p id="par_id{number}">Ich sehe den {WORDS[number % len(WORDS)]} Nummer {number}.</p>' for number in range(count))
    english = "".join(f'<p id="par_id{number}">I see the thing number {number}.</p>' for number in range(count))
    for language, body in (("de", german), ("en-US", english)):
        page = root / language / "text" / "shared" / "page.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"<html><body>{body}</body></html>", encoding="utf-8")


def test_cache_report_measures_both_servers_with_their_cpu_per_call(tiny_model_dir: Path, tmp_path: Path) -> None:
    write_help_tree(tmp_path / "help", 40)
    out = tmp_path / "cache.md"
    assert main(["--model-dir", str(tiny_model_dir), "--help-root", str(tmp_path / "help"), "--rounds", "1", "--round-seconds", "1",
                 "--concurrency", "2", "--cached-concurrency", "2", "--texts-per-call", "1", "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text()
    header = next(line for line in report.splitlines() if line.startswith("| server |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns[9:11] == ["server CPU per call (ms)", "client CPU per call (ms)"]
    rows = [line for line in report.splitlines() if line.startswith(("| no cache", "| cache "))]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == len(columns) and re.fullmatch(r"\d+\.\d\d", cells[9]) and re.fullmatch(r"\d+\.\d\d", cells[10]), row
    assert re.search(r"The 1-minute load average was \d+\.\d\d on \d+ cores before this report started its servers", report)


def test_cache_report_row_divides_each_process_cpu_time_by_the_calls() -> None:
    """The CPU columns are the CPU seconds measured over the contender's rounds, per call, in milliseconds."""
    picker = TextPicker(["a", "b"], random.Random(0), 0.5)
    for _ in range(4):
        picker.pick()
    contender = Contender("cache 64 MiB", server=None, concurrency=2, texts_path=Path("texts"), picker=picker,  # type: ignore[arg-type]
                          outcomes=[Outcome("OK", 0.01, None, 3, 0.0)] * 200, seconds=2.0, rounds=[100.0],
                          server_cpu_s=0.5, client_cpu_s=0.1)  # fmt: skip
    cells = [cell.strip() for cell in contender.row().strip("|").split("|")]
    assert cells[:4] == ["cache 64 MiB", "2", "200", "100.0"]
    assert cells[9:] == ["2.50", "0.50", "100.0"]


def test_cache_report_sets_apart_a_row_whose_new_sentences_ran_out() -> None:
    """A row that repeated a larger share of its sentences than asked for (its slice of new texts used up) measured
    another workload: the verdict names it and does not count it."""
    from argparse import Namespace

    from nmt_serve.bench.cache_report import workload_section

    def contender(name: str, repeated: int, latency_s: float) -> Contender:
        picker = TextPicker(["a"], random.Random(0), 0.8)
        picker.picked, picker.repeated = 100, repeated
        return Contender(name, server=None, concurrency=16, texts_path=Path("texts"), picker=picker,  # type: ignore[arg-type]
                         outcomes=[Outcome("OK", latency_s, None, 3, 0.0)] * 100, seconds=1.0, rounds=[100.0])  # fmt: skip

    args = Namespace(repeat_fraction=0.8, rounds=1, round_seconds=1.0)
    fair = workload_section(args, 1, [contender("no cache", 80, 0.2), contender("cache 64 MiB", 81, 0.1)])
    assert "the cache served 1.0x" in fair and "Not comparable" not in fair
    strayed = workload_section(args, 1, [contender("no cache", 80, 0.2), contender("cache 64 MiB", 92, 0.1)])
    assert "No cached run kept its p99" in strayed and "Not comparable: cache 64 MiB at concurrency 16 repeated 92%" in strayed
