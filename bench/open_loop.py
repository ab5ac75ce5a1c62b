"""Open-loop run: Poisson arrivals of mixed-length requests; continuous vs static batching at the same offered load."""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from model.search import SearchOptions
from server.engine import Engine, EngineLimits, Job
from server.runtime import Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    source: list[int]
    options: SearchOptions


def poisson_arrivals(sources: Sequence[list[int]], rate_per_s: float, duration_s: float, seed: int = 0) -> list[Arrival]:
    """Exponential gaps; output lengths drawn from 4..48 so short requests stand behind long ones under static batching."""
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    while True:
        now += rng.expovariate(rate_per_s)
        if now >= duration_s:
            return arrivals
        length = rng.randint(4, 48)
        beam = rng.choice((1, 1, 1, 4))
        options = SearchOptions(beam_size=beam, min_output_tokens=length, max_output_tokens=length)
        arrivals.append(Arrival(now, rng.choice(sources), options))


def drive(runtime: Runtime, arrivals: list[Arrival], continuous: bool, max_rows: int = 256) -> tuple[list[float], int, float]:
    """Replays arrivals in real time. Continuous: arrivals join between steps. Static: a batch runs to completion first."""
    engine = Engine(runtime, EngineLimits(max_rows=max_rows, max_cache_tokens=1 << 22))
    started = time.perf_counter()
    submitted: list[tuple[Job, float]] = []
    index = 0
    while index < len(arrivals) or engine.has_work:
        now = time.perf_counter() - started
        if continuous or not engine.has_work:
            while index < len(arrivals) and arrivals[index].at_s <= now:
                arrival = arrivals[index]
                submitted.append((engine.submit(arrival.source, arrival.options), arrival.at_s))
                index += 1
        if engine.has_work:
            engine.step()
        elif index < len(arrivals):
            time.sleep(max(0.0, min(0.005, arrivals[index].at_s - now)))
    elapsed = time.perf_counter() - started
    latencies = []
    tokens = 0
    for job, at_s in submitted:
        job.done.wait()
        latencies.append(job.finished_at - started - at_s)
        tokens += len(job.hypotheses[0].token_ids)
    return latencies, tokens, elapsed


def run_open_loop(runtime: Runtime, sources: Sequence[list[int]], duration_s: float, rate_per_s: float = 0.0) -> str:
    """Markdown table: continuous vs static batching at one offered rate (default: ~70% of the continuous capacity)."""
    if rate_per_s <= 0:
        probe = poisson_arrivals(sources, 1000.0, 0.05)  # a burst, to estimate capacity in requests/s
        _, _, elapsed = drive(runtime, probe, continuous=True)
        rate_per_s = 0.7 * len(probe) / elapsed
    arrivals = poisson_arrivals(sources, rate_per_s, duration_s)
    lines = [
        f"### Open loop: Poisson arrivals at {rate_per_s:.1f} requests/s for {duration_s:.0f} s ({len(arrivals)} requests), output 4..48 tokens, 1 in 4 beam 4",
        "",
        "| batching | requests/s | tokens/s | p50 latency (s) | p99 latency (s) |",
        "|---|---|---|---|---|",
    ]
    for continuous in (True, False):
        latencies, tokens, elapsed = drive(runtime, arrivals, continuous)
        p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else latencies[0]
        name = "continuous" if continuous else "static"
        lines.append(f"| {name} | {len(latencies) / elapsed:.1f} | {tokens / elapsed:.0f} | {statistics.median(latencies):.3f} | {p99:.3f} |")
        logger.info("open loop %s done", name)
    return "\n".join(lines)
