"""The runtime's in-memory fusion of the decoder's self-attention lengths into one node of the native kernels library.

The exporter derives GroupQueryAttention's two length inputs from the rows' positions (export/decoder_graph.py):
seqlens_k = Cast<int32>(positions), and total_sequence_length = Cast<int32>(ReduceMax(positions) + 1). With the
library loaded those four nodes become one `nmt_serve.DecoderLengths` node (runtime/kernels/decoder_lengths.cc)
writing the same two tensors. runtime/native_fusions.py applies it to the copy in memory only; lengths in any other
form are left as they are.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import FUSED_DOMAIN, STOCK_DOMAINS, GraphIndex, replace_nodes
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute, make_node

FUSED_OP = "DecoderLengths"
INT32 = 6  # TensorProto.INT32: what GroupQueryAttention reads its lengths as


def _to_int32(node: NodeProto) -> bool:
    return node.op_type == "Cast" and node.domain in STOCK_DOMAINS and attribute(node, "to") == INT32


def _lengths(graph: GraphIndex, total_cast: NodeProto) -> tuple[NodeProto, list[NodeProto]] | None:
    """For the Cast writing total_sequence_length: the fused node and the four nodes it replaces, or None."""
    if not _to_int32(total_cast):
        return None
    add = graph.made_by(total_cast.input[0], "Add")
    if add is None or not graph.only_reader(add.output[0], total_cast):
        return None
    for longest_name, offset_name in (add.input, reversed(add.input)):
        longest, offset = graph.made_by(longest_name, "ReduceMax"), graph.vector(offset_name)
        if longest is None or offset is None or len(offset) != 1 or len(longest.input) != 1 or attribute(longest, "keepdims", 1) != 0:
            continue
        if not graph.only_reader(longest_name, add):
            continue
        positions = longest.input[0]
        per_row = [node for node in graph.readers.get(positions, []) if _to_int32(node)]
        if len(per_row) != 1:
            continue
        total_rank = len(graph.initializers[offset_name].dims) if offset_name in graph.initializers else None
        if total_rank not in (0, 1):
            continue
        outputs = [per_row[0].output[0], total_cast.output[0]]
        fused = make_node(FUSED_OP, [positions], outputs, f"{total_cast.name or total_cast.output[0]}.fused", domain=FUSED_DOMAIN,
                          offset=offset[0], total_rank=total_rank)  # fmt: skip
        return fused, [longest, per_row[0], add, total_cast]
    return None


def fuse_decoder_lengths(model: ModelProto) -> int:
    """Replace the decoder's length nodes of `model` by one DecoderLengths node, in place; how many (0 or 1). The fused
    node reads only the positions, which the first of the four read too, so it stands where that one stood: before
    every reader of either length."""
    index = GraphIndex(model.graph)
    for node in model.graph.node:
        found = _lengths(index, node)
        if found is None:
            continue
        fused, nodes = found
        first = next(part for part in model.graph.node if any(part is block_node for block_node in nodes))
        return replace_nodes(model, {id(first): fused}, {id(part) for part in nodes if part is not first})
    return 0
