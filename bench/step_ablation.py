"""nmt-step-ablation: what each part of the decoder step really costs, measured by taking it out of the graph.

ONNX Runtime's profiler lengthens every kernel by a roughly fixed amount (nmt-step-profile), so its shares overstate
the many small nodes and understate what a kernel loses to the step around it: an attention kernel that runs in 38 us
on a warm cache in a loop of its own can take four times that inside the step, as much as it takes alone right after
a sweep through 64 MB of other memory. Here the decoder call is timed without the profiler, as the
engine makes it (IO binding, each present K/V bound to its past's memory), once as exported and once per variant
with one part removed; the difference is what that part costs in place. The variants compute nothing useful: they
are timing instruments, never served. Beside them, in the same rounds, the decoder's weight products alone
(bench/matmul_ceiling.py) at the same rows: what is left of the call once they and attention are taken away is
everything else (layer norms, residual adds, activation quantization, log-softmax, gathers, each node's dispatch).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TypeVar

from nmt_serve.model.extras import require_extra

require_extra("nmt-step-ablation", "dev", ("torch", "onnx"))

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from nmt_serve.bench.bound_call import BoundCall
from nmt_serve.bench.engine_bench import sample_sources
from nmt_serve.bench.matmul_ceiling import MatmulCeiling
from nmt_serve.bench.report import rotated, write_report
from nmt_serve.model.config import ModelConfig
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.native_kernels import resolve_native_kernels
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.runtime.source_group import MIN_SOURCE_WIDTH, NARROW_PREFIX, NARROW_SOURCE_WIDTH, source_width
from nmt_serve.runtime.source_layout import MIN_QUERIES
from nmt_serve.runtime.step_cache import CACHE_DTYPES, INITIAL_LENGTH

logger = logging.getLogger(__name__)

SELF_ATTENTION = "GroupQueryAttention"
CROSS_ATTENTION = "MultiHeadAttention"
AS_EXPORTED = "as exported"
WEIGHT_PRODUCTS = "weight products alone"
@dataclass(frozen=True)
class Setting:
    rows: int
    position: int  # every row's position: tokens already in its self-attention cache
    # None: the sources as sampled, bound as the engine groups and pads them. A width: every source cut to
    # MIN_SOURCE_WIDTH tokens and bound this wide in the wide group, so that calls differ only in masked columns.
    width: int | None = None


def bypassed_attention(model: onnx.ModelProto, op_type: str, config: ModelConfig) -> None:
    """Every `op_type` node replaced by its query: the first d_model channels of a packed Q/K/V (a Slice), the query
    itself otherwise; a self-attention node's present K/V outputs leave the graph with it."""
    graph = model.graph
    dropped_outputs: set[str] = set()
    nodes: list[onnx.NodeProto] = []
    if op_type == SELF_ATTENTION:
        bounds = {"ablation.start": 0, "ablation.end": config.d_model, "ablation.axis": 2}
        graph.initializer.extend(numpy_helper.from_array(np.array([value], dtype=np.int64), name) for name, value in bounds.items())
    for node in graph.node:
        if node.op_type != op_type:
            nodes.append(node)
        elif op_type == SELF_ATTENTION:
            query = [node.input[0], "ablation.start", "ablation.end", "ablation.axis"]
            nodes.append(helper.make_node("Slice", query, [node.output[0]], node.name))
            dropped_outputs.update(node.output[1:])
        else:
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name))
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [output for output in graph.output if output.name not in dropped_outputs]
    del graph.output[:]
    graph.output.extend(kept)


def bypassed_scale_nodes(model: onnx.ModelProto, _config: ModelConfig) -> None:
    """Each per-row scale max|x| / 127 becomes max(x): the Abs and the Mul of every row quantization go."""
    nodes = model.graph.node
    replaced = {node.output[0]: node.input[0] for node in nodes if node.name.endswith((".row.abs", ".row.scale"))}
    kept = [node for node in nodes if node.output[0] not in replaced]
    for node in kept:
        for index, name in enumerate(node.input):
            while name in replaced:
                name = replaced[name]
            node.input[index] = name
    del nodes[:]
    nodes.extend(kept)


def bypassed_log_softmax(model: onnx.ModelProto, _config: ModelConfig) -> None:
    for node in model.graph.node:
        if node.op_type == "LogSoftmax":
            node.op_type = "Identity"
            del node.attribute[:]


def bypassed_self_attention(model: onnx.ModelProto, config: ModelConfig) -> None:
    bypassed_attention(model, SELF_ATTENTION, config)


def bypassed_cross_attention(model: onnx.ModelProto, config: ModelConfig) -> None:
    bypassed_attention(model, CROSS_ATTENTION, config)


def bypassed_all_attention(model: onnx.ModelProto, config: ModelConfig) -> None:
    bypassed_attention(model, SELF_ATTENTION, config)
    bypassed_attention(model, CROSS_ATTENTION, config)


@dataclass(frozen=True)
class Variant:
    takes_out: str  # what the report's legend says of it
    edit: Callable[[onnx.ModelProto, ModelConfig], None]


# In the report's column order.
VARIANTS = {
    "self-attention": Variant("each cached self-attention node's output is its query; the cache is neither read nor written",
                              bypassed_self_attention),
    "cross-attention": Variant("each cross-attention node's output is its query; the encoder's K/V are not read", bypassed_cross_attention),
    "all attention": Variant("both of the above", bypassed_all_attention),
    "row-scale Abs and Mul": Variant("int8: each per-row activation scale is the row's max, not max|x| / 127 (two of its three nodes)",
                                     bypassed_scale_nodes),
    "log-softmax": Variant("the logits leave the graph as they are", bypassed_log_softmax),
}  # fmt: skip


def variant_models(decoder: Path, config: ModelConfig) -> dict[str, onnx.ModelProto]:
    """The decoder as exported and every variant that changes it (a fp32 graph has no row scales to remove)."""
    original = onnx.load(str(decoder))
    models = {AS_EXPORTED: original}
    for name, variant in VARIANTS.items():
        model = onnx.ModelProto()
        model.CopyFrom(original)
        variant.edit(model, config)
        if [node.SerializeToString() for node in model.graph.node] != [node.SerializeToString() for node in original.graph.node]:
            models[name] = model
    return models


class BoundWeightProducts(BoundCall):
    """The decoder's weight products alone (bench/matmul_ceiling.py) at `rows` rows, bound like the decoder: no output
    is allocated per call."""

    def __init__(self, ceiling: MatmulCeiling, rows: int) -> None:
        super().__init__(ceiling.session)
        for name, array in ceiling.feed(rows).items():
            self._bind(name, array)
        for name, width in ceiling.outputs:
            self._bind(name, np.zeros((rows, width), dtype=np.float32), output=True)


class BoundDecoder(BoundCall):
    """One decoder session with every input and output bound as the engine binds them, for one Setting."""

    def __init__(self, session: ort.InferenceSession, config: ModelConfig, setting: Setting, source_lengths: Sequence[int],
                 seed: int = 0) -> None:  # fmt: skip
        rows, position = setting.rows, setting.position
        rng = np.random.default_rng(seed)
        heads, head_dim = config.n_heads, config.d_model // config.n_heads
        lengths = np.array([source_lengths[row % len(source_lengths)] for row in range(rows)])
        if setting.width is not None:
            lengths = np.minimum(lengths, MIN_SOURCE_WIDTH)
        # As the engine groups them: sources of at most NARROW_SOURCE_WIDTH tokens in the narrow group, the others in the
        # wide one as wide as their longest (runtime/source_group.py). The width table binds every source in the wide group.
        is_narrow = lengths <= NARROW_SOURCE_WIDTH if setting.width is None else np.zeros(rows, dtype=bool)
        narrow_rows, wide_rows = np.flatnonzero(is_narrow), np.flatnonzero(~is_narrow)
        width = source_width(int(lengths[wide_rows].max(initial=1))) if setting.width is None else setting.width
        widths = {NARROW_PREFIX: NARROW_SOURCE_WIDTH, "": width}
        # One row per source, which the engine gives MIN_QUERIES queries (the row and a repeat of it, whose result is
        # dropped): runtime/source_layout.py says why. The narrow group's results come first.
        row_queries = np.empty(rows, dtype=np.int64)
        row_queries[np.concatenate([narrow_rows, wide_rows])] = np.arange(rows) * MIN_QUERIES
        capacity = INITIAL_LENGTH  # the engine's cache capacity: doubled until a row's next token fits
        while capacity < position + 1:
            capacity *= 2
        super().__init__(session)
        self.log_probs = np.zeros((rows, config.vocab_size), dtype=np.float32)
        outputs = {output.name for output in session.get_outputs()}
        feeds = {
            "tgt_ids": rng.integers(4, config.vocab_size, (rows, 1)),
            "positions": np.full(rows, position, dtype=np.int64),
            f"{NARROW_PREFIX}src_mask": np.arange(NARROW_SOURCE_WIDTH)[None] < lengths[narrow_rows][:, None],
            f"{NARROW_PREFIX}source_queries": np.repeat(narrow_rows[:, None], MIN_QUERIES, axis=1),
            "src_mask": np.arange(width)[None] < lengths[wide_rows][:, None],
            "source_queries": np.repeat(wide_rows[:, None], MIN_QUERIES, axis=1),
            "row_queries": row_queries,
            "candidate_rows": np.zeros(0, dtype=np.int64),
            "candidate_count": np.ones(1, dtype=np.int64),
        }
        for spec in session.get_inputs():
            if spec.name.startswith("past_"):
                shape = (rows, heads, capacity, head_dim)
                if CACHE_DTYPES[spec.type] == np.int8:  # an int8 cache (export/int8_cache.py): steps of its scale
                    cache = rng.integers(-64, 64, shape, dtype=np.int8)
                else:
                    cache = (rng.standard_normal(shape) * 0.5).astype(np.float32)
                self._bind(spec.name, cache)
                present = spec.name.replace("past_", "present_", 1)
                if present in outputs:
                    self._bind(present, cache, output=True)
            elif spec.name.startswith(("cross_", f"{NARROW_PREFIX}cross_")):
                prefix = NARROW_PREFIX if spec.name.startswith(NARROW_PREFIX) else ""
                sources = len(narrow_rows) if prefix else len(wide_rows)
                self._bind(spec.name, (rng.standard_normal((sources, heads, widths[prefix], head_dim)) * 0.5).astype(np.float32))
            else:
                self._bind(spec.name, np.ascontiguousarray(feeds[spec.name]))
        self._bind("log_probs", self.log_probs, output=True)
        for name in ("candidate_log_probs", "candidate_ids"):
            self.binding.bind_output(name, "cpu")


K = TypeVar("K")


def interleaved_medians(bound: dict[K, BoundCall], rounds: int) -> dict[K, float]:
    """Median seconds per call of each bound call over `rounds` rounds, taken in rotated order each round so
    that a drift of the machine hits all alike; every timing is as many calls as the first one's ~TIMING_SECONDS."""
    calls = next(iter(bound.values())).calls_per_timing()
    times: dict[K, list[float]] = {key: [] for key in bound}
    for round_index in range(rounds):
        for key in rotated(list(bound), round_index):
            times[key].append(bound[key].time_calls(calls))
    return {key: statistics.median(values) for key, values in times.items()}


def variant_sessions(model_dir: Path, threads: int, work: Path, kernels_library: Path | None = None) -> dict[str, ort.InferenceSession]:
    """A CPU session for the decoder as exported and for every variant of it, each saved under `work` first; each on the
    native attention kernels when `kernels_library` is given."""
    manifest = load_model_dir(model_dir, verify_hashes=False)
    sessions: dict[str, ort.InferenceSession] = {}
    for index, (name, model) in enumerate(variant_models(manifest.graph_path(model_dir, "decoder"), manifest.config).items()):
        path = work / f"{model_dir.name}-variant{index}.onnx"
        onnx.save(model, str(path))
        # Not fused (runtime/native_fusions.py): the variants take nodes out of the stock blocks the fusions replace.
        sessions[name] = make_session(path, ["CPUExecutionProvider"], threads, kernels_library=kernels_library, fuse=False)
    return sessions


def ablate(model_dir: Path, settings: Sequence[Setting], source_lengths: Sequence[int], rounds: int, threads: int,
           work: Path, kernels_library: Path | None = None) -> dict[Setting, dict[str, float]]:  # fmt: skip
    """Median seconds per decoder call of every variant in every setting, and of the weight products alone at its rows,
    all interleaved."""
    config = load_model_dir(model_dir, verify_hashes=False).config
    sessions = variant_sessions(model_dir, threads, work, kernels_library)
    ceiling = MatmulCeiling(model_dir, threads, model_dir.name)
    results: dict[Setting, dict[str, float]] = {}
    for setting in settings:
        bound: dict[str, BoundCall] = {name: BoundDecoder(session, config, setting, source_lengths) for name, session in sessions.items()}
        bound[WEIGHT_PRODUCTS] = BoundWeightProducts(ceiling, setting.rows)
        results[setting] = interleaved_medians(bound, rounds)
        shown = {name: f"{1e6 * value:.0f} us" for name, value in results[setting].items()}
        logger.info("%s rows %d: %s", model_dir.name, setting.rows, shown)
    return results


def time_widths(model_dir: Path, settings: Sequence[Setting], source_lengths: Sequence[int], rounds: int,
                threads: int) -> dict[Setting, float]:  # fmt: skip
    """Median seconds per call of the decoder as exported in each setting (each with its own width), the settings of
    one row count interleaved."""
    manifest = load_model_dir(model_dir, verify_hashes=False)
    session = make_session(manifest.graph_path(model_dir, "decoder"), ["CPUExecutionProvider"], threads)
    results: dict[Setting, float] = {}
    for rows in dict.fromkeys(setting.rows for setting in settings):
        results.update(interleaved_medians({setting: BoundDecoder(session, manifest.config, setting, source_lengths)
                                            for setting in settings if setting.rows == rows}, rounds))  # fmt: skip
    return results


def format_widths(label: str, results: dict[Setting, float]) -> str:
    widths = list(dict.fromkeys(setting.width for setting in results))
    header = "| rows | position | " + " | ".join(f"{width} wide (us)" for width in widths) + " |"
    title = f"### {label}: the call by bound source width (sources of at most {MIN_SOURCE_WIDTH} tokens)"
    lines = [title, "", header, "|---|---|" + "---|" * len(widths)]
    for rows, position in dict.fromkeys((setting.rows, setting.position) for setting in results):
        cells = [f"{1e6 * results[Setting(rows, position, width)]:.0f}" for width in widths]
        lines.append(f"| {rows} | {position} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(label: str, results: dict[Setting, dict[str, float]]) -> str:
    variants = [name for name in VARIANTS if any(name in by_variant for by_variant in results.values())]
    header = ["decoder call (us)", WEIGHT_PRODUCTS, *(f"without {name}" for name in variants), "neither weight products nor attention"]
    lines = [f"### {label}", "", "| rows | position | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]

    def share(seconds: float, whole: float) -> str:
        return f"{1e6 * seconds:.0f} us ({100 * seconds / whole:.0f}%)"

    for setting, by_variant in results.items():
        whole, weights = by_variant[AS_EXPORTED], by_variant[WEIGHT_PRODUCTS]
        # What the call keeps without attention, less its weight products: every other node and the call itself.
        rest = by_variant["all attention"] - weights
        removed = [share(whole - by_variant[name], whole) for name in variants]
        cells = [f"{1e6 * whole:.0f}", share(weights, whole), *removed, share(rest, whole)]
        lines.append(f"| {setting.rows} | {setting.position} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def legend() -> str:
    removed = "\n".join(f"- without {name}: {variant.takes_out}" for name, variant in VARIANTS.items())
    return ("The decoder call as the engine makes it (every row at the same position, its source lengths taken in turn from "
            "the sampled test sentences, the short sources' cross K/V in the narrow group and the others as wide as the "
            "engine pads them), timed without the profiler; each "
            "\"without\" column is what the call got faster by (time and share of the whole) when one part was taken out; "
            f"{WEIGHT_PRODUCTS}: the decoder's weight products by themselves in one call at the same rows (bench/matmul_ceiling.py), "
            "timed in the same rounds; neither weight products nor attention: the call without attention less the weight products "
            "alone (layer norms, residual adds, activation quantization, log-softmax, gathers, each node's dispatch):\n\n" + removed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-step-ablation", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, action="append", help="a model dir (repeatable; default: the shipped int8 and fp32 dirs)")
    parser.add_argument("--checkpoint", type=Path, default=Path("artifacts/de-en-small"), help="its tokenizer encodes the sampled sources")
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="source lengths sampled from it (random without)")
    parser.add_argument("--rows", default="1,8,32,128", help="comma-separated row counts")
    parser.add_argument("--positions", default="16", help="comma-separated positions (tokens already cached per row)")
    parser.add_argument("--widths", default="", help="comma-separated source widths: also time the call as exported with every source "
                        f"cut to {MIN_SOURCE_WIDTH} tokens and bound this wide (multiples of 16; empty: skip)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--native-kernels", default="off", help="'auto' or a library path: every session on the native attention kernels "
                        "(runtime/native_kernels.py), without the runtime's in-memory fusions; 'off': ONNX Runtime's own")
    parser.add_argument("--out", type=Path, default=Path("bench/results/step-ablation.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model_dirs = args.model_dir or [args.checkpoint / "onnx-int8", args.checkpoint / "onnx-fp32"]
    config = load_model_dir(model_dirs[0], verify_hashes=False).config
    source_lengths = [len(ids) + 1 for ids in sample_sources(args.test, 32, config.vocab_size, args.checkpoint)]  # + EOS
    settings = [Setting(int(rows), int(position)) for rows in args.rows.split(",") for position in args.positions.split(",")]
    kernels = resolve_native_kernels(args.native_kernels)
    library, on = (kernels.path, " on the native attention kernels") if kernels else (None, "")
    with tempfile.TemporaryDirectory() as work:
        tables = [format_table(f"{model_dir.parent.name}/{model_dir.name}{on}",
                               ablate(model_dir, settings, source_lengths, args.rounds, args.threads, Path(work), library))
                  for model_dir in model_dirs]  # fmt: skip
    widths = [int(width) for width in args.widths.split(",") if width]
    if widths:
        by_width = [Setting(setting.rows, setting.position, width) for setting in settings for width in widths]
        tables += [format_widths(f"{model_dir.parent.name}/{model_dir.name}",
                                 time_widths(model_dir, by_width, source_lengths, args.rounds, args.threads))
                   for model_dir in model_dirs]  # fmt: skip
    write_report("Decoder step ablation", "nmt-step-ablation", argv, [legend(), *tables], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
