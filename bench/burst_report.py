"""nmt-burst-report: how fast refusals come back when 1,000 calls arrive at once, against grpcio's own floor.

Several servers run side by side on loopback and take the same burst in turn, round after round (one interleaved
run): a bare grpcio server that refuses every call at once (bench/refusing_server.py: the floor of any server on
grpcio's asyncio API on this host), nmt-serve refusing every call for its missing token (its interceptors, no model
work), and nmt-serve on the model taking the burst for real, once per --niceness and --hold-shares value (admitted
calls wait for a burst to end so that its refusals go out first, server/api/burst_hold.py; 0 turns that off). Each burst is
`nmt-loadtest --burst N` with its latency counted from the moment the client starts each call; the table gives
medians over the rounds and each refusal p99 as a ratio to the floor's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from nmt_serve.bench.load_report import ROOT, ServerProcess, load
from nmt_serve.bench.report import rotated, write_report
from nmt_serve.client.loadtest import percentiles

logger = logging.getLogger("nmt-burst-report")
REFUSALS = ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED")  # the token check refuses with the second
TOKEN = "burst-report-token"  # the token server requires it; the bursts never send it


@dataclass
class Contender:
    name: str
    server: ServerProcess
    bursts: list[dict[str, float]] = field(default_factory=list)  # per burst: refused p50/p99, admitted p99, counts
    at_work: bool = False  # a model server taking the burst for real (also timed under the closed loop)
    throughput: list[float] = field(default_factory=list)  # per round: closed-loop requests/s (model servers only)


def one_burst(target: str, size: int, texts: Path | None) -> dict[str, float]:
    test = load(target, texts, "--burst", str(size), "--timeout", "60")
    report = asyncio.run(test.run())
    # The report's own rejection percentiles cover RESOURCE_EXHAUSTED only; the token server refuses UNAUTHENTICATED.
    refused = percentiles([outcome.latency_s for outcome in test.outcomes if outcome.code in REFUSALS])
    codes = report.codes
    return {"refused_p50": refused.get("p50", float("nan")), "refused_p99": refused.get("p99", float("nan")),
            "admitted_p99": report.latency_s.get("p99", float("nan")), "refused": sum(codes.get(code, 0) for code in REFUSALS),
            "ok": codes.get("OK", 0), "other": sum(count for code, count in codes.items() if code not in (*REFUSALS, "OK"))}  # fmt: skip


def closed_loop(target: str, concurrency: int, seconds: float, texts: Path | None) -> float:
    report = asyncio.run(load(target, texts, "--concurrency", str(concurrency), "--duration", str(seconds)).run())
    return report.requests_per_s


def table(contenders: list[Contender], size: int, concurrency: int) -> str:
    floor = statistics.median(burst["refused_p99"] for burst in contenders[0].bursts)
    lines = [f"### Bursts of {size} calls at once ({len(contenders[0].bursts)} per server, interleaved)", "",
             "| server | refused: median p50 (s) | refused: median p99 (s) | refused p99: min-max (s) | p99 / floor's | admitted (OK): median p99 (s) "
             f"| OK / refused per burst | other codes | closed loop, {concurrency} clients: median requests/s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for contender in contenders:
        bursts = contender.bursts
        p99s = [burst["refused_p99"] for burst in bursts]
        admitted = [burst["admitted_p99"] for burst in bursts if burst["ok"]]
        lines.append(f"| {contender.name} | {statistics.median(b['refused_p50'] for b in bursts):.3f} | {statistics.median(p99s):.3f} "
                     f"| {min(p99s):.3f}-{max(p99s):.3f} | {statistics.median(p99s) / floor:.2f}x "
                     f"| {statistics.median(admitted) if admitted else float('nan'):.3f} "
                     f"| {min(b['ok'] for b in bursts):.0f}-{max(b['ok'] for b in bursts):.0f} / "
                     f"{min(b['refused'] for b in bursts):.0f}-{max(b['refused'] for b in bursts):.0f} | {sum(b['other'] for b in bursts):.0f} "
                     f"| {f'{statistics.median(contender.throughput):.1f}' if contender.throughput else '-'} |")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-burst-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8", help="model dir nmt-serve serves")
    parser.add_argument("--burst", type=int, default=1000, help="calls per burst")
    parser.add_argument("--rounds", type=int, default=5, help="bursts per server, taken in turn")
    parser.add_argument("--niceness", default="10", help="comma-separated nmt-serve --worker-niceness values, one server each")
    parser.add_argument("--hold-shares", default="0.25",
                        help="comma-separated nmt-serve --burst-hold-share values, one server each (with each --niceness value)")
    parser.add_argument("--burst-pauses", default="1,0",
                        help="comma-separated nmt-serve --burst-pause values, one server each (with each --niceness and --hold-shares value)")
    parser.add_argument("--closed-concurrency", type=int, default=32, help="clients of each round's closed loop on the model servers")
    parser.add_argument("--closed-seconds", type=float, default=10.0, help="length of that closed loop (0: none)")
    parser.add_argument("--max-queued-requests", type=int, default=256, help="nmt-serve --max-queued-requests (its default: 256)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between bursts, for the last one's calls to finish")
    parser.add_argument("--texts", type=Path, default=None, help="as nmt-loadtest --texts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "burst.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        serve_flags = ("--http-port", "0", "--max-queued-requests", str(args.max_queued_requests))
        contenders = [Contender("grpcio alone: every call refused in a bare handler (the floor)",
                                ServerProcess(None, work, module="nmt_serve.bench.refusing_server")),
                      Contender("nmt-serve, every call refused for its token (UNAUTHENTICATED)",
                                ServerProcess(args.model, work, *serve_flags, "--auth-token", TOKEN))]  # fmt: skip
        contenders += [Contender(f"nmt-serve, model at work, --worker-niceness {niceness}, --burst-hold-share {share}, --burst-pause {pause}",
                                 ServerProcess(args.model, work, *serve_flags, "--worker-niceness", niceness, "--burst-hold-share", share,
                                               "--burst-pause", pause),
                                 at_work=True)
                       for niceness in args.niceness.split(",") for share in args.hold_shares.split(",") for pause in args.burst_pauses.split(",")]  # fmt: skip
        try:
            for round_index in range(args.rounds):
                for contender in rotated(contenders, round_index):
                    time.sleep(args.pause)
                    contender.bursts.append(one_burst(contender.server.target, args.burst, args.texts))
                    logger.info("round %d, %s: %s", round_index + 1, contender.name, contender.bursts[-1])
                    if contender.at_work and args.closed_seconds > 0:
                        contender.throughput.append(closed_loop(contender.server.target, args.closed_concurrency, args.closed_seconds, args.texts))
        finally:
            for contender in contenders:
                contender.server.stop()
    write_report("Refusals under a burst", "nmt-burst-report", argv, [table(contenders, args.burst, args.closed_concurrency)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
