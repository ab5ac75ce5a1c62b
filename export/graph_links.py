"""Who writes and who reads each tensor of an ONNX graph: the maps the graph rewrites in export/ walk."""

from __future__ import annotations

import onnx


def writers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Each node output's name -> the node that writes it."""
    return {output: node for node in graph.node for output in node.output}


def readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Each tensor name -> the nodes that read it, in graph order (a node reading it twice is listed twice)."""
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found
