"""The runtime's in-memory fusion of an int8 decoder's input embedding into one node of the native kernels library.

The exporter writes the decoder's input as Gather(token table, tgt_ids) -> Mul(embedding scale) plus
Gather(position table, positions) -> Unsqueeze(axis 1), added (export/decoder_graph.py); the int8 quantizer stores
both tables as uint8 with one scale and zero point each, so a DequantizeLinear follows each Gather. With the library
loaded those seven nodes become one `nmt_serve.DecoderEmbedding` node (runtime/kernels/decoder_embedding.cc) that
writes the same floats. runtime/native_fusions.py applies it to the copy in memory only; a block in any other form
(float tables, other axes, a table read per channel) is left as it is.
"""

from __future__ import annotations

import numpy as np

from nmt_serve.runtime.graph_index import STOCK_DOMAINS, GraphIndex, fuse_blocks
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute

FUSED_OP = "DecoderEmbedding"
UINT8 = 2  # TensorProto.UINT8: the quantized tables the kernel reads


def _dequantized_rows(graph: GraphIndex, name: str, reader: NodeProto) -> tuple[list[str], list[NodeProto]] | None:
    """(table, scale, zero point, indices) and the Gather and DequantizeLinear writing `name` for `reader` alone, when
    they are a uint8 table's rows dequantized with one float scale and one uint8 zero point; else None."""
    dequantize = graph.made_by(name, "DequantizeLinear")
    if dequantize is None or len(dequantize.input) != 3 or attribute(dequantize, "block_size") is not None:
        return None
    if not graph.only_reader(name, reader):
        return None
    rows, scale, zero_point = dequantize.input
    gather = graph.made_by(rows, "Gather")
    if gather is None or attribute(gather, "axis", 0) != 0 or not graph.only_reader(rows, dequantize):
        return None
    table = graph.initializers.get(gather.input[0])
    scale_value, zero_value = graph.scalar(scale), graph.scalar(zero_point)
    if table is None or table.data_type != UINT8 or len(table.dims) != 2:
        return None
    if scale_value is None or scale_value.dtype != np.float32 or zero_value is None or zero_value.dtype != np.uint8:
        return None
    return [gather.input[0], scale, zero_point, gather.input[1]], [gather, dequantize]


def _token_side(graph: GraphIndex, name: str, add: NodeProto) -> tuple[list[str], list[NodeProto]] | None:
    """The token rows' inputs (table, scale, zero point, ids, embedding scale or '') and nodes feeding `add`."""
    scale = graph.made_by(name, "Mul")
    if scale is None:
        found = _dequantized_rows(graph, name, add)
        return (found[0] + [""], found[1]) if found is not None else None
    if not graph.only_reader(name, add) or len(scale.input) != 2:
        return None
    for rows, factor in (scale.input, reversed(scale.input)):
        value = graph.scalar(factor)
        found = _dequantized_rows(graph, rows, scale) if value is not None and value.dtype == np.float32 else None
        if found is not None:
            return found[0] + [factor], [*found[1], scale]
    return None


def _position_side(graph: GraphIndex, name: str, add: NodeProto) -> tuple[list[str], list[NodeProto]] | None:
    """The position rows' inputs (table, scale, zero point, positions) and nodes feeding `add` through Unsqueeze(1)."""
    unsqueeze = graph.made_by(name, "Unsqueeze")
    if unsqueeze is None or len(unsqueeze.input) != 2 or graph.vector(unsqueeze.input[1]) != [1] or not graph.only_reader(name, add):
        return None
    found = _dequantized_rows(graph, unsqueeze.input[0], unsqueeze)
    return (found[0], [*found[1], unsqueeze]) if found is not None else None


def _block(graph: GraphIndex, add: NodeProto) -> tuple[list[str], list[NodeProto], dict] | None:
    if add.op_type != "Add" or add.domain not in STOCK_DOMAINS or len(add.input) != 2 or add.input[0] == add.input[1]:
        return None
    for token_name, position_name in (add.input, reversed(add.input)):
        tokens, positions = _token_side(graph, token_name, add), _position_side(graph, position_name, add)
        if tokens is not None and positions is not None:
            return [*tokens[0], *positions[0]], [*tokens[1], *positions[1], add], {}
    return None


def fuse_decoder_embedding(model: ModelProto) -> int:
    """Replace an int8 decoder's embedding block of `model` by one DecoderEmbedding node, in place; how many (0 or 1)."""
    return fuse_blocks(model, FUSED_OP, _block)
