"""nmt-cache-report: requests/s and latency with and without the translation cache on a repeating workload (bench/results/cache.md).

Two nmt-serve processes on the same model dir, one with --cache-mb and one with --cache-mb 0, take
nmt-loadtest's closed loop in turns (interleaved rounds, the order rotated each round), so that a
drift of a shared machine hits all rows alike: the uncached server at one concurrency, the cached
one at several, to find the most requests/s it serves at a p99 no higher than the uncached one's. Each server has its own sequence of texts, the same for
both: with --repeat-fraction, that share of calls sends a text an earlier call to that server sent,
the rest texts it has not seen. The texts are German sentences of the LibreOffice help, shuffled;
a call sends one sentence, or with --texts-per-call several as one paragraph, which the server
splits back into sentences and looks up one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from nmt_serve.bench.load_report import ROOT, ServerProcess, load
from nmt_serve.bench.report import rotated, write_report
from nmt_serve.client.loadtest import Outcome, TextPicker, percentiles
from nmt_serve.model.help_corpus import DEFAULT_HELP_ROOT, read_help

logger = logging.getLogger("nmt-cache-report")
MIN_WORDS, MAX_CHARS = 3, 200  # sentences, not headings or whole paragraphs


def help_sentences(root: str, seed: int) -> list[str]:
    """Distinct German sentences of the help pages under `root`, shuffled with `seed`."""
    pairs, _ = read_help(root, Counter())
    # Whole sentences only, so that a paragraph of them splits back at the same places.
    texts = [text for text in dict.fromkeys(german for german, _ in pairs)
             if len(text.split()) >= MIN_WORDS and len(text) <= MAX_CHARS and text.endswith((".", "!", "?"))]  # fmt: skip
    random.Random(seed).shuffle(texts)
    return texts


@dataclass
class Contender:
    """One server driven at one concurrency, with its own slice of the texts (so that no contender's new texts are
    ones another contender already put in the cache)."""

    name: str
    server: ServerProcess
    concurrency: int
    texts_path: Path
    picker: TextPicker | None = None  # one sequence of texts over all rounds
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    rounds: list[float] = field(default_factory=list)  # requests/s per round
    server_cpu_s: float = 0.0  # the server process's CPU time during this contender's rounds
    client_cpu_s: float = 0.0  # the load client's (this process's) CPU time during them

    def run_round(self, flags: list[str]) -> None:
        test = load(self.server.target, self.texts_path, "--concurrency", str(self.concurrency), *flags)
        if self.picker is None:
            self.picker = test.picker
        test.picker = self.picker
        server_before, client_before = self.server.cpu_seconds(), time.process_time()
        report = asyncio.run(test.run())
        self.server_cpu_s += self.server.cpu_seconds() - server_before
        self.client_cpu_s += time.process_time() - client_before
        if report.errors:
            raise RuntimeError(f"{self.name}: {report.errors} calls failed: {report.codes}")
        self.outcomes += test.outcomes
        self.seconds += report.duration_s
        self.rounds.append(report.requests_per_s)
        logger.info("%s: %.1f requests/s, p99 %.3f s", self.name, report.requests_per_s, report.latency_s["p99"])

    @property
    def requests_per_s(self) -> float:
        return sum(outcome.code == "OK" for outcome in self.outcomes) / self.seconds

    @property
    def latency(self) -> dict[str, float]:
        return percentiles([outcome.latency_s for outcome in self.outcomes if outcome.code == "OK"])

    @property
    def repeat_share(self) -> float:
        """The share of the texts sent that an earlier call had sent."""
        picker = self.picker
        return picker.repeated / picker.picked if picker is not None and picker.repeated is not None and picker.picked else 0.0

    def row(self) -> str:
        latency, calls = self.latency, len(self.outcomes)
        return (f"| {self.name} | {self.concurrency} | {calls} | {self.requests_per_s:.1f} | {latency['p50']:.3f} | {latency['p90']:.3f} "
                f"| {latency['p99']:.3f} | {latency['max']:.3f} | {self.repeat_share:.0%} | {1000 * self.server_cpu_s / calls:.2f} "
                f"| {1000 * self.client_cpu_s / calls:.2f} | {', '.join(f'{rate:.1f}' for rate in self.rounds)} |")  # fmt: skip


def measure(args: argparse.Namespace, flags: list[str], slices: list[Path], work: Path) -> list[Contender]:
    """The uncached server at --concurrency, then the cached one at each --cached-concurrency, in rotated turns each round."""
    flags = [*flags, "--duration", str(args.round_seconds), "--timeout", "60"]
    servers: list[ServerProcess] = []
    try:
        for budget in (0, args.cache_mb):
            servers.append(ServerProcess(args.model_dir, work, "--cache-mb", str(budget), "--http-port", "0", *args.server_flags.split()))
        plan = [("no cache", servers[0], args.concurrency)] + [(f"cache {args.cache_mb} MiB", servers[1], concurrency)
                                                               for concurrency in args.cached_concurrency]  # fmt: skip
        contenders = [Contender(name, server, concurrency, slices[index]) for index, (name, server, concurrency) in enumerate(plan)]
        for number in range(args.rounds):
            for contender in rotated(contenders, number):
                contender.run_round(flags)
    finally:
        for server in servers:
            server.stop()
    return contenders


# A row whose share of repeated sentences strays further than this from --repeat-fraction ran out of new sentences (its
# slice of the texts is used up and starts over, so "new" texts repeat): it measured another workload.
REPEAT_SHARE_TOLERANCE = 0.02


def workload_section(args: argparse.Namespace, per_call: int, contenders: list[Contender]) -> str:
    uncached, cached = contenders[0], contenders[1:]
    bound = uncached.latency["p99"]
    strayed = [contender for contender in contenders if abs(contender.repeat_share - args.repeat_fraction) > REPEAT_SHARE_TOLERANCE]
    within = [contender for contender in cached if contender.latency["p99"] <= bound and contender not in strayed]
    best = max(within, key=lambda contender: contender.requests_per_s) if within else None
    verdict = (f"At a p99 no higher than without the cache ({bound:.3f} s), the cache served {best.requests_per_s / uncached.requests_per_s:.1f}x "
               f"the requests/s (concurrency {best.concurrency}: {best.requests_per_s:.1f} against {uncached.requests_per_s:.1f})."
               if best else f"No cached run kept its p99 within the uncached run's {bound:.3f} s.")  # fmt: skip
    if strayed:
        verdict += "".join(f" Not comparable: {contender.name} at concurrency {contender.concurrency} repeated {contender.repeat_share:.0%} of its "
                           f"sentences, not {args.repeat_fraction:.0%}: its slice of new sentences ran out (fewer or shorter rounds)."
                           for contender in strayed)  # fmt: skip
    return "\n".join([
        f"### {per_call} sentence{'s' if per_call > 1 else ''} per call, {args.repeat_fraction:.0%} of sentences repeat an earlier one; closed loop, "
        f"{args.rounds} interleaved rounds of {args.round_seconds:g} s per row", "",
        "| server | concurrency | requests | requests/s | p50 (s) | p90 (s) | p99 (s) | max (s) | sentences repeated "
        "| server CPU per call (ms) | client CPU per call (ms) | requests/s per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *(contender.row() for contender in contenders), "", verdict,
    ])  # fmt: skip


def machine_note(load_before: float) -> str:
    """What else ran: the load measured before the report's own processes, and why the rows still compare."""
    return (f"The 1-minute load average was {load_before:.2f} on {os.cpu_count()} cores before this report started its servers. The load "
            "client runs on the same cores as the servers (its gRPC work per call is part of every row), and the rows take turns "
            "round by round, so a drift of the machine's load meets every row alike.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-cache-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8")
    parser.add_argument("--cache-mb", type=int, default=64, help="the cached server's --cache-mb")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds; each runs both servers once")
    parser.add_argument("--round-seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: calls in flight to the server without a cache")
    parser.add_argument("--cached-concurrency", type=lambda value: [int(part) for part in value.split(",")], default=[16, 32, 64],
                        help="closed loop: calls in flight to the server with the cache, one row each (comma-separated)")  # fmt: skip
    parser.add_argument("--repeat-fraction", type=float, default=0.8)
    parser.add_argument("--server-flags", default="", help="more nmt-serve flags for both servers, e.g. '--worker-niceness 0'")
    parser.add_argument("--texts-per-call", default="1,4", help="workloads: sentences per call, comma-separated")
    parser.add_argument("--help-root", default=DEFAULT_HELP_ROOT, help="LibreOffice help pages (de/ and en-US/), the source of the texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    load_before = os.getloadavg()[0]  # before this report starts any process: the other work on the machine
    texts = help_sentences(args.help_root, args.seed)
    if not texts:
        raise SystemExit(f"nmt-cache-report: no help pages under {args.help_root} (Debian: libreoffice-help-de, libreoffice-help-en-us)")
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        count = 1 + len(args.cached_concurrency)
        slices = [work / f"texts-{index}.txt" for index in range(count)]
        for index, path in enumerate(slices):
            path.write_text("\n".join(texts[index::count]) + "\n", encoding="utf-8")
        for per_call in (int(value) for value in args.texts_per_call.split(",")):
            flags = ["--repeat-fraction", str(args.repeat_fraction), "--texts-per-call", str(per_call)]
            sections.append(workload_section(args, per_call, measure(args, flags, slices, work)))
    model = args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir
    sections.append(machine_note(load_before))
    sections.append(f"Model dir: {model}. Texts: {len(texts)} distinct German sentences of the help pages, shuffled (seed {args.seed}), dealt "
                    f"out into {count} disjoint slices, one per row, so that a row's new sentences are new to the cache.")  # fmt: skip
    write_report("Translation cache on a repeating workload", "nmt-cache-report", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
