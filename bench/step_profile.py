"""nmt-step-profile: where a decoder step's time goes, node by node (ONNX Runtime's profiler), per model dir and cell.

Each model dir runs the engine as nmt-bench does (forced output length, one thread). A run without the profiler
times the step and splits it between the decoder call and the host's work around it; a second, profiled run of
the same cell sums its kernel times by kind (weight MatMuls, activation quantization, attention, ...). The profiler
lengthens every kernel by a roughly fixed amount, so the kinds are read as shares, not as times.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-step-profile", "dev", ('torch', 'onnx', 'sacrebleu'))

from nmt_serve.bench.engine_bench import sample_sources
from nmt_serve.bench.report import write_report
from nmt_serve.bench.systems import Cell, EngineSystem, add_cell_arguments, cells_from
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.server.engine.jobs import StepProfile

logger = logging.getLogger(__name__)

# QuantizedMatMul: the native kernels' fused int8 product (runtime/quantized_matmul_fusion.py), its row quantization,
# bias and ReLU or residual included; FloatMatMul the fused float one (runtime/float_matmul_fusion.py), its bias and
# ReLU or residual included; RowQuantize and GroupedCrossAttention their other fused nodes.
WEIGHT_MATMULS = frozenset({"MatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits", "Gemm", "FusedMatMul",
                            "QGemm", "QuantizedMatMul",
                            "FloatMatMul"})  # fmt: skip
ATTENTION = frozenset({"MultiHeadAttention", "GroupQueryAttention", "Attention", "DecoderMaskedMultiHeadAttention",
                       "GroupedCrossAttention"})  # fmt: skip
LAYER_NORMS = frozenset({"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization"})
OUTPUT_SEARCH = frozenset({"LogSoftmax", "TopK"})
EMBEDDINGS = frozenset({"Gather", "DequantizeLinear"})
ACTIVATION_QUANTIZATION = "activation quantization"
# The node kinds of the table, in its column order.
KINDS = ("weight MatMuls", ACTIVATION_QUANTIZATION, "attention", "layer norms", "adds", "log-softmax, top-k", "embeddings", "other nodes")


def node_kind(op_type: str, node_name: str) -> str:
    """The kind of one profiled kernel. Per-row quantization nodes are plain Abs/ReduceMax/Mul/...: the exporter
    names them `<quantizer>.row.*` and their rescales `*.row_rescale` (export/row_quantization.py)."""
    if op_type in ("DynamicQuantizeLinear", "RowQuantize") or ".row." in node_name or node_name.endswith(".row_rescale"):
        return ACTIVATION_QUANTIZATION
    if op_type in WEIGHT_MATMULS:
        return "weight MatMuls"
    if op_type in ATTENTION:
        return "attention"
    if op_type in LAYER_NORMS:
        return "layer norms"
    if op_type == "Add":
        return "adds"
    if op_type in OUTPUT_SEARCH:
        return "log-softmax, top-k"
    if op_type in EMBEDDINGS:
        return "embeddings"
    return "other nodes"


@dataclass
class NodeTimes:
    """Kernel microseconds of the runs kept, by kind, by node and by operator."""

    runs: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    by_node: Counter[str] = field(default_factory=Counter)
    by_op: Counter[str] = field(default_factory=Counter)


def read_profile(path: Path, keep_last_runs: int) -> NodeTimes:
    """The last `keep_last_runs` runs of an ONNX Runtime profile file (earlier runs are warm-up)."""
    events = json.loads(path.read_text(encoding="utf-8"))
    runs = sorted((event for event in events if event.get("cat") == "Session" and event.get("name") == "model_run"), key=lambda event: event["ts"])
    kept = runs[-keep_last_runs:]
    times = NodeTimes(runs=len(kept))
    if not kept:
        return times
    start = kept[0]["ts"]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time") or event["ts"] < start:
            continue
        name = event["name"].removesuffix("_kernel_time")
        op_type = event.get("args", {}).get("op_name", "")
        times.by_kind[node_kind(op_type, name)] += event["dur"]
        times.by_node[f"{name} ({op_type})"] += event["dur"]
        times.by_op[op_type] += event["dur"]
    return times


@dataclass
class CellProfile:
    steps: int
    engine: StepProfile
    nodes: NodeTimes

    def kernel_shares(self) -> dict[str, float]:
        """Each kind's share of the profiled run's kernel time."""
        total = max(sum(self.nodes.by_kind.values()), 1e-9)
        return {kind: self.nodes.by_kind.get(kind, 0) / total for kind in KINDS}

    def step_shares(self) -> dict[str, float]:
        """The unprofiled step (encoder runs left out: the step is the decoder's): the decoder call, and the host's
        work outside it (search, cache moves, bookkeeping)."""
        step_s = max(self.engine.total_s - self.engine.encode_s, 1e-12)
        return {"decoder call": self.engine.decode_s / step_s, "host": (step_s - self.engine.decode_s) / step_s}

    def step_ms(self) -> float:
        return (self.engine.total_s - self.engine.encode_s) * 1e3 / max(self.steps, 1)


def run_cell(model_dir: Path, sources: list[list[int]], cell: Cell, repeats: int, threads: int, profile_prefix: str = "",
             native_kernels: str = "off") -> tuple[EngineSystem, StepProfile]:  # fmt: skip
    """The engine as nmt-bench runs it, fresh for this cell: one untimed pass, then `repeats`; the engine's profile of those."""
    system = EngineSystem(model_dir, threads, model_dir.name, decoder_profile_prefix=profile_prefix, native_kernels=native_kernels)
    batch = sources[: cell.batch]
    system.run(batch, cell)
    before = replace(system.cell_profiles[cell])
    for _ in range(repeats):
        system.run(batch, cell)
    return system, system.cell_profiles[cell] - before


def profile_cell(model_dir: Path, sources: list[list[int]], cell: Cell, repeats: int, threads: int, work: Path,
                 native_kernels: str = "off") -> CellProfile:  # fmt: skip
    """The step timed without the profiler (it multiplies a small step's time several times over), then the node
    times from a profiled run of the same cell, in a runtime of its own so that its profile file holds this cell alone."""
    _, plain = run_cell(model_dir, sources, cell, repeats, threads, native_kernels=native_kernels)
    prefix = str(work / f"{model_dir.name}-b{cell.batch}-k{cell.beam}")
    system, profiled = run_cell(model_dir, sources, cell, repeats, threads, prefix, native_kernels)
    nodes = read_profile(Path(system.runtime.decoder.end_profiling()), profiled.steps)
    return CellProfile(steps=plain.steps, engine=plain, nodes=nodes)


def format_tables(profiles: dict[str, dict[Cell, CellProfile]], cells: list[Cell], top: int) -> str:
    sections = []
    for label, by_cell in profiles.items():
        lines = [f"### {label}", "",
                 "| cell | step (ms) | decoder call | host | " + " | ".join(KINDS) + " |", "|---|---|---|---|" + "---|" * len(KINDS)]  # fmt: skip
        for cell in cells:
            profile = by_cell[cell]
            step, kernels = profile.step_shares(), profile.kernel_shares()
            lines.append(f"| b{cell.batch} k{cell.beam} | {profile.step_ms():.3f} | {100 * step['decoder call']:.1f}% | {100 * step['host']:.1f}% | "
                         + " | ".join(f"{100 * kernels[kind]:.1f}%" for kind in KINDS) + " |")  # fmt: skip
        largest = max(cells, key=lambda cell: cell.batch * cell.beam)
        nodes = by_cell[largest].nodes
        total = max(sum(nodes.by_node.values()), 1e-9)
        lines += ["", f"Its {top} slowest nodes at b{largest.batch} k{largest.beam} (share of the kernel time):", "", "| node (op) | share |", "|---|---|"]
        lines += [f"| `{name}` | {100 * us / total:.1f}% |" for name, us in nodes.by_node.most_common(top)]
        sections.append("\n".join(lines))
    legend = ("Step: the engine's decoder step without the profiler (encoder runs left out), split into the decoder call "
              "and the host's work outside it (search, cache moves, bookkeeping). The node kinds are shares of the kernel "
              "time of a second, profiled run of the same cell: ONNX Runtime's profiler lengthens every kernel by a "
              "roughly fixed amount, so at small batches the kinds made of many small nodes (activation quantization, "
              "adds) are overstated.")
    return legend + "\n\n" + "\n\n".join(sections)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-step-profile", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, action="append", default=None,
                        help="a model dir to profile, LABEL=DIR to name it (repeatable; default: the shipped fp32 and int8 dirs)")  # fmt: skip
    parser.add_argument("--checkpoint", type=Path, default=Path("artifacts/de-en-small"), help="its tokenizer encodes the sampled sources")
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="sources sampled from it (random ids without it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--native-kernels", default="off", help="'auto' or a library path: the engine on the native kernels with "
                        "the runtime's fusions, as the server runs it where they are built (runtime/native_kernels.py); "
                        "'off': ONNX Runtime's own")  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="slowest nodes listed per model dir")
    add_cell_arguments(parser, repeats=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/step-profile.md"))
    return parser


def labelled_dirs(values: Sequence[Path] | None, checkpoint: Path) -> dict[str, Path]:
    if not values:
        return {"fp32": checkpoint / "onnx-fp32", "int8": checkpoint / "onnx-int8"}
    dirs = {}
    for value in values:
        label, _, path = str(value).rpartition("=")
        dirs[label or Path(path).name] = Path(path)
    return dirs


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    dirs = labelled_dirs(args.model_dir, args.checkpoint)
    vocab_size = load_model_dir(next(iter(dirs.values()))).config.vocab_size
    sources = sample_sources(args.test, max(cell.batch for cell in cells), vocab_size, args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {label: {cell: profile_cell(path, sources, cell, args.repeats, args.threads, Path(tmp), args.native_kernels)
                            for cell in cells} for label, path in dirs.items()}  # fmt: skip
    write_report("Decoder step profile", "nmt-step-profile", argv, [format_tables(profiles, cells, args.top)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
