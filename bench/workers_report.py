"""nmt-workers-report: server throughput by replicas x engines x ONNX Runtime threads (server/engine/workers.py), on nmt-serve processes.

Every round starts each configuration in turn (interleaved, so a drift of the machine hits all of
them alike) and drives it with nmt-loadtest in closed loop at each load; the table has the medians
over rounds and each configuration's ratio to the first. The load generator runs in this process,
on the same machine: on a small machine it takes CPU from the server, as a client on the same
host would. With several replicas (separate nmt-serve processes) every configuration runs behind
the deploy's nginx (bench/balancer.py), so that all pay the same proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from nmt_serve.bench.balancer import Balancer
from nmt_serve.bench.load_report import ROOT, ServerProcess, load
from nmt_serve.bench.report import write_report

logger = logging.getLogger("nmt-workers-report")


@dataclass(frozen=True)
class Config:
    engines: int
    threads: int
    replicas: int = 1  # nmt-serve processes, each with `engines` engines of `threads` threads

    @property
    def name(self) -> str:
        replicas = f"{self.replicas} replicas x " if self.replicas > 1 else ""
        return f"{replicas}{self.engines} engine(s) x {self.threads} thread(s)"


@dataclass(frozen=True)
class Load:
    beam: int
    concurrency: int

    @property
    def name(self) -> str:
        return f"{'greedy' if self.beam == 1 else f'beam {self.beam}'}, concurrency {self.concurrency}"


def parse_pairs(text: str, separator: str, flag: str, form: str) -> list[tuple[int, int]]:
    """'A<separator>B,...' -> [(A, B), ...], each at least 1; a bad item is refused naming the flag and the form."""
    pairs = []
    for item in text.split(","):
        first, _, second = item.partition(separator)
        if not (first.isdigit() and second.isdigit() and int(first) >= 1 and int(second) >= 1):
            raise argparse.ArgumentTypeError(f"{flag}: {item!r} is not {form} with both at least 1")
        pairs.append((int(first), int(second)))
    return pairs


def parse_configs(text: str) -> list[Config]:
    """'1x2,2x1' -> engines x threads each; '2x1x1' -> replicas x engines x threads."""
    configs = []
    for item in text.split(","):
        replicas, _, rest = item.partition("x") if item.count("x") == 2 else ("1", "", item)
        if not replicas.isdigit() or int(replicas) < 1:
            raise argparse.ArgumentTypeError(f"--configs: {item!r} is not [REPLICASx]ENGINESxTHREADS with each at least 1")
        engines, threads = parse_pairs(rest, "x", "--configs", "[REPLICASx]ENGINESxTHREADS")[0]
        configs.append(Config(engines, threads, int(replicas)))
    return configs


def parse_loads(text: str) -> list[Load]:
    """'1:64,4:64' -> beam:concurrency each."""
    return [Load(*pair) for pair in parse_pairs(text, ":", "--loads", "BEAM:CONCURRENCY")]


def measure(model_dir: Path, configs: list[Config], loads: list[Load], rounds: int, seconds: float, texts: Path | None,
            work: Path) -> dict[tuple[Load, Config], list[tuple[float, float, float]]]:  # fmt: skip
    """(requests/s, p50 s, p99 s) per round, per load and configuration."""
    results: dict[tuple[Load, Config], list[tuple[float, float, float]]] = {}
    balanced = any(config.replicas > 1 for config in configs)
    for round_number in range(rounds):
        for number, config in enumerate(configs):
            server_flags = ("--engines", str(config.engines), "--threads", str(config.threads), "--max-queued-requests", "1024")
            servers: list[ServerProcess] = []
            balancer = None
            try:
                for _ in range(config.replicas):  # one by one: those started are stopped if a later one fails
                    servers.append(ServerProcess(model_dir, work, *server_flags))
                if balanced:
                    balancer = Balancer([server.target for server in servers], work / f"nginx-{round_number}-{number}")
                target = balancer.target if balancer is not None else servers[0].target
                for load_point in loads:
                    flags = ("--concurrency", str(load_point.concurrency), "--duration", str(seconds), "--beam", str(load_point.beam))
                    report = asyncio.run(load(target, texts, *flags).run())
                    if report.errors:
                        raise RuntimeError(f"{config.name}, {load_point.name}: {report.errors} calls failed")
                    results.setdefault((load_point, config), []).append((report.requests_per_s, report.latency_s["p50"], report.latency_s["p99"]))
                    logger.info("round %d, %s, %s: %.1f requests/s", round_number + 1, config.name, load_point.name, report.requests_per_s)
            finally:
                if balancer is not None:
                    balancer.stop()
                for server in servers:
                    server.stop()
    return results


def table(results: dict[tuple[Load, Config], list[tuple[float, float, float]]], configs: list[Config], loads: list[Load], rounds: int) -> str:
    lines = [f"Medians of {rounds} interleaved rounds; the ratio is requests/s against {configs[0].name}.", "",
             "| load | server | requests/s | ratio | p50 (s) | p99 (s) | requests/s per round |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for load_point in loads:
        baseline = statistics.median(rate for rate, _, _ in results[(load_point, configs[0])])
        for config in configs:
            runs = results[(load_point, config)]
            rate = statistics.median(rate for rate, _, _ in runs)
            p50, p99 = (statistics.median(run[index] for run in runs) for index in (1, 2))
            per_round = " / ".join(f"{run[0]:.0f}" for run in runs)
            lines.append(f"| {load_point.name} | {config.name} | {rate:.1f} | {rate / baseline:.2f}x | {p50:.3f} | {p99:.3f} | {per_round} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-workers-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8")
    parser.add_argument("--configs", type=parse_configs, default=parse_configs("1x2,2x1,1x1"), help="[REPLICASx]ENGINESxTHREADS,... (default 1x2,2x1,1x1); with several replicas every configuration runs behind nginx")
    parser.add_argument("--loads", type=parse_loads, default=parse_loads("1:64,4:64,1:4"), help="BEAM:CONCURRENCY,... (default 1:64,4:64,1:4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per load point")
    parser.add_argument("--texts", type=Path, default=None, help="as nmt-loadtest --texts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "workers.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args.model_dir, args.configs, args.loads, args.rounds, args.seconds, args.texts, Path(tmp))
    balanced = " behind the deploy's nginx" if any(config.replicas > 1 for config in args.configs) else ""
    section = f"### {args.model_dir.name}: closed loop{balanced}, {args.seconds:g} s per point\n\n" + table(results, args.configs, args.loads, args.rounds)
    write_report("Server throughput by replicas x engines x threads", "nmt-workers-report", argv, [section], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
