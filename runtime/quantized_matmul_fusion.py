"""The runtime's in-memory fusion of each int8 weight product, with its row quantization and epilogue, into one node.

After runtime/row_quantize_fusion.py an int8 graph's weight product is `nmt_serve.RowQuantize` -> com.microsoft
MatMulIntegerToFloat (constant int8 weights, per-column scales and zero points; the row scales and the zero point
of the quantization) -> usually Add(constant bias), then a Relu or the residual Add. With the library loaded each such
block becomes one `nmt_serve.QuantizedMatMul` node (runtime/kernels/quantized_matmul.cc) that writes the same bits:
the same levels, exact integer sums, and each rounding of the float epilogue in the graph's order.
runtime/native_fusions.py applies it to the copy in memory only. A block in any other form is left as it is; so are
the nodes after a product that other nodes also read.
"""

from __future__ import annotations

from nmt_serve.runtime.graph_index import FUSED_DOMAIN, GraphIndex, replace_nodes
from nmt_serve.runtime.onnx_proto import ModelProto, NodeProto, attribute, make_node
from nmt_serve.runtime.row_quantize_fusion import FUSED_OP as ROW_QUANTIZE

FUSED_OP = "QuantizedMatMul"
PRODUCT = "MatMulIntegerToFloat"
CONTRIB_DOMAIN = "com.microsoft"
FLOAT = 1  # TensorProto.FLOAT: the bias
INT8 = 3  # TensorProto.INT8: the kernel's weights (u8u8 schemes' uint8 weights stay on ONNX Runtime's product)
PRODUCT_INPUTS = 6  # levels, weight, row scales, weight scale, zero point, weight zero point; a seventh (bias) is another form


def _zero_point(graph: GraphIndex, name: str) -> int | None:
    """The value of a uint8 scalar constant, read through the Identity nodes the exporter puts before it."""
    identity = graph.made_by(name, "Identity")
    while identity is not None:
        name = identity.input[0]
        identity = graph.made_by(name, "Identity")
    value = graph.scalar(name)
    return int(value.reshape(())) if value is not None and value.dtype.kind == "u" and value.itemsize == 1 else None


def _product(graph: GraphIndex, initializers: dict, quantize: NodeProto) -> NodeProto | None:
    """The MatMulIntegerToFloat that alone reads `quantize`'s levels and scales, on constant weights; else None."""
    if quantize.op_type != ROW_QUANTIZE or quantize.domain != FUSED_DOMAIN or len(quantize.output) != 2:
        return None
    product = graph.sole_reader(quantize.output[0], PRODUCT, (CONTRIB_DOMAIN,))
    if product is None or len(product.input) != PRODUCT_INPUTS:
        return None
    levels, weight, row_scales, weight_scale, zero_point, weight_zero_point = product.input
    if levels != quantize.output[0] or row_scales != quantize.output[1] or not graph.only_reader(row_scales, product):
        return None
    weights = initializers.get(weight)
    if weights is None or weights.data_type != INT8 or len(weights.dims) != 2:
        return None
    if not {weight_scale, weight_zero_point} <= initializers.keys():
        return None
    if _zero_point(graph, zero_point) != attribute(quantize, "zero_point"):
        return None
    return product


def product_epilogue(graph: GraphIndex, product: NodeProto, width: int) -> tuple[list[NodeProto], str, str, int]:
    """The nodes after `product` that a fused product's kernel takes over, its bias and residual inputs ('' when none)
    and whether it ends in a Relu: Add(constant float bias of N values), then a Relu or an Add of a tensor the graph
    computes. Shared with runtime/float_matmul_fusion.py."""
    bias_add = graph.sole_reader(product.output[0], "Add")
    if bias_add is None:
        return [], "", "", 0
    bias = next((name for name in bias_add.input if name != product.output[0]), "")
    if graph.constant_dims(bias, FLOAT) != [width] or list(bias_add.input).count(product.output[0]) != 1:
        return [], "", "", 0
    relu = graph.sole_reader(bias_add.output[0], "Relu")
    if relu is not None:
        return [bias_add, relu], bias, "", 1
    residual_add = graph.sole_reader(bias_add.output[0], "Add")
    if residual_add is not None:
        residual = next((name for name in residual_add.input if name != bias_add.output[0]), "")
        if residual and residual not in graph.initializers and list(residual_add.input).count(bias_add.output[0]) == 1:
            return [bias_add, residual_add], bias, residual, 0
    return [bias_add], bias, "", 0


def fuse_quantized_matmuls(model: ModelProto) -> int:
    """Replace every RowQuantize -> MatMulIntegerToFloat block of `model` (with its bias Add and its Relu or residual
    Add) by one QuantizedMatMul node, in place; how many were replaced. The fused node stands where the block's last
    node stood, after every tensor it reads (the residual may be computed after the quantization)."""
    graph = model.graph
    index = GraphIndex(graph)
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    replaced: dict[int, NodeProto] = {}
    dropped: set[int] = set()
    for quantize in graph.node:
        product = _product(index, initializers, quantize)
        if product is None:
            continue
        width = int(initializers[product.input[1]].dims[1])
        epilogue, bias, residual, relu = product_epilogue(index, product, width)
        chain = [quantize, product, *epilogue]
        inputs = [quantize.input[0], product.input[1], product.input[3], product.input[5], bias, residual]
        while inputs and not inputs[-1]:
            inputs.pop()
        replaced[id(chain[-1])] = make_node(
            FUSED_OP, inputs, [chain[-1].output[0]], f"{product.name or product.output[0]}.fused", domain=FUSED_DOMAIN,
            inverse_levels=float(attribute(quantize, "inverse_levels")), zero_point=int(attribute(quantize, "zero_point")), relu=relu)
        dropped.update(id(node) for node in chain[:-1])
    return replace_nodes(model, replaced, dropped)
