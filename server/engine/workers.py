"""How many engines (each a worker thread stepping its own batch), ONNX Runtime threads per session and rows per step to run.

On a CPU the engines are replicas sharing one pair of sessions: a decoder step's cost grows about
linearly with its rows past a few (default int8 model, one thread: 0.5 ms at 1 row, 1.0 ms at 10,
1.9 ms at 20, 3.7 ms at 40), so a bigger batch buys little, and ONNX Runtime's intra-op threads
split this model's small kernels badly: a burst of 400 mixed requests ran at 129-141 requests/s
with one engine on 2 threads, 180-201 with one engine on 1 thread, and 277-351 with two engines on
1 thread each (2 cores; ONNX Runtime releases the GIL while it runs, so the engines' runs overlap).
A GPU runs one call at a time anyway: one engine there.

Chosen automatically, engines stop at MAX_AUTO_ENGINES and more cores go to intra-op threads: each
engine spends about a quarter of its step in Python (search, cache layout), which holds the GIL,
so past about four engines they would queue for it (reasoned from that share; only 2 cores were
measured).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_AUTO_ENGINES = 4
# Rows per decoder call of each engine, when not given. On a CPU a step costs about the same per row
# past 16-32 rows, so a larger batch buys no throughput (bursts of 300 requests, int8, one thread: 32
# against 128 rows 1.03x beam 4, 0.99x greedy); it only makes every request in it wait longer per step.
# Capped, newcomers queue first come, first served, and the tail under heavy load shrinks (open loop at
# ~90% of capacity, 60 s x 3 seeds: p99 0.202 s against 0.307 s; docs/benchmarks.md).
# A GPU step's cost grows far more slowly with its rows, so there the larger batch stays (unmeasured).
CPU_AUTO_ROWS = 32
GPU_AUTO_ROWS = 128


@dataclass(frozen=True)
class WorkerPlan:
    engines: int
    threads: int  # intra-op threads of each session; 0 = ONNX Runtime's default (GPU)
    max_rows: int  # rows (beams included) in one decoder call of each engine


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which taskset and container cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_workers(engines: int, threads: int, on_gpu: bool, cores: int, max_rows: int = 0) -> WorkerPlan:
    """engines / threads / max_rows as configured, 0 = chosen: on a CPU one engine per core (up to
    MAX_AUTO_ENGINES) with the cores shared out as threads, or the cores shared out around the one given,
    and CPU_AUTO_ROWS rows per call; on a GPU one engine of GPU_AUTO_ROWS rows."""
    if on_gpu:
        return WorkerPlan(engines or 1, threads, max_rows or GPU_AUTO_ROWS)
    if engines and threads:
        if engines * threads > cores:
            logger.warning("%d engines x %d threads is more than the %d cores available: they will time-share", engines, threads, cores)
    elif engines:
        threads = max(1, cores // engines)
    elif threads:
        engines = max(1, min(MAX_AUTO_ENGINES, cores // threads))
    else:
        engines = max(1, min(MAX_AUTO_ENGINES, cores))
        threads = max(1, cores // engines)
    return WorkerPlan(engines, threads, max_rows or CPU_AUTO_ROWS)
