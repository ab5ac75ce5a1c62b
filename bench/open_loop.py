"""Open-loop run: Poisson arrivals of mixed-length requests; continuous vs static batching at the same offered loads.

Continuous batching runs with a row cap (EngineLimits.max_rows) and without one. On a CPU a
step costs about a fixed part plus a part per row, so past a few dozen rows a bigger batch buys
no throughput: uncapped, every arrival joins at once and the engine behaves like processor
sharing, where a long request pays for every request that arrives during its life. Capped,
arrivals past the cap wait their turn (first come, first served) and running requests keep a
short step. With joins grouped (EngineLimits.join_wait_steps, the server's default), newcomers
to a busy batch join a few at a time: fewer encoder calls and layout changes interrupt the
running requests.

Two static baselines: rows leaving their batch once done (this engine without joins; on a CPU,
where a step costs about its rows, the strongest static batching) and padded (every row runs to
its batch's longest output and the batch answers together: a batched generate call behind a
server that batches whole requests). Each request run alone on the idle engine is the floor: no
batching answers a request sooner than its own steps take, so where half of static's p99 is
below the alone p99, no scheduler reaches 0.5x of static on this engine.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nmt_serve.bench.report import rotated
from nmt_serve.model.search import SearchOptions
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import EngineLimits, Job
from nmt_serve.server.engine.sessions import Runtime
from nmt_serve.server.engine.workers import plan_workers
from nmt_serve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

LOADS = (0.3, 0.5, 0.7, 0.9)  # offered rate as a share of the measured static-batching capacity
SHORT_TOKENS = 16
UNCAPPED_ROWS = 256
ROW_CAPS = (32,)
ALONE_COUNT = 200  # requests of the mix timed alone for the floor row
SERVER_JOINS = (ServerSettings().join_wait_steps, ServerSettings().join_group)  # the server's default join policy


@dataclass(frozen=True)
class Arrival:
    at_s: float
    source: list[int]
    options: SearchOptions


@dataclass(frozen=True)
class Run:
    served: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    p50_s: float
    p99_s: float
    p99_short_s: float  # requests of at most SHORT_TOKENS output tokens: the ones static batching makes wait
    busy_share: float  # engine step time / wall time: the load the engine really carried


def percentile(values: list[float], share: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(share * 100) - 1]


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


def drive(runtime: Runtime, arrivals: list[Arrival], continuous: bool, max_rows: int = UNCAPPED_ROWS, joins: tuple[int, int] = (0, 1),
          padded: bool = False) -> Run:  # fmt: skip
    """Replays arrivals in real time. Continuous: arrivals join between steps; joins = (join_wait_steps, join_group)
    of EngineLimits, (0, 1) = each at the next step. Static: when the engine is idle, the requests that have
    arrived (up to `max_rows` rows) form a batch that runs to completion before the next one starts; a row
    leaves the batch when its request is done. Padded static: every row of a batch runs to the batch's
    longest output and the batch answers together, as a batched generate call does (a server that batches
    whole requests, such as a Triton dynamic batcher in front of a generate loop)."""
    if padded and any(arrival.options.max_output_tokens is None for arrival in arrivals):
        raise ValueError("padded static batching needs every arrival's output length forced (max_output_tokens)")
    join_wait_steps, join_group = joins
    engine = Engine(runtime, EngineLimits(max_rows=max_rows, max_cache_tokens=1 << 22, join_wait_steps=join_wait_steps, join_group=join_group))
    started = time.perf_counter()
    submitted: list[tuple[Job, Arrival, int]] = []  # (job, its arrival, its batch: static only)
    index = batches = 0
    while index < len(arrivals) or engine.has_work:
        now = time.perf_counter() - started
        if continuous:
            end = arrived_by(arrivals, index, now)
        elif not engine.has_work:
            end = static_batch_end(arrivals, index, now, max_rows)
            batches += end > index
        else:
            end = index
        batch = arrivals[index:end]
        longest = max((arrival.options.max_output_tokens or 0 for arrival in batch), default=0)  # padded: lengths are forced
        for arrival in batch:
            options = replace(arrival.options, min_output_tokens=longest, max_output_tokens=longest) if padded else arrival.options
            submitted.append((engine.submit(arrival.source, options), arrival, batches))
        index = end
        if engine.has_work:
            engine.step()
        elif index < len(arrivals):
            time.sleep(max(0.0, min(0.005, arrivals[index].at_s - now)))
    elapsed = time.perf_counter() - started
    answered: dict[int, float] = {}  # padded: a batch answers when its last row is done
    for job, _, batch_number in submitted:
        job.done.wait()
        key = batch_number if padded else job.job_id
        answered[key] = max(answered.get(key, 0.0), job.finished_at)
    latencies, short = [], []
    tokens = 0
    for job, arrival, batch_number in submitted:
        latency = answered[batch_number if padded else job.job_id] - started - arrival.at_s
        latencies.append(latency)
        output = min(len(job.hypotheses[0].token_ids), arrival.options.max_output_tokens or 1 << 30)  # padding is not output
        if output <= SHORT_TOKENS:
            short.append(latency)
        tokens += output
    return Run(len(latencies), tokens, len(latencies) / elapsed, tokens / elapsed, statistics.median(latencies),
               percentile(latencies, 0.99), percentile(short, 0.99), engine.profile.total_s / elapsed)  # fmt: skip


def arrived_by(arrivals: list[Arrival], index: int, now_s: float) -> int:
    """End of the arrivals from `index` on that have arrived by `now_s`."""
    while index < len(arrivals) and arrivals[index].at_s <= now_s:
        index += 1
    return index


def static_batch_end(arrivals: list[Arrival], index: int, now_s: float, max_rows: int) -> int:
    """End of the next static batch: the arrived requests from `index` on, while their rows fit in `max_rows`
    (a first request always fits)."""
    arrived, rows = arrived_by(arrivals, index, now_s), 0
    for end in range(index, arrived):
        rows += arrivals[end].options.beam_size
        if rows > max_rows and end > index:
            return end
    return arrived


def alone_latencies(runtime: Runtime, arrivals: Sequence[Arrival], count: int) -> list[float]:
    """Latencies of `count` of the arrivals (evenly spread) each run by itself on an idle engine: no queue, no
    step shared. No batching can answer these requests faster on this engine, so half of static batching's p99
    is out of reach wherever this p99 is above it."""
    engine = Engine(runtime)
    chosen = [arrivals[round(i * (len(arrivals) - 1) / max(count - 1, 1))] for i in range(min(count, len(arrivals)))]
    latencies = []
    for arrival in chosen:
        started = time.perf_counter()
        job = engine.submit(arrival.source, arrival.options)
        engine.run_until_idle()
        latencies.append(job.finished_at - started)
    return latencies


def static_capacity(runtime: Runtime, sources: Sequence[list[int]], requests: int = 400) -> float:
    """Requests/s when everything is queued at once: the most static batching can sustain on this request mix."""
    # Rate x duration = `requests` expected arrivals; all of them are then moved to time 0.
    burst = [Arrival(0.0, arrival.source, arrival.options) for arrival in poisson_arrivals(sources, float(requests), 1.0)]
    return drive(runtime, burst, continuous=False).requests_per_s


def median_run(runs: Sequence[Run]) -> Run:
    """Each field's median over repeated runs of one mode."""
    return Run(*(statistics.median(getattr(run, name) for run in runs) for name in Run.__dataclass_fields__))


def replay_modes(runtime: Runtime, sources: Sequence[list[int]], rate: float, duration_s: float, modes: dict[str, dict[str, Any]],
                 repeats: int) -> dict[str, Run]:  # fmt: skip
    """Median run of every mode over `repeats` rounds; each round draws its own arrivals (seed = round) and
    replays them through every mode, in an order rotated per round so a drift of the machine hits all alike."""
    runs: dict[str, list[Run]] = {name: [] for name in modes}
    for round_number in range(repeats):
        arrivals = poisson_arrivals(sources, rate, duration_s, seed=round_number)
        for name in rotated(list(modes), round_number):
            runs[name].append(drive(runtime, arrivals, **modes[name]))
    return {name: median_run(mode_runs) for name, mode_runs in runs.items()}


def run_open_loop(runtime: Runtime, sources: Sequence[list[int]], duration_s: float, loads: Sequence[float] = LOADS,
                  row_caps: Sequence[int] = ROW_CAPS, alone_count: int = ALONE_COUNT, repeats: int = 1) -> str:  # fmt: skip
    """Markdown table: continuous batching (capped, uncapped, as served) against static batching (rows leaving when
    done, and padded) at several offered rates, all replaying the same arrivals; and each request alone, the floor."""
    capacity = static_capacity(runtime, sources)
    served_rows = plan_workers(0, 0, runtime.provider == "CUDAExecutionProvider", cores=1).max_rows  # the server's rows per engine here
    alone = alone_latencies(runtime, poisson_arrivals(sources, capacity, duration_s), alone_count)
    alone_p50, alone_p99 = statistics.median(alone), percentile(alone, 0.99)
    static_name, padded_name = f"static, max {UNCAPPED_ROWS} rows", f"padded static, max {UNCAPPED_ROWS} rows"
    modes: dict[str, dict[str, Any]] = {f"continuous, max {cap} rows": {"continuous": True, "max_rows": cap} for cap in row_caps}
    modes[f"continuous, max {UNCAPPED_ROWS} rows"] = {"continuous": True}
    modes[f"continuous as served: max {served_rows} rows, joins grouped ({SERVER_JOINS[0]} steps)"] = {
        "continuous": True, "max_rows": served_rows, "joins": SERVER_JOINS}
    modes[static_name], modes[padded_name] = {"continuous": False}, {"continuous": False, "padded": True}
    lines = [
        f"### Open loop: Poisson arrivals for {duration_s:.0f} s per run, output 4..48 tokens (forced), 1 in 4 requests beam 4",
        "",
        f"Static-batching capacity on this mix (all requests queued at once, batches of up to {UNCAPPED_ROWS} rows): "
        f"{capacity:.1f} requests/s. Each offered load replays the same arrivals through every mode"
        + (f"; {repeats} rounds, each with its own arrivals and the modes in a rotated order, medians of each column. " if repeats > 1 else ". ")
        + "Arrivals one by one make smaller batches than that burst, so an offered share of it can already keep the "
        "engine busy most of the time: the busy column is the engine's step time over the wall time. "
        "A mode whose achieved rate falls below the offered rate was over its capacity, and its latencies "
        "grow with the run length. Static: a batch runs to completion before the next starts, each row leaving "
        "when its request is done; padded static: every row runs to its batch's longest output and the batch "
        "answers together (a batched generate call). Alone: "
        f"{len(alone)} of the requests, each run by itself on the idle engine; no batching can answer faster, "
        "so a p99 ratio below the alone row's cannot be reached on this engine.",
        "",
        f"| offered load | offered requests/s | batching | achieved requests/s | busy | p50 latency (s) | p99 latency (s) "
        f"| p99 / static | p99 / padded static | p99 of requests <= {SHORT_TOKENS} tokens (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load in loads:
        results = replay_modes(runtime, sources, load * capacity, duration_s, modes, repeats)
        bases = (results[static_name], results[padded_name])
        prefix = f"| {load:.0%} | {load * capacity:.1f} |"
        for name, run in results.items():
            ratios = " | ".join("" if run is base else f"{run.p99_s / base.p99_s:.2f}x" for base in bases)
            lines.append(f"{prefix} {name} | {run.requests_per_s:.1f} | {run.busy_share:.0%} | {run.p50_s:.3f} | {run.p99_s:.3f} "
                         f"| {ratios} | {run.p99_short_s:.3f} |")  # fmt: skip
        floor = " | ".join(f"{alone_p99 / base.p99_s:.2f}x" for base in bases)
        lines.append(f"{prefix} each request alone (the floor) | | | {alone_p50:.3f} | {alone_p99:.3f} | {floor} | |")
        logger.info("open loop at %.0f%% of static capacity done", 100 * load)
    return "\n".join(lines)
