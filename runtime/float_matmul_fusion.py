"""The runtime's in-memory fusion of each float weight product, with its epilogue, into one node.

A float graph's weight product is MatMul against a constant (K, N) weight (an initializer, or one ONNX Runtime folds
from a Cast or Transpose of one when it loads the graph), usually then Add(constant bias), then a Relu or the residual
Add. With the library loaded each such block becomes one `nmt_serve.FloatMatMul` node
(runtime/kernels/float_matmul.cc): one fused multiply-add per k in k's order, then the epilogue in the graph's order.
That is within float rounding of ONNX Runtime's MatMul, not the same bits, so graphs with int8 weights are left as they
are: there a moved rounding can move a quantization level and the results (their products are
runtime/quantized_matmul_fusion.py's). runtime/native_fusions.py applies it to the copy in memory only, and only on a
CPU with AVX-512, where it was measured faster than ONNX Runtime's products (1.00x-1.14x the fp32 engine's tokens/s on
an Intel Xeon with AMX). Its AVX2 tiles, which every supported CPU can run, are tested for the same bits but were not
measured against ONNX Runtime's AVX2 products on an AVX2-only CPU, so such a CPU keeps ONNX Runtime's.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import FUSED_DOMAIN, STOCK_DOMAINS, GraphIndex, replace_nodes
from nmt_serve.runtime.host import cpu_facts
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, make_node
from nmt_serve.runtime.quantized_matmul_fusion import product_epilogue

FUSED_OP = "FloatMatMul"
FLOAT = 1  # TensorProto.FLOAT
INTEGER_TYPES = {2, 3}  # TensorProto.UINT8 and INT8: weights of an int8 graph


def _weight_width(graph: GraphIndex, node: NodeProto) -> int | None:
    """N, when `node` is a stock MatMul of a tensor and a constant float (K, N) weight; else None."""
    if node.op_type != "MatMul" or node.domain not in STOCK_DOMAINS or len(node.input) != 2 or len(node.output) != 1:
        return None
    dims = graph.constant_dims(node.input[1], FLOAT)
    return int(dims[1]) if dims is not None and len(dims) == 2 else None


def fusion_pays_here() -> bool:
    """Whether this CPU has AVX-512, where the fused products were measured faster than ONNX Runtime's."""
    return "avx512f" in cpu_facts()["features"]


def fuse_float_matmuls(model: ModelProto) -> int:
    """Replace every float weight product of a float `model` (with its bias Add and its Relu or residual Add) by one
    FloatMatMul node, in place; how many were replaced (0 for a graph with int8 weights, and on a CPU without AVX-512).
    The fused node stands where the block's last node stood, after every tensor it reads."""
    graph = model.graph
    if not fusion_pays_here() or any(tensor.data_type in INTEGER_TYPES for tensor in graph.initializer):
        return 0
    index = GraphIndex(graph)
    replaced: dict[int, NodeProto] = {}
    dropped: set[int] = set()
    for product in graph.node:
        width = _weight_width(index, product)
        if width is None:
            continue
        epilogue, bias, residual, relu = product_epilogue(index, product, width)
        chain = [product, *epilogue]
        inputs = [product.input[0], product.input[1], bias, residual]
        while not inputs[-1]:
            inputs.pop()
        replaced[id(chain[-1])] = make_node(FUSED_OP, inputs, [chain[-1].output[0]], f"{product.name or product.output[0]}.fused",
                                            domain=FUSED_DOMAIN, relu=relu)  # fmt: skip
        dropped.update(id(node) for node in chain[:-1])
    return replace_nodes(model, replaced, dropped)
