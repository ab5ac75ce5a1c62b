"""The runtime's in-memory fusion of the layout moves an int8 encoder makes around its attention products.

The exporter writes the encoder on packed rows (export/graphs.py): a layer's self-attention gathers its stacked
projection's rows into the (N, S) grid (Gather on axis 1, Reshape), splits them in three (Split on axis 2) and lays
out each part's heads (Reshape, Transpose: the keys to (N, H, Dh, S)); then come the scores, softmax and weighted
values; then back to rows (Transpose, Reshape) and the real positions' rows gathered (Gather on axis 1). The cross
projection after the last layer is laid out the same way, in one part for each decoder layer's keys and values. With
the library loaded, each gather-split-heads run becomes one `nmt_serve.PackedToHeads` node and each
heads-to-rows run one `nmt_serve.HeadsToPacked` node (runtime/kernels/head_layout.cc), which copy each value once,
so the bits are the stock nodes'. The scores, softmax and weighted values stay ONNX Runtime's nodes: in an int8
graph a kernel that sums them in another order moves quantization levels (runtime/packed_attention_fusion.py, which
fuses a float graph's whole self-attention block instead and so runs first). runtime/native_fusions.py applies both
to the copy in memory only; a block in any other form is left as it is.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import FUSED_DOMAIN, GraphIndex, fuse_blocks, replace_nodes
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute, make_node
from nmt_serve.runtime.packed_attention_fusion import HEAD_ORDER, KEY_ORDER, QUANTIZING_OPS

TO_HEADS_OP = "PackedToHeads"
TO_PACKED_OP = "HeadsToPacked"
PART_ORDERS = {tuple(HEAD_ORDER): 0, tuple(KEY_ORDER): 1}  # a part's Transpose -> the kernel's `transposed` flag


def _concat_of_input_shape(graph: GraphIndex, name: str, constants: int) -> bool:
    """Whether `name` is the exporter's shape: Concat of the input's N and S (Shape slices) and `constants` constants of
    one positive value each, so that every value is exact (no 0 or -1 for the Reshape to fill in)."""
    concat = graph.made_by(name, "Concat")
    if concat is None or len(concat.input) != 2 + constants:
        return False
    if any(graph.made_by(part, "Shape") is None for part in concat.input[:2]):
        return False
    values = [graph.vector(part) for part in concat.input[2:]]
    return all(value is not None and len(value) == 1 and value[0] > 0 for value in values)


def _to_heads(graph: GraphIndex, split: NodeProto) -> tuple[NodeProto, list[NodeProto], list[NodeProto]] | None:
    """From a Split on axis 2 into even parts: the fused node, the block's nodes and its Transposes (the fused node
    takes the place of the first of them in graph order); None when the block is not the exporter's."""
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or attribute(split, "axis") != 2:
        return None
    if len(split.input) > 1 and split.input[1]:
        return None  # parts of given sizes, not even ones
    grid = graph.made_by(split.input[0], "Reshape")
    gathered = grid and graph.made_by(grid.input[0], "Gather")
    if gathered is None or attribute(gathered, "axis", 0) != 1 or attribute(grid, "allowzero", 0) != 1:
        return None
    if not (graph.only_reader(gathered.output[0], grid) and graph.only_reader(grid.output[0], split)):
        return None
    if not _concat_of_input_shape(graph, grid.input[1], 1):
        return None
    reshapes, transposes, flags = [], [], []
    for part in split.output:
        reshape = graph.sole_reader(part, "Reshape")
        transpose = reshape and graph.sole_reader(reshape.output[0], "Transpose")
        if transpose is None or attribute(reshape, "allowzero", 0) != 1 or tuple(attribute(transpose, "perm") or ()) not in PART_ORDERS:
            return None
        reshapes.append(reshape)
        transposes.append(transpose)
        flags.append(PART_ORDERS[tuple(attribute(transpose, "perm"))])
    head_shape = reshapes[0].input[1]
    if any(reshape.input[1] != head_shape for reshape in reshapes) or not _concat_of_input_shape(graph, head_shape, 2):
        return None
    fused = make_node(TO_HEADS_OP, [gathered.input[0], gathered.input[1], grid.input[1], head_shape],
                      [transpose.output[0] for transpose in transposes], f"{split.name or split.output[0]}.heads.fused",
                      domain=FUSED_DOMAIN, transposed=flags)  # fmt: skip
    return fused, [gathered, grid, split, *reshapes, *transposes], transposes


def _to_packed(graph: GraphIndex, packed: NodeProto) -> tuple[list[str], list[NodeProto], dict] | None:
    """The fused node's inputs (the heads, the real positions), the block's nodes and no attributes, from the block's
    Gather on axis 1; None when the nodes before it are not the exporter's block."""
    if packed.op_type != "Gather" or packed.domain not in ("", "ai.onnx") or attribute(packed, "axis", 0) != 1:
        return None
    rows = graph.made_by(packed.input[0], "Reshape")
    back = rows and graph.made_by(rows.input[0], "Transpose")
    if back is None or attribute(back, "perm") != HEAD_ORDER:
        return None
    if not (graph.only_reader(back.output[0], rows) and graph.only_reader(rows.output[0], packed)):
        return None
    shape = graph.vector(rows.input[1])
    if shape is None or len(shape) != 3 or shape[:2] != [1, -1]:
        return None  # (1, N x S, H x Dh): H x Dh is checked against the heads when the node runs
    return [back.input[0], packed.input[1]], [back, rows, packed], {}


def fuse_head_layouts(model: ModelProto) -> int:
    """Replace the layout moves before and after each encoder self-attention of an int8 `model` by one node each, in
    place; how many nodes went in (none in a float graph, whose whole blocks runtime/packed_attention_fusion.py fuses)."""
    if not any(node.op_type in QUANTIZING_OPS for node in model.graph.node):
        return 0
    index = GraphIndex(model.graph)
    order = {id(node): place for place, node in enumerate(model.graph.node)}
    replaced: dict[int, NodeProto] = {}
    dropped: set[int] = set()
    for node in model.graph.node:
        found = _to_heads(index, node)
        if found is not None:
            # Where the first Transpose stood every input is made (the Reshapes before it read the same head shape) and
            # no reader of the outputs has run yet.
            fused, nodes, transposes = found
            place = min(transposes, key=lambda transpose: order[id(transpose)])
            replaced[id(place)] = fused
            dropped.update(id(part) for part in nodes if part is not place)
    to_heads = replace_nodes(model, replaced, dropped)
    return to_heads + fuse_blocks(model, TO_PACKED_OP, _to_packed)
