"""nmt-bench pieces on the tiny model: interleaved timing table, open-loop replay in both batching modes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nmt_serve.bench.balancer import NGINX
from nmt_serve.bench.engine_bench import format_table, time_cells
from nmt_serve.bench.open_loop import Arrival, Run, alone_latencies, drive, median_run, poisson_arrivals, run_open_loop, static_batch_end
from nmt_serve.bench.report import describe_gpu, write_report
from nmt_serve.bench.systems import Cell, EngineSystem, TorchSystem
from nmt_serve.model.search import SearchOptions
from nmt_serve.runtime.host import cpu_facts, describe_cpu
from nmt_serve.server.engine.sessions import host_work_description

SOURCES = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_bench_systems_generate_the_forced_length_and_fill_the_table(tiny_checkpoint: Path, tiny_model_dir: Path) -> None:
    systems = [TorchSystem(tiny_checkpoint, threads=1), EngineSystem(tiny_model_dir, threads=1, label="fp32")]
    cells = [Cell(batch=3, beam=1, length=5), Cell(batch=2, beam=4, length=5)]
    for system in systems:
        assert system.run(SOURCES, cells[0]) == 3 * 5
    results = time_cells(systems, SOURCES, cells, repeats=2)
    assert all(len(values) == 2 and min(values) > 0 for values in results.values())
    table = format_table("tiny", systems, cells, results)
    assert "| 3 | 1 |" in table and "x)" in table
    # The report says what the engine's host work ran on: compiled or numpy, flushing or not.
    assert f"The nmt-serve engine's host work: {host_work_description()}." in table.splitlines()
    assert "beam search's choice" in host_work_description() and "its calls" in host_work_description()


def test_bench_engine_system_with_two_engines_splits_the_batch(tiny_model_dir: Path) -> None:
    system = EngineSystem(tiny_model_dir, threads=1, label="fp32", engines=2)
    cell = Cell(batch=3, beam=4, length=5)
    assert system.run(SOURCES, cell) == 3 * 5
    assert all(engine.profile.steps >= 5 for engine in system.engines)  # both stepped (beam requests of 4 rows: 2 + 1)
    assert system.cell_profiles[cell].steps == sum(engine.profile.steps for engine in system.engines)


@pytest.mark.parametrize(("continuous", "padded"), [(True, False), (False, False), (False, True)])
def test_open_loop_replay_serves_every_arrival(tiny_model_dir: Path, continuous: bool, padded: bool) -> None:
    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    arrivals = poisson_arrivals(SOURCES, rate_per_s=200.0, duration_s=0.1, seed=1)
    run = drive(runtime, arrivals, continuous, padded=padded)
    assert run.served == len(arrivals) > 3
    assert run.tokens == sum(arrival.options.max_output_tokens for arrival in arrivals)  # padding is not counted


def test_open_loop_padded_static_batch_answers_together_after_its_longest(tiny_model_dir: Path) -> None:
    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    short, long = (SearchOptions(min_output_tokens=n, max_output_tokens=n) for n in (2, 40))
    arrivals = [Arrival(0.0, SOURCES[0], short), Arrival(0.0, SOURCES[1], long)]  # one batch
    rows_left = drive(runtime, arrivals, continuous=False)
    padded = drive(runtime, arrivals, continuous=False, padded=True)
    assert padded.tokens == rows_left.tokens == 42
    # Padded, the short request is answered with the long one (both arrived at 0): one latency, the batch's.
    assert padded.p50_s == padded.p99_s == padded.p99_short_s


def test_open_loop_padded_static_refuses_natural_lengths(tiny_model_dir: Path) -> None:
    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    with pytest.raises(ValueError, match="max_output_tokens"):
        drive(runtime, [Arrival(0.0, SOURCES[0], SearchOptions())], continuous=False, padded=True)


def test_static_batches_take_the_arrived_requests_up_to_the_row_cap() -> None:
    beam4, greedy = SearchOptions(beam_size=4), SearchOptions()
    arrivals = [Arrival(0.0, [5], beam4), Arrival(0.1, [5], beam4), Arrival(0.2, [5], greedy), Arrival(5.0, [5], greedy)]
    assert static_batch_end(arrivals, 0, now_s=1.0, max_rows=8) == 2  # 4 + 4 rows; the third would make 9
    assert static_batch_end(arrivals, 2, now_s=1.0, max_rows=8) == 3  # the fourth has not arrived
    assert static_batch_end(arrivals, 0, now_s=1.0, max_rows=2) == 1  # a first request always fits
    assert static_batch_end(arrivals, 3, now_s=1.0, max_rows=8) == 3  # nothing arrived: an empty batch


def test_open_loop_alone_latencies_time_each_request_by_itself(tiny_model_dir: Path) -> None:
    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    arrivals = poisson_arrivals(SOURCES, rate_per_s=200.0, duration_s=0.2, seed=2)
    latencies = alone_latencies(runtime, arrivals, count=5)
    assert len(latencies) == 5 and min(latencies) > 0


def test_open_loop_table_compares_every_mode_at_each_load(tiny_model_dir: Path) -> None:
    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    table = run_open_loop(runtime, SOURCES, duration_s=0.1, loads=(0.5,), row_caps=(4,), alone_count=3, repeats=2)
    rows = [[cell.strip() for cell in line.split("|")] for line in table.splitlines() if line.startswith("| 50% |")]
    assert [row[3] for row in rows] == ["continuous, max 4 rows", "continuous, max 256 rows", "continuous as served: max 32 rows, joins grouped (4 steps)",
                                        "static, max 256 rows", "padded static, max 256 rows", "each request alone (the floor)"]  # fmt: skip
    # p99 against static and against padded static: every row but the base's own carries the ratio.
    assert [(row[8].endswith("x"), row[9].endswith("x")) for row in rows] == [(True, True)] * 3 + [(False, True), (True, False), (True, True)]


def test_open_loop_median_run_takes_each_field_median() -> None:
    runs = [Run(10, 100, 5.0, 50.0, 0.1, 0.9, 0.3, 0.5), Run(12, 90, 4.0, 60.0, 0.3, 0.2, 0.1, 0.7), Run(11, 95, 6.0, 40.0, 0.2, 0.4, 0.2, 0.6)]
    assert median_run(runs) == Run(11, 95, 5.0, 50.0, 0.2, 0.4, 0.2, 0.6)


def test_bench_ctranslate2_system_generates_the_forced_length(tiny_checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    from nmt_serve.bench.ct2_convert import convert_checkpoint
    from nmt_serve.bench.systems import CTranslate2System
    from nmt_serve.model.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(tiny_checkpoint).tokenizer
    tokens = tokenizer.token_strings()
    ct2_dir = convert_checkpoint(tiny_checkpoint, tmp_path / "ct2", "int8")
    for workers in (1, 2):  # two: the batch is split between CTranslate2's two inter-op workers
        system = CTranslate2System(ct2_dir, tokens, threads=1, label="int8", workers=workers)
        assert system.run(SOURCES, Cell(batch=3, beam=4, length=6)) == 3 * 6


def test_bench_profile_shares_cover_the_step_time(tiny_model_dir: Path) -> None:
    from nmt_serve.bench.engine_bench import format_profiles

    system = EngineSystem(tiny_model_dir, threads=1, label="fp32")
    system.run(SOURCES, Cell(batch=3, beam=2, length=4))
    shares = system.engine.profile.shares()
    assert system.engine.profile.steps >= 4
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["decoder run"] > 0 and shares["encoder run"] > 0
    assert shares["cache moves (beam reorders, rows leaving)"] > 0  # beam 2 reorders its rows
    table = format_profiles("tiny", [system])
    assert "| 3 | 2 | nmt-serve fp32 |" in table  # one row per cell and system
    row = next(line for line in table.splitlines() if line.startswith("| 3 | 2 |"))
    *shares, host, copied = [float(value.strip().rstrip("%")) for value in row.split("|")[5:-1]]
    assert sum(shares) == pytest.approx(100, abs=3) and host == pytest.approx(sum(shares[2:]), abs=2)  # host = search + moves + bookkeeping
    profile = system.engine.profile
    assert copied == pytest.approx(profile.slots_copied / profile.steps, abs=0.06) and copied > 0  # printed to 0.1


def test_load_report_runs_every_section_on_real_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.bench.load_report import main as load_report_main
    from nmt_serve.client.loadtest import SAMPLE_TEXTS

    model = tmp_path / "model"
    model.mkdir()
    for precision in ("fp32", "int8"):  # the tiny model has one dir; it stands in for both
        (model / f"onnx-{precision}").symlink_to(tiny_model_dir)
    out = tmp_path / "load.md"
    assert load_report_main(["--model", str(model), "--concurrency", "1,2", "--point-seconds", "0.5", "--overload-seconds", "0.5",
                             "--soak-seconds", "0.5", "--sigterm-after", "0.5", "--engines", "2", "--threads", "1", "--texts", str(SAMPLE_TEXTS),
                             "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text()
    for title in ("Throughput and latency over concurrency", "Overload", "SIGTERM under load", "Soak"):
        assert title in report
    sigterm_row = report.split("SIGTERM under load")[1].splitlines()[4].split("|")
    assert sigterm_row[4].strip() == "0" and sigterm_row[7].strip() == "0"  # nothing lost, exit code 0


def test_load_report_times_the_precisions_asked_for_and_skips_sections_set_to_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.bench.load_report import main as load_report_main
    from nmt_serve.client.loadtest import SAMPLE_TEXTS

    model = tmp_path / "model"
    model.mkdir()
    (model / "onnx-fp16").symlink_to(tiny_model_dir)  # the tiny fp32 dir stands in for it
    out = tmp_path / "load.md"
    assert load_report_main(["--model", str(model), "--precisions", "fp16", "--concurrency", "1", "--point-seconds", "0.3", "--overload-seconds", "0",
                             "--soak-seconds", "0", "--sigterm-after", "0", "--texts", str(SAMPLE_TEXTS), "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text()
    assert "| fp16 | 1 |" in report and "| fp32 |" not in report
    assert not any(title in report for title in ("Overload", "SIGTERM under load", "Soak"))


def test_burst_report_compares_refusals_with_the_bare_grpcio_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.bench.burst_report import main as burst_report_main
    from nmt_serve.client.loadtest import SAMPLE_TEXTS

    out = tmp_path / "burst.md"
    assert burst_report_main(["--model", str(tiny_model_dir), "--burst", "60", "--rounds", "1", "--max-queued-requests", "8", "--pause", "0.1",
                              "--closed-seconds", "0.5", "--closed-concurrency", "2", "--texts", str(SAMPLE_TEXTS), "--out", str(out)]) == 0  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ") and not line.startswith("| server")]
    assert [row[0].split(":")[0].split(",")[0].strip() for row in rows] == ["grpcio alone", "nmt-serve", "nmt-serve", "nmt-serve"]
    assert rows[0][4].strip() == "1.00x" and "--burst-hold-share 0.25" in rows[2][0] and "--burst-hold-share 0" in rows[3][0]
    counts = [[int(value) for value in part.strip().split("-")] for row in rows for part in row[6].split("/")]
    ok_counts, refused_counts = counts[0::2], counts[1::2]  # each a (min, max) over the bursts
    # The floor and the token server refuse every call by construction; how many of the 60 a model server refuses depends
    # on how fast this CPU clears its queue of 8, so there only the sum is checked: every call ended OK or refused.
    assert ok_counts[:2] == [[0, 0], [0, 0]] and refused_counts[:2] == [[60, 60], [60, 60]]
    for (ok, _), (refused, _) in zip(ok_counts[2:], refused_counts[2:], strict=True):
        assert ok >= 1 and ok + refused == 60, rows  # the first call always finds a place; one burst per server, so min = max
    assert all(row[7].strip() == "0" for row in rows), rows  # no other code anywhere
    assert [row[8].strip() for row in rows[:2]] == ["-", "-"]  # no closed loop on the servers without a model at work
    for row in rows[2:]:
        assert float(row[8]) > 0, row  # the model servers had a closed-loop throughput


def test_workers_report_has_a_row_per_load_and_configuration(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.bench.workers_report import main as workers_report_main
    from nmt_serve.client.loadtest import SAMPLE_TEXTS

    out = tmp_path / "workers.md"
    assert workers_report_main(["--model-dir", str(tiny_model_dir), "--configs", "1x1,2x1", "--loads", "1:2,2:2", "--rounds", "1",
                                "--seconds", "0.5", "--texts", str(SAMPLE_TEXTS), "--out", str(out)]) == 0  # fmt: skip
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith(("| greedy", "| beam"))]
    assert [(row[1].strip(), row[2].strip()) for row in rows] == [
        ("greedy, concurrency 2", "1 engine(s) x 1 thread(s)"), ("greedy, concurrency 2", "2 engine(s) x 1 thread(s)"),
        ("beam 2, concurrency 2", "1 engine(s) x 1 thread(s)"), ("beam 2, concurrency 2", "2 engine(s) x 1 thread(s)")]  # fmt: skip
    assert all(float(row[3]) > 0 for row in rows) and rows[0][4].strip() == "1.00x"


@pytest.mark.skipif(NGINX is None, reason="nginx not installed (apt-get install nginx; .ci/run does)")
def test_workers_report_runs_replicas_behind_nginx(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nmt_serve.bench.workers_report import main as workers_report_main
    from nmt_serve.client.loadtest import SAMPLE_TEXTS

    out = tmp_path / "workers.md"
    assert workers_report_main(["--model-dir", str(tiny_model_dir), "--configs", "1x1,2x1x1", "--loads", "1:4", "--rounds", "1",
                                "--seconds", "0.5", "--texts", str(SAMPLE_TEXTS), "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text()
    assert "closed loop behind the deploy's nginx" in report  # both configurations pay the same proxy
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| greedy")]
    assert [row[2].strip() for row in rows] == ["1 engine(s) x 1 thread(s)", "2 replicas x 1 engine(s) x 1 thread(s)"]
    assert all(float(row[3]) > 0 for row in rows)


def test_workers_report_reads_replicas_engines_and_threads() -> None:
    from nmt_serve.bench.workers_report import Config, parse_configs

    assert parse_configs("1x2,3x2x1") == [Config(engines=1, threads=2), Config(engines=2, threads=1, replicas=3)]


@pytest.mark.parametrize(("flag", "value", "message"), [("--configs", "2x0", "ENGINESxTHREADS"), ("--configs", "0x1x1", "REPLICAS"),
                                                        ("--configs", "2x1x0", "ENGINESxTHREADS"), ("--loads", "4", "BEAM:CONCURRENCY")])  # fmt: skip
def test_workers_report_refuses_bad_lists(flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from nmt_serve.bench.workers_report import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, value])
    assert message in capsys.readouterr().err


def test_join_policy_table_has_a_row_per_wait_and_one_for_static(tiny_model_dir: Path) -> None:
    from nmt_serve.bench.join_policy import compare_waits

    runtime = EngineSystem(tiny_model_dir, threads=1, label="fp32").runtime
    table = compare_waits(runtime, SOURCES, rates=[200.0], waits=[0, 3], seconds=0.1, replays=1)
    rows = [line for line in table.splitlines() if line.startswith("| 200 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["continuous, joins wait up to 0 steps", "continuous, joins wait up to 3 steps", "static"]
    assert all(float(row.split("|")[3]) > 0 for row in rows)  # engine time per request was measured


def test_report_names_the_command_commit_and_cpu(tmp_path: Path) -> None:
    text = write_report("Title", "nmt-x", ["--flag", "a b"], ["section one", "section two"], tmp_path / "out.md")
    first = text.splitlines()[2]
    assert first.startswith("Produced by `nmt-x --flag 'a b'` on ") and f"on {describe_cpu(cpu_facts())}{describe_gpu()}." in first
    assert re.search(r"at commit ([0-9a-f]{7,}(\+changes)?|unknown),", first)
    assert text.endswith("section one\n\nsection two\n") and (tmp_path / "out.md").read_text(encoding="utf-8") == text
