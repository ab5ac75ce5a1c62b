"""The runtime's in-memory fusion of each decoder layer's cross-attention block into one node of the native kernels.

The exporter writes a layer's cross-attention as ten stock nodes (export/decoder_graph.py): the rows' queries
flattened (Reshape) and gathered into each group of sources (Gather, narrow then wide), a com.microsoft
MultiHeadAttention per group, each result flattened (Reshape), the two concatenated (Concat) and gathered back into
row order (Gather, Reshape). With the library loaded each such block becomes one `nmt_serve.GroupedCrossAttention`
node (runtime/kernels/grouped_cross_attention.cc) that runs the MultiHeadAttention kernel's own code on the rows the
gathers would pick: the same bits as the native MultiHeadAttention kernel, without the nine other nodes.
runtime/native_fusions.py applies it to the copy in memory only. A block in any other form is left as it is.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import GraphIndex, fuse_blocks
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute

FUSED_OP = "GroupedCrossAttention"
CONTRIB_DOMAIN = ("com.microsoft",)
ATTENTION_ATTRIBUTES = {"num_heads", "scale"}  # passed on; unidirectional may be 0, any other attribute is another form


def _group(graph: GraphIndex, flat: NodeProto, width: int) -> tuple[list[str], list[NodeProto], str, dict] | None:
    """One group's (source_queries, key, value, mask) inputs, its nodes (Reshape of the result, MultiHeadAttention,
    Gather of the queries), the flattened query they read and the attention's attributes; None when not that form."""
    if flat.op_type != "Reshape" or graph.vector(flat.input[1]) != [-1, width]:
        return None
    attention = graph.made_by(flat.input[0], "MultiHeadAttention", CONTRIB_DOMAIN)
    if attention is None or not graph.only_reader(attention.output[0], flat) or len(attention.output) != 1:
        return None
    inputs = list(attention.input) + [""] * (5 - len(attention.input))
    if len(attention.input) != 5 or inputs[3] or not all(inputs[index] for index in (0, 1, 2, 4)):
        return None
    other_attributes = {found.name for found in attention.attribute} - ATTENTION_ATTRIBUTES - {"unidirectional"}
    if other_attributes or attribute(attention, "unidirectional", 0) != 0:
        return None
    queries = graph.made_by(inputs[0], "Gather")
    if queries is None or attribute(queries, "axis", 0) != 0 or not graph.only_reader(queries.output[0], attention):
        return None
    attributes = {name: attribute(attention, name) for name in ATTENTION_ATTRIBUTES if attribute(attention, name) is not None}
    return [queries.input[1], inputs[1], inputs[2], inputs[4]], [flat, attention, queries], queries.input[0], attributes


def _block(graph: GraphIndex, rows: NodeProto) -> tuple[list[str], list[NodeProto], dict] | None:
    """The fused node's inputs, the block's nodes and the attention attributes, from the block's last Reshape."""
    shape = graph.vector(rows.input[1]) if rows.op_type == "Reshape" and len(rows.input) == 2 else None
    if shape is None or len(shape) != 3 or shape[:2] != [-1, 1] or attribute(rows, "allowzero", 0) != 0:
        return None
    width = shape[2]
    by_row = graph.made_by(rows.input[0], "Gather")
    if by_row is None or attribute(by_row, "axis", 0) != 0 or not graph.only_reader(by_row.output[0], rows):
        return None
    both = graph.made_by(by_row.input[0], "Concat")
    if both is None or attribute(both, "axis") != 0 or len(both.input) != 2 or not graph.only_reader(both.output[0], by_row):
        return None
    groups = []
    for name in both.input:
        flat = graph.producer.get(name)
        found = _group(graph, flat, width) if flat is not None and graph.only_reader(name, both) else None
        if found is None:
            return None
        groups.append(found)
    (narrow, narrow_nodes, narrow_query, narrow_attributes), (wide, wide_nodes, wide_query, wide_attributes) = groups
    query = graph.made_by(narrow_query, "Reshape")
    if narrow_query != wide_query or narrow_attributes != wide_attributes or query is None or graph.vector(query.input[1]) != [-1, width]:
        return None
    query_readers = {id(reader) for reader in graph.readers.get(narrow_query, [])}
    if query_readers != {id(narrow_nodes[2]), id(wide_nodes[2])} or narrow_query in graph.outputs:
        return None
    inputs = [query.input[0], *narrow, *wide, by_row.input[1]]
    return inputs, [query, *narrow_nodes, *wide_nodes, both, by_row, rows], narrow_attributes


def fuse_cross_attention(model: ModelProto) -> int:
    """Replace every cross-attention block of `model` by one GroupedCrossAttention node, in place; how many were
    replaced."""
    return fuse_blocks(model, FUSED_OP, _block)
