"""nmt-loadtest: closed-loop (concurrency), open-loop (Poisson rate) or burst (N calls at once) load on a translation server or balancer.

Reports achieved requests and tokens per second, latency percentiles, time to first token when
streaming, counts by status code (RESOURCE_EXHAUSTED apart from errors) and, given --metrics-url,
the server-side deltas of queue wait and batch rows over the run. Markdown and JSON output.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from nmt_serve.client.http_caller import HttpCaller, HttpCallError
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger("nmt-loadtest")

SAMPLE_TEXTS = Path(__file__).with_name("sample_texts.txt")  # written for this project, not corpus text
SERVER_SERIES = ("nmt_queue_wait_seconds", "nmt_batch_rows", "nmt_decode_step_duration_seconds")


@dataclass
class Outcome:
    code: str
    latency_s: float
    first_token_s: float | None
    tokens: int
    started_at: float  # time.perf_counter() when the call was sent
    model: str = ""  # the model field sent (empty: the server's default)


@dataclass
class Report:
    mode: str
    target: str
    duration_s: float
    requests: int
    requests_per_s: float
    tokens_per_s: float
    latency_s: dict[str, float]
    first_token_s: dict[str, float]
    codes: dict[str, int]
    rejected: int  # RESOURCE_EXHAUSTED: refused by admission control, not an error
    errors: int  # anything else but OK
    rejection_latency_s: dict[str, float] = field(default_factory=dict)  # how fast RESOURCE_EXHAUSTED came back
    server: dict[str, float] = field(default_factory=dict)  # mean of each server histogram over the run
    models: dict[str, dict[str, int]] = field(default_factory=dict)  # with --model: counts by status code, per model
    repeated: int | None = None  # with --repeat-fraction: texts picked that an earlier pick of the run had picked
    picked: int = 0  # texts picked: --texts-per-call per call

    def markdown(self) -> str:
        lines = [f"### nmt-loadtest {self.mode} against {self.target}", "",
                 "| requests | requests/s | tokens/s | p50 (s) | p90 (s) | p99 (s) | max (s) | OK | RESOURCE_EXHAUSTED | other errors |",
                 "|---|---|---|---|---|---|---|---|---|---|",
                 f"| {self.requests} | {self.requests_per_s:.1f} | {self.tokens_per_s:.0f} | {self.latency_s.get('p50', 0):.3f} "
                 f"| {self.latency_s.get('p90', 0):.3f} | {self.latency_s.get('p99', 0):.3f} | {self.latency_s.get('max', 0):.3f} "
                 f"| {self.codes.get('OK', 0)} | {self.rejected} | {self.errors} |"]  # fmt: skip
        if self.first_token_s:
            lines += ["", f"Time to first token: p50 {self.first_token_s['p50']:.3f} s, p99 {self.first_token_s['p99']:.3f} s."]
        if self.rejection_latency_s:
            lines += ["", f"Refused (RESOURCE_EXHAUSTED) after: p50 {self.rejection_latency_s['p50']:.4f} s, p99 {self.rejection_latency_s['p99']:.4f} s, "
                          f"max {self.rejection_latency_s['max']:.4f} s; admitted calls answered OK after: p50 {self.latency_s.get('p50', 0):.3f} s, "
                          f"p99 {self.latency_s.get('p99', 0):.3f} s."]  # fmt: skip
        if self.server:
            lines += ["", "Server side over the run: " + ", ".join(f"mean {name} {value:.4g}" for name, value in self.server.items()) + "."]
        if self.models:
            lines += ["", "Calls by model: " + "; ".join(f"{model}: " + ", ".join(f"{code} {count}" for code, count in sorted(codes.items()))
                                                       for model, codes in self.models.items()) + "."]  # fmt: skip
        if self.repeated is not None:
            lines += ["", f"Repeated texts: {self.repeated} of the {self.picked} texts sent ({self.repeated / max(self.picked, 1):.0%}) "
                          "had been sent before."]  # fmt: skip
        other = {code: count for code, count in self.codes.items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
        if other:
            lines += ["", "Errors by code: " + ", ".join(f"{code} {count}" for code, count in sorted(other.items())) + "."]
        return "\n".join(lines) + "\n"


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1], "mean": statistics.fmean(ordered)}


def scrape_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each server histogram in SERVER_SERIES, summed over label sets."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    totals = {name: [0.0, 0.0] for name in SERVER_SERIES}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            for sample in family.samples:
                if sample.name in (family.name + "_sum", family.name + "_count"):
                    totals[family.name][sample.name.endswith("_count")] += sample.value
    return {name: (values[0], values[1]) for name, values in totals.items()}


def model_turns(spec: str) -> list[str]:
    """--model's value as one round of turns: "a,b" is a then b; "a=3,b=1" is a three times, then b once. Empty: [""], the default model."""
    if not spec:
        return [""]
    turns: list[str] = []
    for part in (part.strip() for part in spec.split(",")):
        name, _, weight = part.partition("=")
        if not name or (weight and (not weight.isdigit() or int(weight) < 1)):
            raise ValueError(f"--model takes NAME[=WEIGHT],... with whole weights of at least 1, got {part!r}")
        turns += [name] * (int(weight) if weight else 1)
    return turns


class TextPicker:
    """Each call's text: uniformly at random from the list; or, given a repeat fraction, with that chance a text some
    earlier call sent (uniformly among them), else the next text no call has sent yet (repeats once the list is spent)."""

    def __init__(self, texts: list[str], rng: random.Random, repeat_fraction: float | None) -> None:
        self.texts, self.rng, self.repeat_fraction = texts, rng, repeat_fraction
        self.sent: list[str] = []  # the texts sent so far, each once
        self.repeated = 0
        self.picked = 0

    def pick(self) -> str:
        self.picked += 1
        if self.repeat_fraction is None:
            return self.rng.choice(self.texts)
        spent = len(self.sent) == len(self.texts)
        if self.sent and (spent or self.rng.random() < self.repeat_fraction):
            self.repeated += 1
            return self.rng.choice(self.sent)
        text = self.texts[len(self.sent)]
        self.sent.append(text)
        return text


class LoadTest:
    def __init__(self, args: argparse.Namespace, texts: list[str]) -> None:
        self.args = args
        self.texts = texts
        self.turns = itertools.cycle(model_turns(args.model))
        self.rng = random.Random(args.seed)
        # Texts distinct by content, so that a repeat is a repeat only when the picker chose one.
        self.picker = TextPicker(list(dict.fromkeys(texts)) if args.repeat_fraction is not None else texts, self.rng, args.repeat_fraction)
        self.outcomes: list[Outcome] = []
        self.metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
        options = {"beam_size": args.beam} if args.beam else {}
        self.options = pb.DecodingOptions(**options)

    async def one(self, stub: pb_grpc.TranslationServiceStub) -> None:
        # Several texts per call go as one text of several sentences (the server splits it: each sentence is looked up alone).
        text, model = " ".join(self.picker.pick() for _ in range(self.args.texts_per_call)), next(self.turns)
        started = time.perf_counter()
        first: float | None = None
        tokens = 0
        try:
            if self.args.stream:
                async for message in stub.TranslateStream(pb.TranslateStreamRequest(text=text, options=self.options, model=model),
                                                          timeout=self.args.timeout, metadata=self.metadata):  # fmt: skip
                    if first is None and message.text_delta:
                        first = time.perf_counter() - started
                    if message.final:
                        tokens = message.hypotheses[0].token_count
            else:
                response = await stub.Translate(pb.TranslateRequest(texts=[text], options=self.options, model=model), timeout=self.args.timeout,
                                                metadata=self.metadata)  # fmt: skip
                tokens = response.translations[0].hypotheses[0].token_count
            code = "OK"
        except (grpc.aio.AioRpcError, HttpCallError) as error:
            code = error.code().name
        self.outcomes.append(Outcome(code, time.perf_counter() - started, first, tokens, started, model))

    def finished(self, started: float, issued: int) -> bool:
        if self.args.requests:
            return issued >= self.args.requests
        return time.perf_counter() - started >= self.args.duration

    async def closed_loop(self, stub: pb_grpc.TranslationServiceStub, started: float) -> None:
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while not self.finished(started, issued):
                issued += 1
                await self.one(stub)
                if self.outcomes[-1].code == "UNAVAILABLE":
                    await asyncio.sleep(self.args.backoff)  # back off like a real client while a server is away

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def open_loop(self, stub: pb_grpc.TranslationServiceStub, started: float) -> None:
        """Arrivals on a Poisson clock, whatever the server's pace: overload shows as latency and rejections."""
        tasks, issued, due = [], 0, started
        while not self.finished(started, issued):
            due += self.rng.expovariate(self.args.rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(self.one(stub)))
            issued += 1
        await asyncio.gather(*tasks)

    async def burst(self, stub: pb_grpc.TranslationServiceStub) -> None:
        """Every call sent at once: admission control answers what the queue cannot hold."""
        await asyncio.gather(*(self.one(stub) for _ in range(self.args.burst)))

    async def progress(self, started: float) -> None:
        while True:
            await asyncio.sleep(self.args.progress_every)
            done = len(self.outcomes)
            elapsed = time.perf_counter() - started
            codes = Counter(outcome.code for outcome in self.outcomes)
            logger.info("%5.1f s: %d done (%.1f/s), %s", elapsed, done, done / elapsed, dict(codes))

    async def run(self) -> Report:
        args = self.args
        # --http: the HTTP/JSON API's caller stands in for the stub (client/http_caller.py), the rest of the run is the same.
        async with HttpCaller(args.target) if args.http else grpc.aio.insecure_channel(args.target) as channel:
            if args.wait_ready:
                await (channel.wait_ready(args.wait_ready) if args.http else wait_ready(channel, args.wait_ready))
            stub = channel if args.http else pb_grpc.TranslationServiceStub(channel)
            before = scrape_sums(args.metrics_url) if args.metrics_url else {}
            started = time.perf_counter()
            reporter = asyncio.create_task(self.progress(started))
            try:
                if args.burst:
                    await self.burst(stub)
                else:
                    await (self.open_loop(stub, started) if args.rate else self.closed_loop(stub, started))
            finally:
                reporter.cancel()
            elapsed = time.perf_counter() - started
            after = scrape_sums(args.metrics_url) if args.metrics_url else {}
        server = {}
        for name, (total, count) in after.items():
            delta_count = count - before[name][1]
            if delta_count > 0:
                server[name] = (total - before[name][0]) / delta_count
        codes = Counter(outcome.code for outcome in self.outcomes)
        ok = [outcome for outcome in self.outcomes if outcome.code == "OK"]
        mode = f"open loop at {args.rate:g} requests/s" if args.rate else f"closed loop, concurrency {args.concurrency}"
        if args.burst:
            mode = f"burst of {args.burst} calls at once"
        return Report(
            mode=mode + (", streaming" if args.stream else "") + (", HTTP/JSON" if args.http else ""), target=args.target, duration_s=elapsed, requests=len(self.outcomes),
            requests_per_s=len(ok) / elapsed, tokens_per_s=sum(outcome.tokens for outcome in ok) / elapsed,
            latency_s=percentiles([outcome.latency_s for outcome in ok]),
            first_token_s=percentiles([outcome.first_token_s for outcome in ok if outcome.first_token_s is not None]),
            codes=dict(codes), rejected=codes.get("RESOURCE_EXHAUSTED", 0),
            errors=sum(count for code, count in codes.items() if code not in ("OK", "RESOURCE_EXHAUSTED")), server=server,
            rejection_latency_s=percentiles([outcome.latency_s for outcome in self.outcomes if outcome.code == "RESOURCE_EXHAUSTED"]),
            models=self.codes_by_model() if args.model else {}, repeated=self.picker.repeated if args.repeat_fraction is not None else None,
            picked=self.picker.picked,
        )  # fmt: skip

    def codes_by_model(self) -> dict[str, dict[str, int]]:
        by_model: dict[str, Counter[str]] = {}
        for outcome in self.outcomes:
            by_model.setdefault(outcome.model, Counter())[outcome.code] += 1
        return {model: dict(codes) for model, codes in by_model.items()}


async def wait_ready(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Until health says SERVING (through a balancer: some replica does), or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"nmt-loadtest: {timeout_s:g} s without a SERVING health check")
        await asyncio.sleep(0.5)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-loadtest", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--target", default=os.environ.get("NMT_TARGET", "127.0.0.1:50051"), help="server or balancer host:port, env NMT_TARGET")
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: calls in flight")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second (instead of --concurrency)")
    parser.add_argument("--burst", type=int, default=0, help="send this many calls at once, then stop (instead of --concurrency or --rate)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds (unless --requests)")
    parser.add_argument("--requests", type=int, default=0, help="stop after this many calls")
    parser.add_argument("--texts", type=Path, default=None, help="one text per line, or a TSV whose first column is used "
                        "(default: data/corpus/test.tsv when present, else a bundled sample)")  # fmt: skip
    parser.add_argument("--repeat-fraction", type=float, default=None, help="the share of calls that send a text an earlier call sent "
                        "(the rest send texts not sent before, in file order); default: every call picks a text at random")  # fmt: skip
    parser.add_argument("--texts-per-call", type=int, default=1, help="texts joined by a space into each call's text (a paragraph "
                        "of sentences, when the texts are sentences)")  # fmt: skip
    parser.add_argument("--beam", type=int, default=0, help="beam size (default: the server's)")
    parser.add_argument("--model", default="", help="served model(s) to call: NAME; a,b = in turn; a=3,b=1 = three calls "
                        "to a, then one to b (default: the server's default model)")  # fmt: skip
    parser.add_argument("--stream", action="store_true", help="TranslateStream; reports time to first token")
    parser.add_argument("--http", action="store_true", help="call the HTTP/JSON API (--target is its host:port) instead of gRPC")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--backoff", type=float, default=0.05, help="closed loop: seconds a client waits after an UNAVAILABLE")
    parser.add_argument("--token", default="", help="bearer token")
    parser.add_argument("--metrics-url", default="", help="a server's /metrics, for server-side deltas")
    parser.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this long for a SERVING health check")
    parser.add_argument("--progress-every", type=float, default=2.0, help="seconds between progress lines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="write the report as markdown")
    return parser


def load_texts(path: Path | None) -> list[str]:
    if path is None:
        corpus = Path("data/corpus/test.tsv")
        path = corpus if corpus.is_file() else SAMPLE_TEXTS
    texts = [line.split("\t", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    texts = [text for text in texts if text]
    if not texts:
        raise SystemExit(f"nmt-loadtest: no texts in {path}")
    return texts


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    if args.concurrency < 1 or args.rate < 0 or args.burst < 0 or (args.duration <= 0 and args.requests <= 0):
        raise SystemExit("nmt-loadtest: --concurrency must be >= 1, --rate and --burst >= 0, and --duration or --requests positive")
    if args.texts_per_call < 1:
        raise SystemExit(f"nmt-loadtest: --texts-per-call must be at least 1, got {args.texts_per_call}")
    if args.repeat_fraction is not None and not 0.0 <= args.repeat_fraction <= 1.0:
        raise SystemExit(f"nmt-loadtest: --repeat-fraction must be between 0 and 1, got {args.repeat_fraction:g}")
    try:
        test = LoadTest(args, load_texts(args.texts))  # reads --model, before any call
    except ValueError as error:
        raise SystemExit(f"nmt-loadtest: {error}") from None
    report = asyncio.run(test.run())
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as out:
            out.write(report.markdown())
    sys.stdout.write(report.markdown())
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
