"""nmt-cache-report: requests/s and latency with and without the translation cache on a repeating workload (bench/results/cache.md).

Two nmt-serve processes on the same model dir, one with --cache-mb and one with --cache-mb 0, take
nmt-loadtest's closed loop in turns (interleaved rounds, the order rotated each round), so that a
drift of a shared machine hits both alike. Each server has its own sequence of texts, the same for
both: with --repeat-fraction, that share of calls sends a text an earlier call to that server sent,
the rest texts it has not seen. The texts are German sentences of the LibreOffice help, shuffled;
a call sends one sentence, or with --texts-per-call several as one paragraph, which the server
splits back into sentences and looks up one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
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
    name: str
    server: ServerProcess
    picker: TextPicker | None = None  # one sequence of texts over all rounds
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    rounds: list[tuple[float, float]] = field(default_factory=list)  # (requests/s, p99 s) per round

    def run_round(self, texts_path: Path, flags: list[str]) -> None:
        test = load(self.server.target, texts_path, *flags)
        if self.picker is None:
            self.picker = test.picker
        test.picker = self.picker
        report = asyncio.run(test.run())
        if report.errors:
            raise RuntimeError(f"{self.name}: {report.errors} calls failed: {report.codes}")
        self.outcomes += test.outcomes
        self.seconds += report.duration_s
        self.rounds.append((report.requests_per_s, report.latency_s["p99"]))
        logger.info("%s: %.1f requests/s, p99 %.3f s", self.name, report.requests_per_s, report.latency_s["p99"])

    def row(self) -> str:
        ok = [outcome.latency_s for outcome in self.outcomes if outcome.code == "OK"]
        latency = percentiles(ok)
        per_round = ", ".join(f"{rate:.1f}" for rate, _ in self.rounds)
        return (f"| {self.name} | {len(ok)} | {len(ok) / self.seconds:.1f} | {latency['p50']:.3f} | {latency['p90']:.3f} | {latency['p99']:.3f} "
                f"| {latency['max']:.3f} | {per_round} |")  # fmt: skip


def measure(model_dir: Path, cache_mb: int, rounds: int, seconds: float, flags: list[str], texts_path: Path, work: Path) -> list[Contender]:
    contenders: list[Contender] = []
    flags = [*flags, "--duration", str(seconds), "--timeout", "60"]
    try:
        for name, budget in ((f"cache {cache_mb} MiB", cache_mb), ("no cache", 0)):
            contenders.append(Contender(name, ServerProcess(model_dir, work, "--cache-mb", str(budget), "--http-port", "0")))
        for number in range(rounds):
            for contender in rotated(contenders, number):
                contender.run_round(texts_path, flags)
    finally:
        for contender in contenders:
            contender.server.stop()
    return contenders


def workload_section(args: argparse.Namespace, per_call: int, contenders: list[Contender]) -> str:
    cached, uncached = contenders
    assert cached.picker is not None and uncached.picker is not None
    rates = [len(contender.outcomes) / contender.seconds for contender in contenders]
    return "\n".join([
        f"### {per_call} sentence{'s' if per_call > 1 else ''} per call; closed loop, concurrency {args.concurrency}, {args.repeat_fraction:.0%} "
        f"of sentences repeat an earlier one; {args.rounds} interleaved rounds of {args.round_seconds:g} s per server", "",
        "| server | requests | requests/s | p50 (s) | p90 (s) | p99 (s) | max (s) | requests/s per round |",
        "|---|---|---|---|---|---|---|---|", cached.row(), uncached.row(), "",
        f"With the cache: {rates[0] / rates[1]:.1f}x the requests/s. Sentences sent that had been sent before: {cached.picker.repeated} of "
        f"{cached.picker.picked} with the cache, {uncached.picker.repeated} of {uncached.picker.picked} without.",
    ])  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-cache-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8")
    parser.add_argument("--cache-mb", type=int, default=64, help="the cached server's --cache-mb")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds; each runs both servers once")
    parser.add_argument("--round-seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: calls in flight")
    parser.add_argument("--repeat-fraction", type=float, default=0.8)
    parser.add_argument("--texts-per-call", default="1,4", help="workloads: sentences per call, comma-separated")
    parser.add_argument("--help-root", default=DEFAULT_HELP_ROOT, help="LibreOffice help pages (de/ and en-US/), the source of the texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    texts = help_sentences(args.help_root, args.seed)
    if not texts:
        raise SystemExit(f"nmt-cache-report: no help pages under {args.help_root} (Debian: libreoffice-help-de, libreoffice-help-en-us)")
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts_path = work / "texts.txt"
        texts_path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        for per_call in (int(value) for value in args.texts_per_call.split(",")):
            flags = ["--concurrency", str(args.concurrency), "--repeat-fraction", str(args.repeat_fraction), "--texts-per-call", str(per_call)]
            contenders = measure(args.model_dir, args.cache_mb, args.rounds, args.round_seconds, flags, texts_path, work)
            sections.append(workload_section(args, per_call, contenders))
    model = args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir
    sections.append(f"Model dir: {model}. Texts: {len(texts)} distinct German sentences of the help pages, shuffled (seed {args.seed}).")
    write_report("Translation cache on a repeating workload", "nmt-cache-report", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
