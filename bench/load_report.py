"""nmt-load-report: the measured figures of bench/results/load.md, each from real nmt-serve processes and nmt-loadtest.

1. Throughput and latency over closed-loop concurrency, fp32 and int8.
2. Overload: open-loop arrivals at 2x the measured capacity (rejection latency, RSS before/after).
3. SIGTERM under load: calls admitted before the signal that did not end OK (target 0), exit code.
4. Soak: steady load for a long run, RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.bench.report import write_report
from nmt_serve.client.loadtest import LoadTest, Report, load_texts
from nmt_serve.client.loadtest import build_parser as loadtest_parser

logger = logging.getLogger("nmt-load-report")
ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """One server process on free loopback ports: `python -m nmt_serve.server.main MODEL_DIR`, or another server
    `module` that takes --port and --port-file (no model dir)."""

    def __init__(self, model_dir: Path | None, work: Path, *flags: str, module: str = "nmt_serve.server.main") -> None:
        # A benchmark's texts repeat, and the translation cache would answer them without the model: servers measure
        # the model's work unless the benchmark sets --cache-mb itself (nmt-cache-report).
        cache = ["--cache-mb", "0"] if model_dir is not None and "--cache-mb" not in flags else []
        arguments = ["-m", module, *([str(model_dir), "--metrics-port", "-1", *cache] if model_dir is not None else []), *flags]
        port_file = work / f"port-{time.monotonic_ns()}"
        self.log = work / f"{port_file.name}.log"
        self.process = subprocess.Popen([sys.executable, *arguments, "--port", "0", "--port-file", str(port_file)],
                                        cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{module} did not start: {self.log.read_text()}")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{port_file.read_text()}"

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        """User plus system CPU time the server process has used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (proc(5)), in clock ticks

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


def load(target: str, texts_path: Path | None, *flags: str) -> LoadTest:
    args = loadtest_parser().parse_args(["--target", target, "--progress-every", "10", *(["--texts", str(texts_path)] if texts_path else []),
                                         *flags])  # fmt: skip
    return LoadTest(args, load_texts(args.texts))


def curve(model_dirs: dict[str, Path], concurrencies: list[int], seconds: float, flags: tuple[str, ...], texts: Path | None,
          work: Path) -> tuple[str, float]:  # fmt: skip
    lines = [f"### Throughput and latency over concurrency (closed loop, {seconds:g} s per point, server flags `{' '.join(flags)}`)", "",
             "| precision | concurrency | requests/s | tokens/s | p50 (s) | p90 (s) | p99 (s) | errors |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    capacity = 0.0
    for precision, model_dir in model_dirs.items():
        process = ServerProcess(model_dir, work, *flags, "--max-queued-requests", str(4 * max(concurrencies)))
        try:
            for concurrency in concurrencies:
                report = asyncio.run(load(process.target, texts, "--concurrency", str(concurrency), "--duration", str(seconds)).run())
                lat = report.latency_s
                lines.append(f"| {precision} | {concurrency} | {report.requests_per_s:.1f} | {report.tokens_per_s:.0f} | {lat['p50']:.3f} "
                             f"| {lat['p90']:.3f} | {lat['p99']:.3f} | {report.errors} |")  # fmt: skip
                if precision == list(model_dirs)[-1]:  # the precision the later sections load
                    capacity = max(capacity, report.requests_per_s)
                logger.info("%s concurrency %d: %.1f requests/s", precision, concurrency, report.requests_per_s)
        finally:
            process.stop()
    return "\n".join(lines), capacity


def overload(model_dir: Path, capacity: float, seconds: float, flags: tuple[str, ...], texts: Path | None, work: Path) -> str:
    server = ServerProcess(model_dir, work, *flags, "--max-queued-requests", "64")
    try:
        before = server.rss_mb()
        rate = 2 * capacity
        report = asyncio.run(load(server.target, texts, "--rate", f"{rate:.1f}", "--duration", str(seconds)).run())
        after = server.rss_mb()
    finally:
        code = server.stop()
    rejected = report.rejection_latency_s
    return "\n".join([
        f"### Overload: open loop at 2x capacity ({rate:.0f} requests/s offered, {seconds:g} s, int8, queue limit 64)", "",
        "| served requests/s | p99 admitted latency (s) | rejected | rejection latency p50 / p99 (s) | other errors | RSS before / after (MB) | exit code |",
        "|---|---|---|---|---|---|---|",
        f"| {report.requests_per_s:.1f} | {report.latency_s.get('p99', float('nan')):.3f} | {report.rejected} "
        f"| {rejected.get('p50', float('nan')):.4f} / {rejected.get('p99', float('nan')):.4f} | {report.errors} | {before:.0f} / {after:.0f} | {code} |",
    ])  # fmt: skip


def sigterm_under_load(model_dir: Path, flags: tuple[str, ...], texts: Path | None, work: Path, concurrency: int = 32, after_s: float = 5.0,
                       backoff_s: float = 0.05) -> str:  # fmt: skip
    server = ServerProcess(model_dir, work, *flags, "--grace-s", "20")
    test = load(server.target, texts, "--concurrency", str(concurrency), "--duration", str(after_s + 3), "--backoff", str(backoff_s))
    times: dict[str, float] = {}

    async def run() -> Report:
        async def send_sigterm() -> None:
            await asyncio.sleep(after_s)
            times["signal"] = time.perf_counter()
            server.process.send_signal(signal.SIGTERM)
            while server.process.poll() is None:
                await asyncio.sleep(0.01)
            times["exit"] = time.perf_counter()

        report, _ = await asyncio.gather(test.run(), send_sigterm())
        return report

    asyncio.run(run())
    code = server.process.wait(60)
    before = [outcome for outcome in test.outcomes if outcome.started_at < times["signal"]]
    # UNAVAILABLE is the draining server refusing a call that had not been admitted (retryable);
    # anything else that is not OK would be an admitted call lost.
    refused = [outcome for outcome in before if outcome.code == "UNAVAILABLE"]
    lost = [outcome for outcome in before if outcome.code not in ("OK", "UNAVAILABLE")]
    later = [outcome for outcome in test.outcomes if outcome.started_at >= times["signal"]]
    later_codes = [f"{code} {count}" for code, count in sorted(Counter(outcome.code for outcome in later).items())]
    return "\n".join([
        f"### SIGTERM under load (closed loop, concurrency {concurrency}, back-off {backoff_s:g} s, signal after {after_s:g} s, int8, grace 20 s)", "",
        "| calls sent before SIGTERM | OK | refused while draining (UNAVAILABLE) | lost (any other code) | calls after SIGTERM | their codes "
        "| exit code | signal to exit (s) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {len(before)} | {len(before) - len(refused) - len(lost)} | {len(refused)} | {len(lost)} | {len(later)} | {', '.join(later_codes) or '-'} "
        f"| {code} | {times['exit'] - times['signal']:.2f} |",
    ])  # fmt: skip


def soak(model_dir: Path, seconds: float, flags: tuple[str, ...], texts: Path | None, work: Path, concurrency: int = 8) -> str:
    server = ServerProcess(model_dir, work, *flags)
    try:
        asyncio.run(load(server.target, texts, "--concurrency", str(concurrency), "--duration", "10").run())  # warm: pools and caches
        before = server.rss_mb()
        report = asyncio.run(load(server.target, texts, "--concurrency", str(concurrency), "--duration", str(seconds)).run())
        after = server.rss_mb()
    finally:
        code = server.stop()
    return "\n".join([
        f"### Soak: closed loop, concurrency {concurrency}, {seconds / 60:g} minutes, int8", "",
        "| requests | requests/s | p50 (s) | p99 (s) | errors | RSS after warm-up / after the soak (MB) | exit code |",
        "|---|---|---|---|---|---|---|",
        f"| {report.requests} | {report.requests_per_s:.1f} | {report.latency_s['p50']:.3f} | {report.latency_s['p99']:.3f} | {report.errors} "
        f"| {before:.0f} / {after:.0f} | {code} |",
    ])  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-load-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model", type=Path, default=ROOT / "artifacts" / "de-en-small", help="checkpoint dir holding onnx-P/ for each precision")
    parser.add_argument("--precisions", default="fp32,int8",
                        help="model dirs of the curve (CHECKPOINT/onnx-P); the overload, SIGTERM and soak sections load the last one")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--point-seconds", type=float, default=20.0)
    parser.add_argument("--overload-seconds", type=float, default=180.0, help="0 skips the overload section")
    parser.add_argument("--soak-seconds", type=float, default=600.0, help="0 skips the soak section")
    parser.add_argument("--sigterm-after", type=float, default=5.0, help="seconds of load before SIGTERM; 0 skips the SIGTERM section")
    parser.add_argument("--engines", type=int, default=0, help="nmt-serve --engines (0: the server's choice)")
    parser.add_argument("--threads", type=int, default=0, help="nmt-serve --threads, ONNX Runtime threads per session (0: the server's choice)")
    parser.add_argument("--texts", type=Path, default=None, help="as nmt-loadtest --texts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    model_dirs = {precision: args.model / f"onnx-{precision}" for precision in args.precisions.split(",") if precision}
    loaded = list(model_dirs.values())[-1]
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        flags = ("--engines", str(args.engines), "--threads", str(args.threads))
        table, capacity = curve(model_dirs, concurrencies, args.point_seconds, flags, args.texts, work)
        sections = [table]
        if args.overload_seconds > 0:
            sections.append(overload(loaded, capacity, args.overload_seconds, flags, args.texts, work))
        if args.sigterm_after > 0:
            sections.append(sigterm_under_load(loaded, flags, args.texts, work, after_s=args.sigterm_after))
        if args.soak_seconds > 0:
            sections.append(soak(loaded, args.soak_seconds, flags, args.texts, work))
    write_report("Load and reliability figures", "nmt-load-report", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
