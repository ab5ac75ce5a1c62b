"""nmt-join-policy: how long newcomers wait to join a busy batch (EngineLimits.join_wait_steps) against latency.

The same Poisson arrivals (bench/open_loop.py's mix) are replayed several times through the engine
for each join wait, and once through static batching; medians over the replays. Engine time per
request is the step time spent per served request: the work, whatever the wall clock did.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-join-policy", "dev", ('torch', 'onnx', 'sacrebleu'))

from nmt_serve.bench.engine_bench import sample_sources
from nmt_serve.bench.open_loop import SERVER_JOINS, Run, drive, median_run, poisson_arrivals
from nmt_serve.bench.report import write_report
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("artifacts/de-en-small/onnx-int8")
JOIN_GROUP = SERVER_JOINS[1]  # the server's; the wait is what varies


def engine_ms_per_request(run: Run) -> float:
    return 1e3 * run.busy_share / run.requests_per_s


def compare_waits(runtime: Runtime, sources: Sequence[list[int]], rates: Sequence[float], waits: Sequence[int], seconds: float,
                  replays: int) -> str:  # fmt: skip
    lines = ["| offered requests/s | batching | engine ms per request | p50 latency (s) | p99 latency (s) | achieved requests/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for rate in rates:
        arrivals = poisson_arrivals(sources, rate, seconds, seed=5)
        for wait in waits:
            runs = [drive(runtime, arrivals, True, joins=(wait, JOIN_GROUP)) for _ in range(replays)]
            lines.append(format_row(rate, f"continuous, joins wait up to {wait} steps", runs))
        lines.append(format_row(rate, "static", [drive(runtime, arrivals, False) for _ in range(replays)]))
        logger.info("%.0f requests/s done", rate)
    return "\n".join(lines)


def format_row(rate: float, name: str, runs: list[Run]) -> str:
    # Engine time per request is the median of each replay's own ratio; the other columns are median_run's.
    ms_per_request, median = statistics.median(engine_ms_per_request(run) for run in runs), median_run(runs)
    return f"| {rate:.0f} | {name} | {ms_per_request:.2f} | {median.p50_s:.3f} | {median.p99_s:.3f} | {median.requests_per_s:.1f} |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nmt-join-policy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="source sentences (random ids when missing)")
    parser.add_argument("--rates", default="60,90,110", help="offered requests/s, comma-separated")
    parser.add_argument("--waits", default="0,2,4,8", help=f"join_wait_steps values, comma-separated (join group: {JOIN_GROUP})")
    parser.add_argument("--seconds", type=float, default=8.0, help="arrivals per replay")
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/join_policy.md"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    runtime = Runtime(args.model_dir, RuntimeSettings(intra_op_threads=args.threads, warmup_rows=8, warmup_src_len=16))
    runtime.warm_up()
    checkpoint = args.model_dir.parent
    sources = sample_sources(args.test, 64, runtime.config.vocab_size, checkpoint)
    gc.freeze()  # start-up objects out of the collector's way, as the server does after warm-up
    table = compare_waits(runtime, sources, [float(rate) for rate in args.rates.split(",")], [int(wait) for wait in args.waits.split(",")],
                          args.seconds, args.replays)  # fmt: skip
    title = (f"### Join policy: the same {args.seconds:.0f} s of Poisson arrivals (open-loop mix: output 4..48 tokens, forced; 1 in 4 "
             f"beam 4) replayed {args.replays} times per row, medians; {runtime.manifest.precision}, {args.threads} thread(s)")  # fmt: skip
    write_report("Join policy", "nmt-join-policy", argv, [title, table], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
