"""The decoder's weight MatMuls alone, as ONNX Runtime runs them: a ceiling on any engine's tokens/s over these kernels.

A decoder step multiplies every row by every weight matrix (self-attention QKV and output,
cross-attention query and output, the FFN, the output projection). Those products are the part
no scheduling, caching or host code can remove. This module cuts them out of the model dir's
decoder, after ONNX Runtime's own graph optimisations (so the int8 graph's MatMuls are the fused
kernels the engine runs: DynamicQuantizeMatMul with one activation scale per call, MatMulIntegerToFloat
on activations already quantized per row), into a graph of those nodes alone, and times one
call per step at the step's rows. A cell's tokens/s can be no higher than its best hypotheses'
tokens per step over that time: attention, layer norms, log-softmax, the encoder and the engine's
host work all come on top. Where that ceiling is below a target, the target cannot be reached
with these kernels on these weights, whatever the engine around them does.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from nmt_serve.bench.systems import Cell
from nmt_serve.runtime.manifest import load_model_dir

# Weight products as they stand in an optimised decoder: (op type, domain) -> the element type of input 0, the
# activation; the weight is input 1. MatMulIntegerToFloat takes rows quantized before it (export/row_quantization.py):
# the quantization is not a weight product, so its input here is already uint8, and its activation scale, one per
# row (input 2), is fed as `row_scale` (rows, 1): the kernel multiplies its output by it.
WEIGHT_PRODUCTS = {("MatMul", ""): TensorProto.FLOAT, ("DynamicQuantizeMatMul", "com.microsoft"): TensorProto.FLOAT,
                   ("MatMulIntegerToFloat", "com.microsoft"): TensorProto.UINT8}  # fmt: skip
ROW_SCALE = "row_scale"
ROW_SCALE_INPUT = 2  # MatMulIntegerToFloat's activation scale
IR_VERSION = 9  # accepted by every onnxruntime this project supports; the optimised file may carry a newer one


def optimized_decoder(decoder_path: Path, threads: int) -> onnx.ModelProto:
    """The decoder as an ONNX Runtime CPU session runs it (fusions applied, as in runtime/ort_step.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3  # the optimised file's "hardware specific" warning is expected here
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        # From bytes with every weight read in: an optimised file written from a graph that points into the model
        # dir's shared_weights.bin would point there from the temporary dir.
        graph = onnx.load(str(decoder_path)).SerializeToString()
        ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"], disabled_optimizers=["SkipLayerNormFusion"])
        return onnx.load(options.optimized_model_filepath)


def weight_products_model(decoder: onnx.ModelProto) -> onnx.ModelProto:
    """A graph of the decoder's weight products alone; input `x{K}` (rows, K) feeds every float product of inner size
    K, `q{K}` every one taking uint8 rows."""
    initializers = {tensor.name: tensor for tensor in decoder.graph.initializer}
    nodes, outputs, used, inputs = [], [], [], {}
    for node in decoder.graph.node:
        if (node.op_type, node.domain) not in WEIGHT_PRODUCTS or node.input[1] not in initializers:
            continue
        inner, width = initializers[node.input[1]].dims  # (K, N): every kind takes the weight unpacked and untransposed
        element = WEIGHT_PRODUCTS[(node.op_type, node.domain)]
        source = f"{'q' if element == TensorProto.UINT8 else 'x'}{inner}"
        inputs[source] = helper.make_tensor_value_info(source, element, ["rows", inner])
        node_inputs = [source, *node.input[1:]]
        if node.op_type == "MatMulIntegerToFloat" and node.input[ROW_SCALE_INPUT] not in initializers:
            node_inputs[ROW_SCALE_INPUT] = ROW_SCALE
            inputs[ROW_SCALE] = helper.make_tensor_value_info(ROW_SCALE, TensorProto.FLOAT, ["rows", 1])
        constants = [name for name in node_inputs[1:] if name and name != ROW_SCALE]
        missing = [name for name in constants if name not in initializers]
        if missing:
            raise ValueError(f"{node.name}: inputs {missing} are not constants; cannot time it alone")
        used += [name for name in constants if name not in used]
        nodes.append(helper.make_node(node.op_type, node_inputs, [node.output[0]], name=node.name, domain=node.domain))
        nodes[-1].attribute.extend(node.attribute)
        outputs.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, ["rows", width]))
    if not nodes:
        raise ValueError("the decoder has no weight MatMul that ONNX Runtime left as MatMul or a fused int8 product")
    graph = helper.make_graph(nodes, "weight_products", [inputs[name] for name in sorted(inputs)], outputs, [initializers[name] for name in used])
    opsets = [opset for opset in decoder.opset_import if opset.domain in ("", "com.microsoft")]
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=opsets)


class MatmulCeiling:
    """A bench System (bench/systems.py): per step one call of the weight products at the step's rows
    (batch x beam); it reports the best hypotheses' tokens, so its tokens/s is the cell's ceiling."""

    def __init__(self, model_dir: Path, threads: int, label: str) -> None:
        decoder_path = load_model_dir(model_dir).graph_path(model_dir, "decoder")
        model = weight_products_model(optimized_decoder(decoder_path, threads))
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.inputs = [(tensor.name, int(tensor.type.tensor_type.shape.dim[1].dim_value), tensor.type.tensor_type.elem_type) for tensor in model.graph.input]
        self.outputs = [(tensor.name, int(tensor.type.tensor_type.shape.dim[1].dim_value)) for tensor in model.graph.output]  # (name, N)
        self.name = f"nmt-serve {label} MatMuls alone"
        self._feeds: dict[int, dict[str, np.ndarray]] = {}

    def feed(self, rows: int) -> dict[str, np.ndarray]:
        if rows not in self._feeds:
            rng = np.random.default_rng(rows)
            # Non-negative like post-ReLU activations; a quantized kernel's time does not depend on the values.
            self._feeds[rows] = {name: rng.random((rows, inner), dtype=np.float32) if element == TensorProto.FLOAT
                                 else rng.integers(0, 256, (rows, inner), dtype=np.uint8) for name, inner, element in self.inputs}  # fmt: skip
        return self._feeds[rows]

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        feed = self.feed(len(sources) * cell.beam)
        for _ in range(cell.length):
            self.session.run(None, feed)
        return len(sources) * cell.length
