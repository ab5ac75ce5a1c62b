"""Who writes and who reads each tensor of an ONNX graph: the maps every graph rewrite walks, the exporter's (export/)
and the runtime's in-memory fusions (runtime/native_fusions.py). Duck-typed over the graph message, so it serves the
onnx package's GraphProto and runtime/onnx_proto.py's alike, and the serving path needs no onnx package."""

from __future__ import annotations

from typing import Any

Graph = Any  # a GraphProto: of the onnx package, or of runtime/onnx_proto.py
Node = Any  # a NodeProto of either


def writers(graph: Graph) -> dict[str, Node]:
    """Each node output's name -> the node that writes it."""
    return {output: node for node in graph.node for output in node.output}


def readers(graph: Graph) -> dict[str, list[Node]]:
    """Each tensor name -> the nodes that read it, in graph order (a node reading it twice is listed twice)."""
    found: dict[str, list[Node]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found
