"""Per-row activation scales for a dynamically quantized graph: each row's int8 input depends on that row alone."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.graph_links import readers, writers

logger = logging.getLogger(__name__)

# The unsigned activation a row is quantized to is round(x / scale) + 128, scale = max|x| / 127 over the row:
# symmetric, so the zero point is the same constant for every row and MatMulInteger (whose activation zero
# point must be one scalar) still takes it. 7-bit weights keep the u8 x s8 products exact on every x86 kernel.
ROW_ZERO_POINT = 128
ROW_LEVELS = 127.0
# A row of zeros gets the scale 0, and no floor: its u8 values are whatever the kernel makes of 0 / 0, but the
# product multiplies the integer sum by that scale, so the row's result is 0 (plus the bias added after) on any
# CPU, as in fp32. A floor was one more kernel per activation: without it 1.02-1.04x the default model's int8
# tokens/s in 5 of 6 cells (0.99x at batch 8 beam 4) on an AVX-512 VNNI core, the same bytes for every other row.
# From opset 21 QuantizeLinear takes one scale per block of the last axis; a block longer than any row makes
# it one scale per row, so the row's division and rounding are one kernel instead of a Div and a
# QuantizeLinear (the same bytes out; 0.75-0.80x the time of the quantizing nodes from 32 rows up).
BLOCKED_QUANTIZE_OPSET = 21
ROW_BLOCK = 1 << 30
# Blocked quantization wants a zero point shaped like its scale: the row scale quantized with the largest
# float32 as its scale rounds to 0 for any finite row scale, so this gives ROW_ZERO_POINT in every row.
ZERO_POINT_SCALE = float(np.finfo(np.float32).max)


def add_constants(graph: onnx.GraphProto) -> dict[str, str]:
    constants = {
        "row_quant.axes": numpy_helper.from_array(np.array([-1], dtype=np.int64), "row_quant.axes"),
        "row_quant.inverse_levels": numpy_helper.from_array(np.array(1.0 / ROW_LEVELS, dtype=np.float32), "row_quant.inverse_levels"),
        "row_quant.one": numpy_helper.from_array(np.array(1.0, dtype=np.float32), "row_quant.one"),
        "row_quant.zero_point": numpy_helper.from_array(np.array(ROW_ZERO_POINT, dtype=np.uint8), "row_quant.zero_point"),
        "row_quant.zero_point_scale": numpy_helper.from_array(np.array(ZERO_POINT_SCALE, dtype=np.float32), "row_quant.zero_point_scale"),
    }
    graph.initializer.extend(constants.values())
    return {name.split(".")[1]: name for name in constants}


def reduce_max_node(source: str, output: str, names: dict[str, str], opset: int) -> onnx.NodeProto:
    """ReduceMax over the last axis, keeping it: opset 18 moved `axes` from an attribute to an input."""
    if opset >= 18:
        return helper.make_node("ReduceMax", [source, names["axes"]], [output], output, keepdims=1)
    return helper.make_node("ReduceMax", [source], [output], output, axes=[-1], keepdims=1)


def row_quantize_nodes(node: onnx.NodeProto, names: dict[str, str], opset: int,
                       shared_zero_points: str | None = None) -> tuple[list[onnx.NodeProto], str, str | None]:  # fmt: skip
    """What replaces one DynamicQuantizeLinear (x -> quantized, scale, zero point), the name of the (..., 1)
    per-row scale it computes, and of its per-row zero points (blocked quantization only; `shared_zero_points`,
    made for another activation of the same shape, is used instead of making them). The node's own scale
    output becomes the constant 1: fuse_products gives the row scale to each product as its activation scale,
    and quantize_rows multiplies by it after any product left unfused."""
    source = node.input[0]
    quantized, scale, zero_point = node.output
    prefix = f"{node.name or quantized}.row"
    row_scale = f"{prefix}.scale"
    row_zero_point = None
    nodes = [
        helper.make_node("Abs", [source], [f"{prefix}.abs"], f"{prefix}.abs"),
        reduce_max_node(f"{prefix}.abs", f"{prefix}.max", names, opset),
        helper.make_node("Mul", [f"{prefix}.max", names["inverse_levels"]], [row_scale], row_scale),
    ]
    if opset >= BLOCKED_QUANTIZE_OPSET:
        row_zero_point = shared_zero_points
        if row_zero_point is None:
            row_zero_point = f"{prefix}.zero_points"
            nodes.append(helper.make_node("QuantizeLinear", [row_scale, names["zero_point_scale"], names["zero_point"]], [row_zero_point], row_zero_point))
        nodes.append(helper.make_node("QuantizeLinear", [source, row_scale, row_zero_point], [quantized], f"{prefix}.quantize", axis=-1, block_size=ROW_BLOCK))
    else:
        nodes += [
            helper.make_node("Div", [source, row_scale], [f"{prefix}.levels"], f"{prefix}.levels"),
            helper.make_node("QuantizeLinear", [f"{prefix}.levels", names["one"], names["zero_point"]], [quantized], f"{prefix}.quantize"),
        ]
    nodes += [
        helper.make_node("Identity", [names["zero_point"]], [zero_point], f"{prefix}.zero_point"),
        helper.make_node("Identity", [names["one"]], [scale], f"{prefix}.unit_scale"),
    ]
    return nodes, row_scale, row_zero_point


def known_shapes(model: onnx.ModelProto) -> dict[str, tuple[str | int, ...]]:
    """Every tensor whose shape ONNX Runtime's symbolic shape inference knows in full (named or fixed dimensions),
    by name; empty where the inference fails, so callers then assume nothing about shapes."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # needs sympy

        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False)
    except Exception as error:  # the inference has no error type of its own; nothing is shared then
        logger.info("no symbolic shapes (%s): every quantized activation makes its own zero points", error)
        return {}
    shapes = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(dim.dim_param or dim.dim_value > 0 for dim in tensor.shape.dim):
            shapes[value.name] = tuple(dim.dim_param or dim.dim_value for dim in tensor.shape.dim)
    return shapes


def consumers(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [node for node in graph.node if name in node.input]


def dequantized_outputs(graph: onnx.GraphProto, scale: str) -> list[onnx.NodeProto]:
    """The Muls that turn each MatMulInteger's int32 result into floats with `scale` (through Mul(scale, weight scales))."""
    found = []
    for scales in consumers(graph, scale):
        if scales.op_type != "Mul":
            raise ValueError(f"{scales.name}: expected the activation scale to feed a Mul, found {scales.op_type}")
        found.extend(node for node in consumers(graph, scales.output[0]) if node.op_type == "Mul")
    return found


def fuse_products(graph: onnx.GraphProto, row_scales: dict[str, str]) -> None:
    """MatMulInteger -> Cast -> Mul(unit activation scale x weight scales) becomes one com.microsoft
    MatMulIntegerToFloat, in place, with the weight scales and, as its activation scale, the (..., 1) row scale
    `row_scales` maps the unit scale to. ONNX Runtime fuses that chain itself only when the scale product is
    computed at run time; with the constant unit scale it folds the product first and leaves three kernels (the
    per-row graph then ran 10-30% slower than the per-call one). Its kernel multiplies the integer product by
    the weight scales, then by a non-scalar activation scale, the float multiplications the separate Muls did,
    so the bytes are the same (tests/test_int8.py) for one kernel per product: with the shared zero points of
    quantize_rows, 1.02-1.07x the default model's int8 tokens/s against a Mul after each product, on an AVX-512
    VNNI core. The fused products take no bias input: the kernel would add it before that multiplication."""
    producers, users = writers(graph), readers(graph)
    dropped: set[int] = set()
    fused: dict[int, onnx.NodeProto] = {}
    for node in graph.node:
        if node.op_type != "MatMulInteger" or len(users.get(node.output[0], [])) != 1:
            continue
        (cast,) = users[node.output[0]]
        dequantize = users.get(cast.output[0], [])
        if cast.op_type != "Cast" or len(dequantize) != 1 or dequantize[0].op_type != "Mul":
            continue
        scales = producers.get(next(name for name in dequantize[0].input if name != cast.output[0]))
        if scales is None or scales.op_type != "Mul" or not row_scales.keys() & set(scales.input):
            continue
        unit_scale = next(name for name in scales.input if name in row_scales)
        weight_scale = next(name for name in scales.input if name not in row_scales)
        activation, weight, activation_zero_point, weight_zero_point = node.input
        fused[id(node)] = helper.make_node(
            "MatMulIntegerToFloat", [activation, weight, row_scales[unit_scale], weight_scale, activation_zero_point, weight_zero_point],
            [dequantize[0].output[0]], f"{node.name}.to_float", domain="com.microsoft")  # fmt: skip
        dropped |= {id(cast), id(dequantize[0])}
        if len(users[scales.output[0]]) == 1:
            dropped.add(id(scales))
    if not fused:
        return
    nodes = [fused.get(id(node), node) for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)


def rows_key(activation: str, shapes: dict[str, tuple[str | int, ...]]) -> tuple[str | int, ...]:
    """What two activations with the same rows share: their shape but for the last axis where it is known, else
    the activation's own name (nothing shared)."""
    shape = shapes.get(activation, ())
    return ("shape", *shape[:-1]) if len(shape) > 1 else ("tensor", activation)


def quantize_rows(model: onnx.ModelProto, shapes: dict[str, tuple[str | int, ...]] | None = None) -> int:
    """Replace every DynamicQuantizeLinear of `model` by per-row quantization, in place; how many were replaced.

    Activations whose `shapes` (known_shapes of the graph before quantization) agree but for the last axis
    have the same rows, so they share one zero-point tensor: the decoder step's 19 activations make 2 instead
    of 19 (each is a kernel of its own, about 1 us on one core)."""
    graph = model.graph
    quantizers = [node for node in graph.node if node.op_type == "DynamicQuantizeLinear"]
    if not quantizers:
        return 0
    names = add_constants(graph)
    opset = next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))
    replacements: dict[str, list[onnx.NodeProto]] = {}
    row_scales: dict[str, str] = {}  # each quantizer's unit scale -> its row scale
    zero_points_by_rows: dict[tuple[str | int, ...], str] = {}
    for node in quantizers:
        rows = rows_key(node.input[0], shapes or {})
        replacements[node.name], row_scales[node.output[1]], zero_points = row_quantize_nodes(node, names, opset, zero_points_by_rows.get(rows))
        if zero_points is not None:
            zero_points_by_rows.setdefault(rows, zero_points)
    fuse_products(graph, row_scales)
    # A product left unfused dequantizes with the unit scale; its row scale then multiplies the result.
    rescales: dict[str, onnx.NodeProto] = {}
    for unit_scale, row_scale in row_scales.items():
        for dequantize in dequantized_outputs(graph, unit_scale):
            output = dequantize.output[0]
            dequantize.output[0] = f"{output}.unit_rows"
            rescales[dequantize.name] = helper.make_node("Mul", [dequantize.output[0], row_scale], [output], f"{output}.row_rescale")
    read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
    nodes = []
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear":
            # The unit scale stays only where an unfused product still reads it.
            nodes.extend(new for new in replacements[node.name] if not (new.name.endswith(".unit_scale") and new.output[0] not in read))
        else:
            nodes.append(node)
        if node.name in rescales:
            nodes.append(rescales[node.name])
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(entry.domain == "com.microsoft" for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(quantizers)
