"""What the runtime's in-memory graph fusions (runtime/native_fusions.py) look up: who writes and who reads each
tensor, and a graph's small constants."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from nmt_serve.runtime.graph_links import readers, writers
from nmt_serve.runtime.onnx_proto import EXTERNAL, ModelProto, NodeProto, attribute, make_node, small_tensor

STOCK_DOMAINS = ("", "ai.onnx")
FUSED_DOMAIN = "nmt_serve"  # the native kernels library's domain for the operators only these fusions write


class GraphIndex:
    """Who makes and who reads each tensor of a graph, and its constants of at most 16 elements."""

    def __init__(self, graph) -> None:  # a GraphProto of runtime/onnx_proto.py
        self.producer = writers(graph)
        self.readers = readers(graph)
        self.initializers = {tensor.name: tensor for tensor in graph.initializer}
        self.constants: dict[str, np.ndarray] = {}
        for tensor in graph.initializer:
            value = small_tensor(tensor) if tensor.data_location != EXTERNAL and int(np.prod(tensor.dims)) <= 16 else None
            if value is not None:
                self.constants[tensor.name] = value
        self.outputs = {value.name for value in graph.output}

    def made_by(self, name: str, op_type: str, domain: tuple[str, ...] = STOCK_DOMAINS) -> NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in domain else None

    def only_reader(self, name: str, node: NodeProto) -> bool:
        """Whether `node` is the one reader of `name` (and the graph does not output it): the fusion may drop it."""
        return name not in self.outputs and [id(reader) for reader in self.readers.get(name, [])] == [id(node)]

    def sole_reader(self, name: str, op_type: str, domain: tuple[str, ...] = STOCK_DOMAINS) -> NodeProto | None:
        """The one node reading `name` when it is an `op_type` of `domain` and the graph does not output `name`."""
        readers = self.readers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != op_type or readers[0].domain not in domain:
            return None
        return readers[0] if self.only_reader(name, readers[0]) else None

    def scalar(self, name: str) -> np.ndarray | None:
        value = self.constants.get(name)
        return value if value is not None and value.size == 1 else None

    def constant_dims(self, name: str, data_type: int) -> list[int] | None:
        """The dims of `name` when the session will hold it as a constant of `data_type`: an initializer, or a Cast to
        that type or a 2-D Transpose of such a constant, which ONNX Runtime folds into an initializer when it loads the
        graph (a float graph keeps its fp16-exact weights as float16 behind a Cast: export/exact_halves.py). Else None."""
        node = self.producer.get(name)
        if node is None:
            tensor = self.initializers.get(name)
            return list(tensor.dims) if tensor is not None and tensor.data_type == data_type else None
        if node.domain not in STOCK_DOMAINS or len(node.input) != 1:
            return None
        if node.op_type == "Cast" and attribute(node, "to") == data_type:
            source = self.initializers.get(node.input[0])
            return list(source.dims) if source is not None and node.input[0] not in self.producer else None
        if node.op_type == "Transpose":
            dims = self.constant_dims(node.input[0], data_type)
            return list(reversed(dims)) if dims is not None and len(dims) == 2 and attribute(node, "perm", [1, 0]) == [1, 0] else None
        return None

    def vector(self, name: str) -> list[int] | None:
        """An integer constant of a few elements as a list (shapes, axes); None when `name` is not one."""
        value = self.constants.get(name)
        return [int(item) for item in value.reshape(-1)] if value is not None and value.dtype.kind in "iu" else None


def declare_fused_domain(model: ModelProto) -> None:
    if all(opset.domain != FUSED_DOMAIN for opset in model.opset_import):
        model.opset_import.add(domain=FUSED_DOMAIN, version=1)


def replace_nodes(model: ModelProto, replaced: dict[int, NodeProto], dropped: set[int]) -> int:
    """A fusion's edit, in place: each node whose id is in `replaced` becomes its fused node (where it stood, so the
    order stays topological), those in `dropped` go; the fused domain is declared. How many fused nodes went in. The
    caller holds the node objects whose ids it passes (a message's id is its identity only while the object lives)."""
    if not replaced and not dropped:
        return 0
    graph = model.graph
    kept = [replaced.get(id(node), node) for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    declare_fused_domain(model)
    return len(replaced)


# A fusion's matcher: for the last node of a block, the fused node's inputs, the block's nodes (that last one included
# or not) and the fused node's attributes; None where the node ends no block of the fusion's form.
BlockMatcher = Callable[["GraphIndex", NodeProto], "tuple[list[str], list[NodeProto], dict] | None"]


def fuse_blocks(model: ModelProto, op_type: str, match: BlockMatcher) -> int:
    """Replace every block `match` finds by one `op_type` node of the fused domain writing the block's last node's
    outputs, in place (replace_nodes); how many were replaced."""
    index = GraphIndex(model.graph)
    replaced: dict[int, NodeProto] = {}  # id(a block's last node) -> its fused node
    dropped: set[int] = set()
    for node in model.graph.node:
        found = match(index, node)
        if found is None:
            continue
        inputs, nodes, attributes = found
        replaced[id(node)] = make_node(op_type, inputs, list(node.output), f"{node.name or node.output[0]}.fused", domain=FUSED_DOMAIN,
                                       **attributes)  # fmt: skip
        dropped.update(id(part) for part in nodes if part is not node)
    return replace_nodes(model, replaced, dropped)
