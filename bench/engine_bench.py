"""nmt-bench: our engine against PyTorch and CTranslate2 on the same weights, interleaved; writes bench/results/engine.md."""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-bench", "dev", ("torch", "onnx", "sacrebleu"))

from nmt_serve.bench.matmul_ceiling import MatmulCeiling
from nmt_serve.bench.open_loop import run_open_loop
from nmt_serve.bench.random_model import build_random_checkpoint
from nmt_serve.bench.report import rotated, write_report
from nmt_serve.bench.systems import Cell, CTranslate2System, EngineSystem, System, TorchSystem, add_cell_arguments, cells_from
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.runtime.native_kernels import DEFAULT_LIBRARY
from nmt_serve.runtime.ort_step import available_providers
from nmt_serve.server.engine.jobs import StepProfile
from nmt_serve.server.engine.sessions import host_work_description

logger = logging.getLogger(__name__)


def build_systems(checkpoint: Path, model_dirs: dict[str, Path], work: Path, threads: int, with_ct2: bool, workers: int = 1,
                  torch_device: str = "cpu", native_kernels: bool = True) -> list[System]:  # fmt: skip
    """workers: translators working in parallel per system, `threads` each (our engines; CTranslate2's
    inter_threads); PyTorch has no such setting and runs on workers x threads threads. native_kernels: each of our
    model dirs a second time on the native attention kernels, where they are built and the engines run on the CPU."""
    systems: list[System] = [TorchSystem(checkpoint, threads * workers, torch_device)]
    if with_ct2:
        from nmt_serve.bench.ct2_convert import convert_checkpoint

        tokenizer = load_checkpoint(checkpoint).tokenizer
        tokens = tokenizer.token_strings()
        for quantization, label in ((None, "fp32"), ("int8", "int8")):
            ct2_dir = convert_checkpoint(checkpoint, work / f"ct2-{label}", quantization)
            systems.append(CTranslate2System(ct2_dir, tokens, threads, label, workers))
    for label, model_dir in model_dirs.items():
        systems.append(EngineSystem(model_dir, threads, label, engines=workers))
    systems += native_systems(model_dirs, threads, workers) if native_kernels else []
    # The ceiling is per engine; with several workers the memory system is shared and it would not bound. It times
    # ONNX Runtime's CPU kernels, so it bounds nothing where the engines run on CUDA.
    if workers == 1 and available_providers()[0] == "CPUExecutionProvider":
        systems += [MatmulCeiling(model_dir, threads, label) for label, model_dir in model_dirs.items() if label in TARGETS]
    return systems


def native_systems(model_dirs: dict[str, Path], threads: int, workers: int = 1) -> list[System]:
    """Our model dirs on the native attention kernels (runtime/native_kernels.py), labelled '<precision> native'; none
    where the library is not built or the engines run on CUDA (the kernels are CPU kernels)."""
    if not DEFAULT_LIBRARY.is_file() or available_providers()[0] != "CPUExecutionProvider":
        logger.info("native kernels not built (%s) or not on a CPU: no native systems", DEFAULT_LIBRARY)
        return []
    return [EngineSystem(model_dir, threads, f"{label} native", engines=workers, native_kernels=str(DEFAULT_LIBRARY))
            for label, model_dir in model_dirs.items()]  # fmt: skip


def time_cells(systems: list[System], sources: list[list[int]], cells: list[Cell], repeats: int) -> dict[tuple[Cell, str], list[float]]:
    """tokens/s per (cell, system); systems interleaved within every repeat so drift hits all alike."""
    results: dict[tuple[Cell, str], list[float]] = {}
    for cell in cells:
        batch = sources[: cell.batch]
        for system in systems:
            system.run(batch, cell)  # warm-up: allocations and caches at this shape
        for repeat in range(repeats):
            for system in rotated(systems, repeat):
                started = time.perf_counter()
                tokens = system.run(batch, cell)
                results.setdefault((cell, system.name), []).append(tokens / (time.perf_counter() - started))
        logger.info("cell batch=%d beam=%d done", cell.batch, cell.beam)
    return results


def format_table(title: str, systems: list[System], cells: list[Cell], results: dict[tuple[Cell, str], list[float]]) -> str:
    names = [system.name for system in systems]
    lines = [f"### {title}", "", "Median target tokens/s (ratio of fp32 and fp16 to the best fp32 peer; of int8 to CTranslate2 int8).",
             f"The nmt-serve engine's host work: {host_work_description()}.", ""]
    lines.append("| batch | beam | " + " | ".join(names) + " |")
    lines.append("|---|---|" + "---|" * len(names))
    for cell in cells:
        medians = {name: statistics.median(results[(cell, name)]) for name in names}
        fp32_peers = [medians[name] for name in names if not name.startswith("nmt-serve") and "int8" not in name]
        best_peer = max(fp32_peers)
        row = []
        for name in names:
            value = f"{medians[name]:.0f}"
            if name.startswith("nmt-serve") and ("fp32" in name or "fp16" in name):
                value += f" ({medians[name] / best_peer:.2f}x)"
            elif name.startswith("nmt-serve") and "int8" in name and "ctranslate2 int8" in medians:
                value += f" ({medians[name] / medians['ctranslate2 int8']:.2f}x)"
            row.append(value)
        lines.append(f"| {cell.batch} | {cell.beam} | " + " | ".join(row) + " |")
    return "\n".join(lines)


TARGETS = {"fp32": 1.15, "int8": 1.15}  # per cell: ours fp32 against the best fp32 peer, ours int8 against CTranslate2 int8


def decoder_calls_alone(system: System, cell: Cell, ours: float) -> float | None:
    """`ours` (tokens/s) as it would be if only the engine's decoder calls took time: no encoder, no host work. None
    where the system kept no step profile. Below a target, no change to the host or the encoder can reach it."""
    profile = getattr(system, "cell_profiles", {}).get(cell)
    if profile is None or profile.decode_s <= 0:
        return None
    return ours * profile.total_s / profile.decode_s


def format_ceilings(systems: list[System], cells: list[Cell], results: dict[tuple[Cell, str], list[float]]) -> str:
    """Per cell and precision: the MatMuls-alone ceiling (bench/matmul_ceiling.py) against ours and against the target,
    and ours with its decoder calls alone (decoder_calls_alone) against the target."""
    medians = {key: statistics.median(values) for key, values in results.items()}
    names = [system.name for system in systems]
    by_name = {system.name: system for system in systems}
    fp32_peers = [name for name in names if not name.startswith("nmt-serve") and "int8" not in name]
    precisions = [label for label in TARGETS if f"nmt-serve {label} MatMuls alone" in names]
    lines = [("Ceilings: the decoder's weight MatMuls alone, one ONNX Runtime call per step at the step's rows, interleaved with the"
             " systems above (medians of the same repeats). Nothing else of a step is in them (attention, layer norms, log-softmax,"
             " the encoder, the engine's host work), so no engine over these kernels and weights can pass them; a ceiling / target"
             " below 1.00x means the target cannot be reached with them. Decoder calls alone: our tokens/s as they would be if the"
             " engine's decoder calls were all of its time (its step profile below: no encoder, no host work); below 1.00x of the"
             " target, only a faster decoder call can reach it."), "",
             "| batch | beam | rows per step | " + " | ".join(f"{p} MatMuls alone | ours {p} | {p} target | {p} ceiling / target | "
                                                               f"ours {p}, decoder calls alone / target" for p in precisions) + " |",
             "|---|---|---|" + "---|---|---|---|---|" * len(precisions)]  # fmt: skip
    for cell in cells:
        row = [str(cell.batch), str(cell.beam), str(cell.batch * cell.beam)]
        for precision in precisions:
            peers = (
                [medians[(cell, name)] for name in fp32_peers] if precision == "fp32" else [medians.get((cell, "ctranslate2 int8"), 0.0)]
            )
            target = TARGETS[precision] * max(peers, default=0.0)
            ceiling, ours = medians[(cell, f"nmt-serve {precision} MatMuls alone")], medians[(cell, f"nmt-serve {precision}")]
            calls_alone = decoder_calls_alone(by_name[f"nmt-serve {precision}"], cell, ours)
            row += [f"{ceiling:.0f}", f"{ours:.0f}", f"{target:.0f}" if target else "n/a", f"{ceiling / target:.2f}x" if target else "n/a",
                    f"{calls_alone:.0f} ({calls_alone / target:.2f}x)" if calls_alone is not None and target else "n/a"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_profiles(model: str, systems: list[EngineSystem]) -> str:
    """Share of engine step time by part, per cell (warm-up runs included): ONNX Runtime (encoder, decoder)
    against the engine's own numpy and Python (search, cache moves, bookkeeping)."""
    parts = list(StepProfile().shares())
    lines = [f"Where {model}-model engine step time goes, per cell (host = search + cache moves + bookkeeping; a cache slot"
             " is one row's K and V of every layer at one position):", "",
             "| batch | beam | system | steps | " + " | ".join(parts) + " | host | cache slots copied per step |",
             "|---|---|---|---|" + "---|" * (len(parts) + 2)]  # fmt: skip
    host_parts = [part for part in parts if part not in ("encoder run", "decoder run")]
    for cell in systems[0].cell_profiles:
        for system in systems:
            profile = system.cell_profiles[cell]
            shares = profile.shares()
            columns = " | ".join(f"{100 * shares[part]:.0f}%" for part in parts)
            host, copied = 100 * sum(shares[part] for part in host_parts), profile.slots_copied / max(profile.steps, 1)
            lines.append(f"| {cell.batch} | {cell.beam} | {system.name} | {profile.steps} | {columns} | {host:.0f}% | {copied:.1f} |")
    return "\n".join(lines)


def exported_dir(checkpoint: Path, precision: str, parity_test: Path | None) -> Path:
    """CHECKPOINT/onnx-PRECISION, exported there by nmt-export (its parity report included) when it is missing."""
    model_dir = checkpoint / f"onnx-{precision}"
    if not (model_dir / "manifest.json").is_file():
        from nmt_serve.export.onnx_export import main as export_main

        parity = ["--parity-test", str(parity_test), "--parity-limit", "100"] if parity_test is not None and parity_test.is_file() else []
        if export_main([str(checkpoint), "--out", str(model_dir), "--precision", precision, *parity]) != 0:
            raise SystemExit(f"nmt-export {checkpoint} --precision {precision} failed")
    return model_dir


def sample_sources(test: Path | None, count: int, vocab_size: int, checkpoint: Path, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if test is not None and test.is_file():
        tokenizer = load_checkpoint(checkpoint).tokenizer
        pairs = rng.sample(read_tsv(str(test)), count)
        return tokenizer.encode_batch([src for src, _ in pairs])
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(12, 24))] for _ in range(count)]


def metrics_cost(model_dir: Path, sources: list[list[int]], threads: int, repeats: int, length: int) -> str:
    """Engine throughput with and without the server's metrics observations, interleaved (target: under 2% cost)."""
    plain, metered = EngineSystem(model_dir, threads, "int8"), EngineSystem(model_dir, threads, "int8 + metrics", metrics=True)
    cells = [Cell(batch, beam, length) for batch, beam in ((1, 1), (8, 1), (32, 1), (8, 4))]
    results = time_cells([plain, metered], sources, cells, repeats)
    lines = [f"### Cost of metrics on engine throughput (default model, int8, {threads} thread(s), median of {repeats})", "",
             "| batch | beam | without metrics (tokens/s) | with metrics (tokens/s) | cost |", "|---|---|---|---|---|"]  # fmt: skip
    for cell in cells:
        without, with_metrics = (statistics.median(results[(cell, system.name)]) for system in (plain, metered))
        lines.append(f"| {cell.batch} | {cell.beam} | {without:.0f} | {with_metrics:.0f} | {100 * (1 - with_metrics / without):+.1f}% |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-bench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--checkpoint", type=Path, default=Path("artifacts/de-en-small"))
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="source sentences (random ids when missing)")
    add_cell_arguments(parser, repeats=3)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime / CTranslate2 intra-op threads per worker")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="parallel translators per system: our engines (nmt-serve --engines), CTranslate2 inter_threads",
    )
    parser.add_argument("--models", default="default,base", help="default (the shipped model) and/or base (random d512 6+6 V32k)")
    parser.add_argument("--no-ct2", action="store_true", help="skip CTranslate2 (when it is not installed)")
    parser.add_argument("--no-native-kernels", action="store_true",
                        help="skip our model dirs on the native attention kernels (run by default where nmt-build-kernels built them)")
    parser.add_argument(
        "--precisions",
        default="fp32,int8",
        help="exported precisions of ours to time (fp32, int8, fp16); the default model's are read from CHECKPOINT/onnx-P, exported there first when missing",
    )
    parser.add_argument("--torch-device", default="cpu", help="where the PyTorch peer runs (cpu, cuda)")
    parser.add_argument("--open-loop-seconds", type=float, default=30.0, help="per batching mode; 0 skips the open-loop run")
    parser.add_argument("--open-loop-row-caps", default="32", help="comma-separated row caps of the capped continuous modes")
    parser.add_argument("--open-loop-repeats", type=int, default=3, help="rounds of the open loop, each with its own arrivals (medians)")
    parser.add_argument("--metrics-cost-repeats", type=int, default=7, help="repeats of the metrics-cost table; 0 skips it")
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    precisions = [p for p in args.precisions.split(",") if p]
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models.split(","):
            if model == "default":
                checkpoint, model_dirs = args.checkpoint, {p: exported_dir(args.checkpoint, p, args.test) for p in precisions}
                test = args.test
            else:
                checkpoint, model_dirs = build_random_checkpoint(work / "base", precisions=precisions)
                test = None
            systems = build_systems(checkpoint, model_dirs, work / model, args.threads, not args.no_ct2, args.workers, args.torch_device,
                                    not args.no_native_kernels)  # fmt: skip
            # torch and the systems' objects frozen: a full collection (~80 ms over ~170k objects) would
            # otherwise land in a random cell of a random system.
            gc.freeze()
            vocab = load_checkpoint(checkpoint).config.vocab_size
            sources = sample_sources(test, max(32, *(c.batch for c in cells)), vocab, checkpoint)  # 32: the metrics-cost cells
            results = time_cells(systems, sources, cells, args.repeats)
            parallel = f", {args.workers} workers x" if args.workers > 1 else ","
            translators = [s for s in systems if not isinstance(s, MatmulCeiling)]
            sections.append(
                format_table(f"{model} model, output length {args.length}{parallel} {args.threads} threads", translators, cells, results)
            )
            if len(translators) < len(systems):
                sections.append(format_ceilings(systems, cells, results))
            sections.append(format_profiles(model, [s for s in systems if isinstance(s, EngineSystem)]))
            if model == "default" and args.open_loop_seconds > 0:
                # The served default precision (server/settings.py) when it is among the systems.
                engines = [s for s in systems if isinstance(s, EngineSystem)]
                engine_system = next((s for s in engines if s.name.endswith("int8")), engines[0])
                caps = tuple(int(cap) for cap in args.open_loop_row_caps.split(",") if cap)
                sections.append(
                    f"Open-loop engine: {engine_system.name}.\n\n"
                    + run_open_loop(engine_system.runtime, sources, args.open_loop_seconds, row_caps=caps, repeats=args.open_loop_repeats)
                )
            if model == "default" and args.metrics_cost_repeats > 0 and "int8" in model_dirs:
                sections.append(metrics_cost(model_dirs["int8"], sources, args.threads, args.metrics_cost_repeats, args.length))
    write_report("Engine benchmark", "nmt-bench", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
