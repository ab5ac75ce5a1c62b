"""The runtime's in-memory fusion of per-row activation quantization into one node of the native kernels library.

An int8 graph quantizes each weight product's input row by row in stock nodes (export/row_quantization.py):
Abs -> ReduceMax(last axis) -> Mul(1/127) gives the row scale, and a blocked QuantizeLinear with one block per row
and the zero point 128 (itself a QuantizeLinear of a scale by the largest float32) gives the levels. With the library
loaded (runtime/native_kernels.py) each such chain becomes one `nmt_serve.RowQuantize` node
(runtime/kernels/row_quantize.cc) that writes the same levels and scales. runtime/native_fusions.py applies it to the
copy in memory only: the graph on disk keeps stock operators and runs anywhere ONNX Runtime does.

A chain in any other form is left as it is. The levels are the same bytes for every finite row; a row holding an
infinity or NaN gets an infinite or NaN scale, so its product is not finite either way.
"""

from __future__ import annotations

import numpy as np

from nmt_serve.runtime.graph_index import FUSED_DOMAIN, STOCK_DOMAINS, GraphIndex, replace_nodes
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute, make_node

FUSED_OP = "RowQuantize"
# A blocked QuantizeLinear is one scale per row only when its block is at least the row's width; the exporter's block
# is 2^30 and no activation row of a translation model comes near 2^24.
MIN_ROW_BLOCK = 1 << 24


def _zero_point(graph: GraphIndex, name: str) -> int | None:
    """The zero point every row gets from `name`: QuantizeLinear(any finite scale, largest float32, uint8 z) is z."""
    node = graph.made_by(name, "QuantizeLinear")
    if node is None or len(node.input) != 3 or attribute(node, "block_size") is not None:
        return None
    divisor, zero_point = graph.scalar(node.input[1]), graph.scalar(node.input[2])
    if divisor is None or zero_point is None or zero_point.dtype != np.uint8:
        return None
    if divisor.dtype != np.float32 or float(divisor.reshape(())) != float(np.finfo(np.float32).max):
        return None
    return int(zero_point.reshape(()))


def _chain(graph: GraphIndex, quantize: NodeProto) -> tuple[list[NodeProto], float, int] | None:
    """The Abs, ReduceMax and Mul feeding a row-blocked QuantizeLinear, the Mul's constant and the zero point; None
    where `quantize` is not the exporter's per-row form."""
    if quantize.op_type != "QuantizeLinear" or quantize.domain not in STOCK_DOMAINS or len(quantize.input) != 3:
        return None
    block = attribute(quantize, "block_size")
    if attribute(quantize, "axis") != -1 or not isinstance(block, int) or block < MIN_ROW_BLOCK:
        return None
    if attribute(quantize, "output_dtype", 0) != 0 or attribute(quantize, "saturate", 1) != 1:
        return None
    source, row_scale, zero_points = quantize.input
    scale = graph.made_by(row_scale, "Mul")
    if scale is None:
        return None
    factors = [graph.scalar(name) for name in scale.input]
    constant = next((value for value in factors if value is not None and value.dtype == np.float32), None)
    row_max_name = next((name for name, value in zip(scale.input, factors, strict=True) if value is None), None)
    row_max = graph.made_by(row_max_name or "", "ReduceMax")
    if constant is None or row_max is None or attribute(row_max, "keepdims", 1) != 1:
        return None
    axes = graph.scalar(row_max.input[1]) if len(row_max.input) > 1 else None
    axes_list = [int(axes.reshape(()))] if axes is not None else list(attribute(row_max, "axes", []) or [])
    magnitude = graph.made_by(row_max.input[0], "Abs")
    if axes_list != [-1] or magnitude is None or magnitude.input[0] != source:
        return None
    if not (graph.only_reader(magnitude.output[0], row_max) and graph.only_reader(row_max.output[0], scale)):
        return None
    zero_point = _zero_point(graph, zero_points)
    if zero_point is None:
        return None
    return [magnitude, row_max, scale], float(constant.reshape(())), zero_point


def fuse_row_quantization(model: ModelProto) -> int:
    """Replace every per-row quantization chain of `model` by one RowQuantize node, in place; how many were replaced.
    The zero-point nodes no chain reads any more go too."""
    graph = model.graph
    index = GraphIndex(graph)
    replaced: dict[int, NodeProto] = {}  # id(first node of a chain) -> its fused node
    dropped: set[int] = set()
    for node in graph.node:
        found = _chain(index, node)
        if found is None:
            continue
        (magnitude, row_max, scale), inverse_levels, zero_point = found
        replaced[id(magnitude)] = make_node(
            FUSED_OP, [node.input[0]], [node.output[0], scale.output[0]], f"{node.name or node.output[0]}.fused",
            domain=FUSED_DOMAIN, inverse_levels=inverse_levels, zero_point=zero_point)
        dropped.update({id(row_max), id(scale), id(node)})
    fused = replace_nodes(model, replaced, dropped)
    if fused:
        unread = _unread_zero_points(graph)  # held while their ids are used
        replace_nodes(model, {}, {id(node) for node in unread})
    return fused


def _unread_zero_points(graph) -> list[NodeProto]:  # a GraphProto of runtime/onnx_proto.py
    """The per-tensor QuantizeLinear nodes (the zero points of fused chains) nothing reads any more."""
    read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    return [node for node in graph.node
            if node.op_type == "QuantizeLinear" and attribute(node, "block_size") is None and node.output[0] not in read]  # fmt: skip
