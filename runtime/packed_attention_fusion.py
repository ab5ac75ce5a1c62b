"""The runtime's in-memory fusion of each encoder layer's self-attention block into one node of the native kernels.

The exporter writes a layer's self-attention on packed rows (export/graphs.py: packed_self_attention) as thirteen
stock nodes after the stacked query, key and value projection: the projection's rows gathered into the (N, S) layout
(Gather on axis 1, Reshape), split in three (Split on axis 2), each part's heads (Reshape, Transpose: the keys to
(N, H, Dh, S)), the scores (MatMul, Div by sqrt(Dh), Add of the mask's bias), Softmax, the weighted values (MatMul),
back to rows (Transpose, Reshape) and the real positions' rows gathered again (Gather on axis 1). With the library
loaded each such block becomes one `nmt_serve.PackedSelfAttention` node (runtime/kernels/packed_self_attention.cc)
reading the projection's rows in place. runtime/native_fusions.py applies it to the copy in memory only; a block in
any other form is left as it is.

Only in a float graph. The kernel sums the dot products in another order than ONNX Runtime's MatMuls, and in an int8
graph a value that moves by one unit in the last place can cross a quantization step, so that the next product moves
by a whole step: fused there, the shipped int8 dir's self-check moved from 2.8e-3 to 5.2e-2, past the 0.05 bound of
an int8 dir with a float cache. A float encoder moves by 3e-6 (the fp32 self-check's bound is 1e-3).
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import GraphIndex, fuse_blocks
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute

FUSED_OP = "PackedSelfAttention"
MAX_HEAD_SIZE = 128  # the kernel's: head sizes that are a multiple of 8 up to this
HEAD_ORDER = [0, 2, 1, 3]  # (N, S, H, Dh) -> (N, H, S, Dh), and back
KEY_ORDER = [0, 2, 3, 1]  # (N, S, H, Dh) -> (N, H, Dh, S)
# An int8 graph's nodes, stock or fused (runtime/row_quantize_fusion.py, runtime/quantized_matmul_fusion.py).
QUANTIZING_OPS = {"QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "MatMulIntegerToFloat", "RowQuantize", "QuantizedMatMul"}


class _Block:
    """A block's nodes as they are matched, each the one reader of what the one before it writes."""

    def __init__(self, graph: GraphIndex) -> None:
        self.graph = graph
        self.nodes: list[NodeProto] = []

    def made_by(self, name: str, op_type: str, reader: NodeProto | None, outputs: int = 1) -> NodeProto | None:
        """The `op_type` node writing `name` (and `outputs` tensors in all), kept when `reader` (None: the caller checks)
        is the only reader of `name`."""
        node = self.graph.made_by(name, op_type)
        if node is None or len(node.output) != outputs or (reader is not None and not self.graph.only_reader(name, reader)):
            return None
        self.nodes.append(node)
        return node

    def transposed(self, name: str, reader: NodeProto, order: list[int]) -> NodeProto | None:
        """The Split output a head Transpose (`order`) of a Reshape reads, through both nodes; the Reshape's shape
        input is the last of the nodes' inputs (the caller reads its head count there)."""
        transpose = self.made_by(name, "Transpose", reader)
        if transpose is None or attribute(transpose, "perm") != order:
            return None
        return self.made_by(transpose.input[0], "Reshape", transpose)


def _heads(graph: GraphIndex, shape_name: str) -> tuple[int, int] | None:
    """(heads, head size) from a head Reshape's shape: a constant (N, S, H, Dh) or the exporter's Concat of N and S
    (read from the input) with constant H and Dh."""
    shape = graph.vector(shape_name)
    if shape is not None:
        return (shape[2], shape[3]) if len(shape) == 4 and min(shape[2:]) > 0 else None
    concat = graph.made_by(shape_name, "Concat")
    if concat is None or len(concat.input) != 4:
        return None
    heads, size = graph.vector(concat.input[2]), graph.vector(concat.input[3])
    if heads is None or size is None or len(heads) != 1 or len(size) != 1 or min(heads[0], size[0]) <= 0:
        return None
    return heads[0], size[0]


def _block(graph: GraphIndex, packed: NodeProto) -> tuple[list[str], list[NodeProto], dict] | None:
    """The fused node's inputs (projections, layout, real positions, bias), the block's nodes and its attributes,
    from the block's last Gather; None when the nodes before it are not the exporter's block."""
    if packed.op_type != "Gather" or attribute(packed, "axis", 0) != 1 or len(packed.output) != 1:
        return None
    block = _Block(graph)
    rows = block.made_by(packed.input[0], "Reshape", packed)
    back = rows and block.made_by(rows.input[0], "Transpose", rows)
    if back is None or attribute(back, "perm") != HEAD_ORDER:
        return None
    weighted = block.made_by(back.input[0], "MatMul", back)
    softmax = weighted and block.made_by(weighted.input[0], "Softmax", weighted)
    if softmax is None or attribute(softmax, "axis", -1) not in (-1, 3):
        return None
    biased = block.made_by(softmax.input[0], "Add", softmax)
    scaled = biased and block.made_by(biased.input[0], "Div", biased)
    divisor = scaled and graph.scalar(scaled.input[1])
    scores = scaled and block.made_by(scaled.input[0], "MatMul", scaled)
    if scores is None or divisor is None or float(divisor.reshape(-1)[0]) <= 0:
        return None
    query = block.transposed(scores.input[0], scores, HEAD_ORDER)
    key = block.transposed(scores.input[1], scores, KEY_ORDER)
    value = block.transposed(weighted.input[1], weighted, HEAD_ORDER)
    if query is None or key is None or value is None:
        return None
    heads = {_heads(graph, part.input[1]) for part in (query, key, value)}
    split = block.made_by(query.input[0], "Split", None, outputs=3)  # its three readers are checked below
    if len(heads) != 1 or None in heads or split is None or attribute(split, "axis") != 2:
        return None
    if list(split.output) != [query.input[0], key.input[0], value.input[0]] or len(split.input) > 1 and split.input[1]:
        return None  # the three parts in that order, split evenly (no sizes input)
    if not all(graph.only_reader(part.input[0], part) for part in (query, key, value)):
        return None
    grid = block.made_by(split.input[0], "Reshape", split)
    unpacked = grid and block.made_by(grid.input[0], "Gather", grid)
    if unpacked is None or attribute(unpacked, "axis", 0) != 1:
        return None
    (head_count, head_size), = heads
    if graph.vector(rows.input[1]) != [1, -1, head_count * head_size] or head_size % 8 or head_size > MAX_HEAD_SIZE:
        return None
    inputs = [unpacked.input[0], unpacked.input[1], packed.input[1], biased.input[1]]
    return inputs, block.nodes, {"num_heads": head_count, "head_size": head_size, "divisor": float(divisor.reshape(-1)[0])}


def fuse_packed_attention(model: ModelProto) -> int:
    """Replace every encoder self-attention block of a float `model` by one PackedSelfAttention node, in place; how many
    (none in a graph that quantizes anything)."""
    if any(node.op_type in QUANTIZING_OPS for node in model.graph.node):
        return 0
    return fuse_blocks(model, FUSED_OP, _block)
