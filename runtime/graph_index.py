"""What the runtime's in-memory graph fusions (runtime/native_fusions.py) look up: who writes and who reads each
tensor, a graph's small constants, node attributes."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

STOCK_DOMAINS = ("", "ai.onnx")
FUSED_DOMAIN = "nmt_serve"  # the native kernels library's domain for the operators only these fusions write


class GraphIndex:
    """Who makes and who reads each tensor of a graph, and its constants of at most one element."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.producer = {output: node for node in graph.node for output in node.output}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.readers[name].append(node)
        self.constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer
                          if tensor.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(tensor.dims)) <= 16}  # fmt: skip
        self.outputs = {value.name for value in graph.output}

    def made_by(self, name: str, op_type: str, domain: tuple[str, ...] = STOCK_DOMAINS) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in domain else None

    def only_reader(self, name: str, node: onnx.NodeProto) -> bool:
        """Whether `node` is the one reader of `name` (and the graph does not output it): the fusion may drop it."""
        return name not in self.outputs and [id(reader) for reader in self.readers[name]] == [id(node)]

    def scalar(self, name: str) -> np.ndarray | None:
        value = self.constants.get(name)
        return value if value is not None and value.size == 1 else None

    def vector(self, name: str) -> list[int] | None:
        """An integer constant of a few elements as a list (shapes, axes); None when `name` is not one."""
        value = self.constants.get(name)
        return [int(item) for item in value.reshape(-1)] if value is not None and value.dtype.kind in "iu" else None


def attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for found in node.attribute:
        if found.name == name:
            return helper.get_attribute_value(found)
    return default


def declare_fused_domain(model: onnx.ModelProto) -> None:
    if all(opset.domain != FUSED_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(FUSED_DOMAIN, 1))
