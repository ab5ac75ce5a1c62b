"""nmt-cross-attention-forms: the decoder's cross-attention written in each form ONNX Runtime's CPU operators allow, timed.

The decoder's cross-attention is one `com.microsoft.MultiHeadAttention` per group of sources: each source's queries
(the rows reading it) against its encoder K/V, [sources, heads, width, head_dim], with a key padding mask. From 32
rows up it is the largest part of the int8 decoder call other than the weight products (nmt-step-ablation), and its
cost grows with the bound width. This tool times, on random data of the decoder's shapes, every other way to write
the same arithmetic with stock operators, so that the choice of form rests on a measurement anyone can repeat:

- MultiHeadAttention with the key padding mask (as the decoder is exported), and with an additive attention bias;
- plain ops with K as the product's second operand: scores = Q K^T (K fed already transposed, so no Transpose of
  K is timed), softmax over the last axis, then P V;
- plain ops with K as the first operand: scores^T = K Q^T and out^T = V^T P^T (V fed already transposed), so the
  large operands are read in place and only the small one is packed;
- MultiHeadAttention with no mask at all: not a usable form (it attends to padding), listed as what the mask costs;
- where the native attention kernels are built (runtime/native_kernels.py), the shipped form on them.

Each usable form's output is checked against a numpy reference before it is timed. Every call is timed alone; with
--evict-mb, that much memory is written before each call, as a step's weights and other layers evict the caches.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-cross-attention-forms", "dev", ("onnx",))

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, NodeProto, TensorProto, ValueInfoProto, helper

from nmt_serve.bench.bound_call import BoundCall
from nmt_serve.bench.matmul_ceiling import IR_VERSION
from nmt_serve.bench.report import rotated, write_report
from nmt_serve.runtime.native_kernels import DEFAULT_LIBRARY, NativeKernels

logger = logging.getLogger(__name__)

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
SHIPPED = "MultiHeadAttention, key padding mask"
UNMASKED = "MultiHeadAttention, no mask (attends to padding)"
NATIVE = "MultiHeadAttention, key padding mask, native kernels"
TOLERANCE = 1e-4  # float32 attention over at most a few hundred positions; every usable form stays far inside it


@dataclass(frozen=True)
class Shape:
    sources: int
    queries: int  # rows reading each source
    width: int  # bound source width (columns of K/V); each source's own length is at most this
    heads: int = 4
    head_dim: int = 64

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Operands:
    """One call's data: queries [S, q, d], K and V [S, H, W, Dh], each source's length, and the forms' views of them."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    lengths: np.ndarray

    @property
    def mask(self) -> np.ndarray:  # [S, W] int32, 1 where a source has a token
        return (np.arange(self.key.shape[2])[None, :] < self.lengths[:, None]).astype(np.int32)

    @property
    def scaled_query(self) -> np.ndarray:  # the plain-op forms scale the query once instead of the scores
        return self.query / np.float32(np.sqrt(self.key.shape[3]))

    @property
    def additive(self) -> np.ndarray:  # [S, W] float32: 0 on tokens, a large negative number on padding
        return np.where(self.mask == 1, 0.0, -1e9).astype(np.float32)


def random_operands(shape: Shape, seed: int = 0) -> Operands:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, shape.width // 2), shape.width + 1, shape.sources)
    return Operands(rng.standard_normal((shape.sources, shape.queries, shape.d_model), dtype=np.float32),
                    rng.standard_normal((shape.sources, shape.heads, shape.width, shape.head_dim), dtype=np.float32),
                    rng.standard_normal((shape.sources, shape.heads, shape.width, shape.head_dim), dtype=np.float32),
                    lengths)  # fmt: skip


def reference(shape: Shape, operands: Operands) -> np.ndarray:
    """Masked scaled dot-product attention in numpy (float64): [S, q, d]."""
    query = operands.query.astype(np.float64).reshape(shape.sources, shape.queries, shape.heads, shape.head_dim).transpose(0, 2, 1, 3)
    scores = query @ operands.key.astype(np.float64).transpose(0, 1, 3, 2) / np.sqrt(shape.head_dim)
    scores = np.where(operands.mask[:, None, None, :] == 1, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ operands.value.astype(np.float64)).transpose(0, 2, 1, 3).reshape(shape.sources, shape.queries, shape.d_model)


def _value(name: str, element: int, dims: Sequence[int]) -> ValueInfoProto:
    return helper.make_tensor_value_info(name, element, list(dims))


def _model(
    nodes: list[NodeProto], inputs: list[ValueInfoProto], shape: Shape, constants: Sequence[tuple[str, Sequence[int]]] = ()
) -> ModelProto:
    initializers = [helper.make_tensor(name, TensorProto.INT64, [len(values)], list(values)) for name, values in constants]
    output = _value("attended", TensorProto.FLOAT, [shape.sources, shape.queries, shape.d_model])
    graph = helper.make_graph(nodes, "cross_attention", inputs, [output], initializers)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=OPSETS)


def _mha(shape: Shape, extra_inputs: Sequence[str], extra: list[ValueInfoProto]) -> ModelProto:
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value", *extra_inputs], ["attended"], domain="com.microsoft",
                            num_heads=shape.heads, scale=1.0 / np.sqrt(shape.head_dim))  # fmt: skip
    inputs = [_value("query", TensorProto.FLOAT, [shape.sources, shape.queries, shape.d_model]),
              _value("key", TensorProto.FLOAT, [shape.sources, shape.heads, shape.width, shape.head_dim]),
              _value("value", TensorProto.FLOAT, [shape.sources, shape.heads, shape.width, shape.head_dim]), *extra]  # fmt: skip
    return _model([node], inputs, shape)


def mha_key_padding(shape: Shape, operands: Operands) -> tuple[ModelProto, dict[str, np.ndarray]]:
    model = _mha(shape, ["", "mask"], [_value("mask", TensorProto.INT32, [shape.sources, shape.width])])
    return model, {"query": operands.query, "key": operands.key, "value": operands.value, "mask": operands.mask}


def mha_attention_bias(shape: Shape, operands: Operands) -> tuple[ModelProto, dict[str, np.ndarray]]:
    # MultiHeadAttention broadcasts its bias over sources and heads only, not over queries.
    bias = np.ascontiguousarray(np.broadcast_to(operands.additive[:, None, None, :], (shape.sources, 1, shape.queries, shape.width)))
    model = _mha(shape, ["", "", "bias"], [_value("bias", TensorProto.FLOAT, bias.shape)])
    return model, {"query": operands.query, "key": operands.key, "value": operands.value, "bias": bias}


def mha_unmasked(shape: Shape, operands: Operands) -> tuple[ModelProto, dict[str, np.ndarray]]:
    return _mha(shape, [], []), {"query": operands.query, "key": operands.key, "value": operands.value}


def _heads_first(perm: Sequence[int]) -> list[NodeProto]:
    """query [S, q, d] -> per head, as `perm` orders (S, q, H, Dh); the query is pre-scaled by 1/sqrt(Dh) in the feed."""
    return [
        helper.make_node("Reshape", ["query", "split_heads"], ["query_heads"]),
        helper.make_node("Transpose", ["query_heads"], ["query_by_head"], perm=list(perm)),
    ]


def _merge_heads(attended: str, perm: Sequence[int]) -> list[NodeProto]:
    return [
        helper.make_node("Transpose", [attended], ["attended_by_query"], perm=list(perm)),
        helper.make_node("Reshape", ["attended_by_query", "merge_heads"], ["attended"]),
    ]


def _plain_constants(shape: Shape) -> list[tuple[str, Sequence[int]]]:
    return [
        ("split_heads", [shape.sources, shape.queries, shape.heads, shape.head_dim]),
        ("merge_heads", [shape.sources, shape.queries, shape.d_model]),
    ]


def plain_key_second(shape: Shape, operands: Operands) -> tuple[ModelProto, dict[str, np.ndarray]]:
    nodes = [*_heads_first([0, 2, 1, 3]),  # [S, H, q, Dh]
             helper.make_node("MatMul", ["query_by_head", "key_t"], ["scores"]),  # [S, H, q, W]
             helper.make_node("Add", ["scores", "bias"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["weights"], axis=-1),
             helper.make_node("MatMul", ["weights", "value"], ["attended_heads"]),  # [S, H, q, Dh]
             *_merge_heads("attended_heads", [0, 2, 1, 3])]  # fmt: skip
    inputs = [_value("query", TensorProto.FLOAT, [shape.sources, shape.queries, shape.d_model]),
              _value("key_t", TensorProto.FLOAT, [shape.sources, shape.heads, shape.head_dim, shape.width]),
              _value("value", TensorProto.FLOAT, [shape.sources, shape.heads, shape.width, shape.head_dim]),
              _value("bias", TensorProto.FLOAT, [shape.sources, 1, 1, shape.width])]  # fmt: skip
    feeds = {"query": operands.scaled_query, "key_t": np.ascontiguousarray(operands.key.transpose(0, 1, 3, 2)), "value": operands.value,
             "bias": operands.additive[:, None, None, :].copy()}  # fmt: skip
    return _model(nodes, inputs, shape, _plain_constants(shape)), feeds


def plain_key_first(shape: Shape, operands: Operands) -> tuple[ModelProto, dict[str, np.ndarray]]:
    nodes = [*_heads_first([0, 2, 3, 1]),  # [S, H, Dh, q]
             helper.make_node("MatMul", ["key", "query_by_head"], ["scores_t"]),  # [S, H, W, q]
             helper.make_node("Add", ["scores_t", "bias"], ["masked_t"]),
             helper.make_node("Softmax", ["masked_t"], ["weights_t"], axis=2),
             helper.make_node("MatMul", ["value_t", "weights_t"], ["attended_t"]),  # [S, H, Dh, q]
             *_merge_heads("attended_t", [0, 3, 1, 2])]  # fmt: skip
    inputs = [_value("query", TensorProto.FLOAT, [shape.sources, shape.queries, shape.d_model]),
              _value("key", TensorProto.FLOAT, [shape.sources, shape.heads, shape.width, shape.head_dim]),
              _value("value_t", TensorProto.FLOAT, [shape.sources, shape.heads, shape.head_dim, shape.width]),
              _value("bias", TensorProto.FLOAT, [shape.sources, 1, shape.width, 1])]  # fmt: skip
    feeds = {"query": operands.scaled_query, "key": operands.key, "value_t": np.ascontiguousarray(operands.value.transpose(0, 1, 3, 2)),
             "bias": operands.additive[:, None, :, None].copy()}  # fmt: skip
    return _model(nodes, inputs, shape, _plain_constants(shape)), feeds


FormBuilder = Callable[[Shape, Operands], tuple[ModelProto, dict[str, np.ndarray]]]
FORMS: dict[str, FormBuilder] = {
    SHIPPED: mha_key_padding,
    "MultiHeadAttention, attention bias": mha_attention_bias,
    "plain ops, K second (Q K^T, then P V)": plain_key_second,
    "plain ops, K first (K Q^T, then V^T P^T)": plain_key_first,
    UNMASKED: mha_unmasked,
}


def available_forms() -> dict[str, FormBuilder]:
    """FORMS, and the shipped form on the native attention kernels where they are built."""
    return {**FORMS, NATIVE: mha_key_padding} if DEFAULT_LIBRARY.is_file() else dict(FORMS)


class BoundForm(BoundCall):
    """One form's session with its feeds and output bound once, as the engine binds the decoder; `kernels_library`: a
    custom-op library loaded into the session (the native attention kernels)."""

    def __init__(self, builder: FormBuilder, shape: Shape, operands: Operands, threads: int, kernels_library: Path | None = None) -> None:
        model, feeds = builder(shape, operands)
        self.kernels_library = kernels_library
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        if kernels_library is not None:
            options.register_custom_ops_library(str(kernels_library))
        super().__init__(ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]))
        for name, array in feeds.items():
            self._bind(name, array)
        self._bind("attended", np.empty((shape.sources, shape.queries, shape.d_model), dtype=np.float32), output=True)

    def run(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        return self.outputs[0]


def checked_forms(shape: Shape, threads: int) -> dict[str, BoundForm]:
    """Every form bound to the same data; a usable form whose output is not the reference's is refused, and so is the
    native form where ONNX Runtime did not run the library's kernel."""
    operands = random_operands(shape)
    expected = reference(shape, operands)
    forms = {name: BoundForm(builder, shape, operands, threads, DEFAULT_LIBRARY if name == NATIVE else None)
             for name, builder in available_forms().items()}  # fmt: skip
    for name, form in forms.items():
        calls = NativeKernels(DEFAULT_LIBRARY).calls()["cross_attention"] if name == NATIVE else 0
        error = float(np.abs(form.run() - expected).max())
        if name != UNMASKED and error > TOLERANCE:
            raise RuntimeError(f"{name} at {shape}: output {error:.2e} from the reference (bound {TOLERANCE})")
        if name == NATIVE and NativeKernels(DEFAULT_LIBRARY).calls()["cross_attention"] != calls + 1:
            raise RuntimeError(f"{name}: ONNX Runtime ran its own kernel, not the library's")
    return forms


def time_calls(form: BoundForm, calls: int, evict: np.ndarray | None) -> list[float]:
    """Seconds per call, each call timed alone; `evict` (if any) is written before each."""
    seconds = []
    for _ in range(calls):
        if evict is not None:
            evict += 1
        started = time.perf_counter()
        form.run()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(shapes: Sequence[Shape], rounds: int, calls: int, evict_mb: int, threads: int) -> dict[Shape, dict[str, float]]:
    """Median microseconds per call, per shape and form: forms interleaved in a rotated order each round."""
    evict = np.zeros(evict_mb * (1 << 20) // 4, dtype=np.float32) if evict_mb else None
    results: dict[Shape, dict[str, float]] = {}
    for shape in shapes:
        forms = checked_forms(shape, threads)
        samples: dict[str, list[float]] = {name: [] for name in forms}
        for form in forms.values():
            time_calls(form, 5, None)  # warm-up
        for round_index in range(rounds):
            for name in rotated(list(forms), round_index):
                samples[name] += time_calls(forms[name], calls, evict)
        results[shape] = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
        logger.info("%s: %s", shape, {name: f"{value:.1f} us" for name, value in results[shape].items()})
    return results


def format_table(results: dict[Shape, dict[str, float]]) -> str:
    names = list(next(iter(results.values())))
    head = "| sources | queries | width | " + " | ".join(names) + " |"
    rows = [head, "|" + "---|" * (3 + len(names))]
    for shape, by_form in results.items():
        shipped = by_form[SHIPPED]
        cells = [f"{by_form[SHIPPED]:.1f} us"] + [f"{by_form[name]:.1f} us ({shipped / by_form[name]:.2f}x)" for name in names[1:]]
        rows.append(f"| {shape.sources} | {shape.queries} | {shape.width} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def legend(shapes: Sequence[Shape], evict_mb: int, threads: int) -> str:
    first = shapes[0]
    memory = (f"{evict_mb} MB of other memory written before each call (caches evicted, as inside a decoder step)" if evict_mb
              else "nothing between calls (caches warm)")  # fmt: skip
    return (
        f"Cross-attention of {first.heads} heads of {first.head_dim}, float32, {threads} thread(s), onnxruntime "
        f"{ort.__version__}; each call timed alone, {memory}; median "
        f"microseconds per call, and in brackets the speed relative to the shipped form ({SHIPPED}: above 1.00x is faster). "
        "Every form but the last gave the reference's output (within "
        f"{TOLERANCE:g}) before it was timed; the last attends to padding and shows what the mask costs."
    )


def parse_counts(text: str, flag: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated whole numbers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"{flag}: expected at least one number, each 1 or more, got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-cross-attention-forms", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--sources", default="1,8,32", help="comma-separated source counts")
    parser.add_argument("--queries", default="2,4", help="comma-separated rows per source (the decoder binds at least 2)")
    parser.add_argument("--widths", default="16,32,64", help="comma-separated bound source widths")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median of every call is reported")
    parser.add_argument("--calls", type=int, default=50, help="calls per form per round")
    parser.add_argument("--evict-mb", type=int, default=0, help="write this many MB before each call (0: warm caches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cross-attention-forms.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for flag, count in (("--heads", args.heads), ("--head-dim", args.head_dim), ("--rounds", args.rounds), ("--calls", args.calls)):
        if count < 1:
            raise SystemExit(f"{flag}: expected 1 or more, got {count}")
    if args.evict_mb < 0:
        raise SystemExit(f"--evict-mb: expected 0 or more, got {args.evict_mb}")
    shapes = [Shape(sources, queries, width, args.heads, args.head_dim) for sources in parse_counts(args.sources, "--sources")
              for queries in parse_counts(args.queries, "--queries") for width in parse_counts(args.widths, "--widths")]  # fmt: skip
    results = measure(shapes, args.rounds, args.calls, args.evict_mb, args.threads)
    write_report(
        "Cross-attention forms",
        "nmt-cross-attention-forms",
        argv,
        [legend(shapes, args.evict_mb, args.threads), format_table(results)],
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
