"""Two sessions over one small graph: its stock nodes on ONNX Runtime's kernels, and the fused node that replaces them
on the native kernels library; for holding a fused kernel to the nodes it stands for."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
from onnx import TensorProto, ValueInfoProto, helper

from nmt_serve.runtime.graph_index import FUSED_DOMAIN

CPU = ["CPUExecutionProvider"]


def stock_and_fused(library: Path, stock_nodes: list, fused_nodes: list, inputs: list[ValueInfoProto], outputs: list[ValueInfoProto],
                    constants: list[TensorProto]) -> tuple[ort.InferenceSession, ort.InferenceSession]:  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(FUSED_DOMAIN, 1)]

    def session(nodes: list, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
        model = helper.make_model(helper.make_graph(nodes, "block", inputs, outputs, constants), opset_imports=opsets, ir_version=10)
        return ort.InferenceSession(model.SerializeToString(), options, providers=CPU)

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return session(stock_nodes), session(fused_nodes, options)
