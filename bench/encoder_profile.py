"""nmt-encoder-profile: where an encoder call's time goes, node by node, and what one in-memory fusion buys it.

The encoder session as the runtime makes it on the native kernels (every fusion of runtime/native_fusions.py), and the
same session made without one fusion (--without), are timed interleaved at each batch of sources, medians of the
repeats; then a profiled session of each (ONNX Runtime's profiler) sums its kernel time by operator at the largest
batch. The profiler lengthens every kernel by a roughly fixed amount, so the operators are read as shares.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-encoder-profile", "dev", ("torch", "onnx", "sacrebleu"))

import onnxruntime as ort

from nmt_serve.bench.engine_bench import sample_sources
from nmt_serve.bench.report import write_report
from nmt_serve.bench.step_profile import NodeTimes, read_profile
from nmt_serve.model.padding import pad_sources
from nmt_serve.runtime import native_fusions
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.native_kernels import resolve_native_kernels
from nmt_serve.runtime.ort_step import make_session

logger = logging.getLogger(__name__)

CPU = ["CPUExecutionProvider"]
CALLS_PER_SAMPLE = 200  # source rows per timed sample: a sample of small calls lasts about as long as one of large ones


@contextlib.contextmanager
def fusions_without(fusion: str) -> Iterator[None]:
    """Sessions made inside leave `fusion` (a runtime/native_fusions.py FUSIONS name) out; the table is restored after."""
    if fusion not in native_fusions.FUSIONS:
        raise SystemExit(f"--without must name one of the runtime's fusions ({', '.join(native_fusions.FUSIONS)}), got {fusion!r}")
    kept = dict(native_fusions.FUSIONS)
    del native_fusions.FUSIONS[fusion]
    try:
        yield
    finally:
        native_fusions.FUSIONS.clear()
        native_fusions.FUSIONS.update(kept)


def encoder_sessions(model_dir: Path, library: Path, without: str, threads: int,
                     profile_prefix: str = "") -> dict[str, ort.InferenceSession]:  # fmt: skip
    path = load_model_dir(model_dir).graph_path(model_dir, "encoder")
    sessions = {"every fusion": make_session(path, CPU, threads, profile_prefix and f"{profile_prefix}-with", library)}
    with fusions_without(without):
        sessions[f"without the {without}"] = make_session(path, CPU, threads, profile_prefix and f"{profile_prefix}-without", library)
    return sessions


def time_calls(sessions: dict[str, ort.InferenceSession], feeds: dict, outputs: list[str], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each session, its samples interleaved with the others'."""
    samples: dict[str, list[float]] = {label: [] for label in sessions}
    for session in sessions.values():
        session.run(outputs, feeds)  # warm-up
    for _ in range(repeats):
        for label, session in sessions.items():
            start = time.perf_counter()
            for _ in range(calls):
                session.run(outputs, feeds)
            samples[label].append((time.perf_counter() - start) / calls)
    return {label: statistics.median(values) for label, values in samples.items()}


def profile_calls(sessions: dict[str, ort.InferenceSession], feeds: dict, outputs: list[str], calls: int) -> dict[str, NodeTimes]:
    for session in sessions.values():
        session.run(outputs, feeds)
        for _ in range(calls):
            session.run(outputs, feeds)
    return {label: read_profile(Path(session.end_profiling()), calls) for label, session in sessions.items()}


def format_tables(timings: dict[int, tuple[int, dict[str, float]]], profiles: dict[str, NodeTimes], batch: int, top: int) -> str:
    labels = list(profiles)
    lines = ["Median milliseconds per encoder call, the sessions interleaved; ratio: without / with every fusion.", "",
             "| batch | source positions (real) | " + " | ".join(labels) + " | ratio |",
             "|---|---|" + "---|" * (len(labels) + 1)]  # fmt: skip
    for size, (real, medians) in timings.items():
        ms = [medians[label] * 1e3 for label in labels]
        lines.append(f"| {size} | {real} | " + " | ".join(f"{value:.3f}" for value in ms) + f" | {ms[1] / ms[0]:.2f}x |")
    lines += ["", f"Share of the profiled kernel time by operator at batch {batch} (the {top} largest of either session):", "",
              "| operator | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]  # fmt: skip
    shares = {label: {op: us / max(sum(times.by_op.values()), 1e-9) for op, us in times.by_op.items()} for label, times in profiles.items()}
    largest = sorted({op for label in labels for op, _ in profiles[label].by_op.most_common(top)},
                     key=lambda op: -max(shares[label].get(op, 0.0) for label in labels))  # fmt: skip
    lines += [f"| {op} | " + " | ".join(f"{100 * shares[label].get(op, 0.0):.1f}%" for label in labels) + " |" for op in largest]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-encoder-profile", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=Path("artifacts/de-en-small/onnx-int8"))
    parser.add_argument("--checkpoint", type=Path, default=Path("artifacts/de-en-small"), help="its tokenizer encodes the sampled sources")
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="sources sampled from it (random ids without it)")
    parser.add_argument("--native-kernels", default="auto", help="'auto' (the built library) or a library path")
    parser.add_argument("--without", default="encoder attention head layouts", help="the fusion the second session leaves out")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated numbers of sources per call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="timed samples of each session, interleaved")
    parser.add_argument("--top", type=int, default=10, help="operators listed from each session's profile")
    parser.add_argument("--out", type=Path, default=Path("bench/results/encoder-profile.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    kernels = resolve_native_kernels(args.native_kernels)
    if kernels is None:
        raise SystemExit("--native-kernels: no library to run the fusions on; build it with `nmt-build-kernels`")
    manifest = load_model_dir(args.model_dir)
    config, outputs = manifest.config, manifest.output_names("encoder")
    batches = [int(batch) for batch in args.batches.split(",")]
    sources = sample_sources(args.test, max(batches), config.vocab_size, args.checkpoint)
    feeds_of = {}
    for batch in batches:
        ids, mask = pad_sources(sources[:batch], config.pad_id, config.eos_id)
        feeds_of[batch] = {"src_ids": ids, "src_mask": mask}
    sessions = encoder_sessions(args.model_dir, kernels.path, args.without, args.threads)
    timings = {}
    for batch, feeds in feeds_of.items():
        calls = max(1, CALLS_PER_SAMPLE // batch)
        timings[batch] = (int(feeds["src_mask"].sum()), time_calls(sessions, feeds, outputs, calls, args.repeats))
        logger.info("batch %d timed", batch)
    with tempfile.TemporaryDirectory() as tmp:
        profiled = encoder_sessions(args.model_dir, kernels.path, args.without, args.threads, str(Path(tmp) / "encoder"))
        profiles = profile_calls(profiled, feeds_of[max(batches)], outputs, max(1, CALLS_PER_SAMPLE // max(batches)))
    write_report("Encoder call profile", "nmt-encoder-profile", argv, [format_tables(timings, profiles, max(batches), args.top)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
