"""Precision variants of an exported fp32 graph: fp16 (for CUDA) and int8 dynamic quantization (for CPU)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx

from nmt_serve.export.exact_halves import expand_exact_halves, has_external_weights
from nmt_serve.export.row_quantization import known_shapes, quantize_rows
from nmt_serve.export.shared_weights import inline_shared_weights
from nmt_serve.runtime.graph_links import readers, writers

logger = logging.getLogger(__name__)


def convert_to_fp16(source: Path, target: Path) -> None:
    """fp16 weights and activations with fp32 inputs/outputs, so callers feed and read fp32.

    The model's mask bias is -1e4, finite in fp16 (-inf or -1e9 would turn a fully masked row into NaN).
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    fp32 = onnx.load(str(source))
    expand_exact_halves(fp32)  # the converter wants the weights as float32 initializers
    model = OnnxModel(convert_float_to_float16(fp32, keep_io_types=True))
    keep_in_fp32(model.model, FP32_OPS_IN_FP16)
    # The converter appends input casts after their users; onnx.checker wants topological order.
    model.topological_sort()
    onnx.save(model.model, str(target))


# The decoder's self-attention over the per-row cache, and the cache itself, stay fp32 in an fp16 graph. ONNX Runtime's CUDA
# GroupQueryAttention (fp16 only) parted from the CPU within four steps on an H100 when rows sat at different
# positions with the cache bound in host memory (log-prob differences 0.016, 0.65, 2.65, 3.66, and different
# on a second run of the same feeds); the same node in fp32 gave 0.016 at every step. CUDA has no fp32
# kernel for it, so ONNX Runtime runs it on the CPU provider, as it does in an fp32 graph.
FP32_OPS_IN_FP16 = {"GroupQueryAttention": (0, 1, 2, 3, 4)}  # op -> its float inputs (query, key, value, past K, past V)


def cast_node(source: str, target: str, name: str, to: int) -> onnx.NodeProto:
    return onnx.helper.make_node("Cast", [source], [target], name, to=to)


def keep_in_fp32(model: onnx.ModelProto, float_inputs_by_op: dict[str, tuple[int, ...]]) -> None:
    """Run the nodes of these ops in fp32 inside an fp16 graph: Cast their float inputs up and every output down.

    Only ops whose outputs are all of their float inputs' type qualify (GroupQueryAttention: output, present K and V).
    An input that is an fp32 graph input cast down by the converter is read as it came, and an output the converter
    casts back up into a graph output is written there directly: the cache in and out stays fp32, with no
    fp16 round trip (and on CUDA no device copy of it, the node running on the CPU provider).
    """
    graph = model.graph
    fp32_graph_inputs = {value.name for value in graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    graph_outputs = {value.name for value in graph.output}
    producers, consumers = writers(graph), readers(graph)

    def is_cast(node: onnx.NodeProto | None, to: int) -> bool:
        return node is not None and node.op_type == "Cast" and onnx.helper.get_node_attr_value(node, "to") == to

    def output_cast_up(name: str) -> onnx.NodeProto | None:
        """The converter's Cast that alone reads `name` and writes a graph output, if that is what reads it."""
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and is_cast(users[0], onnx.TensorProto.FLOAT) and users[0].output[0] in graph_outputs else None

    nodes = list(graph.node)
    bypassed = {id(cast) for node in nodes if node.op_type in float_inputs_by_op for cast in map(output_cast_up, node.output) if cast}
    del graph.node[:]
    for node in nodes:
        if id(node) in bypassed:
            continue
        float_inputs = float_inputs_by_op.get(node.op_type)
        if float_inputs is None:
            graph.node.append(node)
            continue
        for index in float_inputs:
            name = node.input[index] if index < len(node.input) else ""
            if not name:  # an omitted optional input stays omitted
                continue
            down = producers.get(name)
            if is_cast(down, onnx.TensorProto.FLOAT16) and down.input[0] in fp32_graph_inputs:
                node.input[index] = down.input[0]
                continue
            graph.node.append(cast_node(name, f"{name}.fp32_in", f"{node.name}.cast_in{index}", onnx.TensorProto.FLOAT))
            node.input[index] = f"{name}.fp32_in"
        casts_down = []
        for index, name in enumerate(list(node.output)):
            cast_up = output_cast_up(name)
            if cast_up is not None:
                node.output[index] = cast_up.output[0]
                continue
            node.output[index] = f"{name}.fp32_out"
            casts_down.append(cast_node(f"{name}.fp32_out", name, f"{node.name}.cast_out{index}", onnx.TensorProto.FLOAT16))
        graph.node.extend([node, *casts_down])
    # The converter's input Casts that nothing reads any more.
    read = {name for node in graph.node for name in node.input} | graph_outputs
    kept = [node for node in graph.node if node.op_type != "Cast" or any(out in read for out in node.output)]
    del graph.node[:]
    graph.node.extend(kept)


INT8_SCHEMES = ("u8s8-rows", "u8s8-rows-vnni", "u8u8-rows", "u8s8-reduce-range", "u8u8", "u8s8", "u8s8-fp32-logits", "w8-fp32", "w8a8-rows")
ROW_SCHEMES = ("u8s8-rows", "u8s8-rows-vnni", "u8u8-rows")  # activations quantized per row (export/row_quantization.py)
DEFAULT_INT8_SCHEME = INT8_SCHEMES[0]
OUTPUT_PROJECTION = "logits"  # the decoder graph's vocabulary MatMul (export/decoder_graph.py)
PROTOBUF_LIMIT = 2**31  # bytes: an ONNX file larger than this must keep its weights in an external data file


def convert_to_int8(source: Path, target: Path, scheme: str = DEFAULT_INT8_SCHEME) -> None:
    """Dynamic int8 quantization of MatMul weights (per channel) and of the embedding Gather.

    Activations are quantized per call to uint8 (except w8-fp32). The schemes differ in how:
    - u8s8-rows (the default): every row of an activation (one token's vector) gets its own scale,
      max|x| / 127, and zero point 128 (export/row_quantization.py), so a row's int8 input, and with exact
      integer products its result, does not depend on the other rows of the call: a request's output
      is the same alone or batched with any others. 7-bit signed weights as in u8s8-reduce-range.
    - u8s8-rows-vnni: the same per-row activations with 8-bit signed weights, for hosts whose u8s8 kernel sums
      products in 32-bit lanes (VNNI, AMX): there as fast as u8s8-rows and closer to fp32 (the default model,
      1,000 held-out sentences: 86.6% / 88.0% of greedy / beam-4 outputs equal to fp32's, against 83.8% / 84.1%).
      Elsewhere (AVX2, AVX-512 without VNNI) pairs of products saturate 16-bit lanes and the results depend on
      the CPU: the start-up self-check refuses such a dir there (runtime/self_check.py EIGHT_BIT_SIGNED_SCHEMES).
    - u8u8-rows: the same per-row activations with 8-bit unsigned weights (a zero point per column), multiplied
      in 16-bit lanes that accumulate in 32 bits, so exact on every x86 kernel: the 8th weight bit brings it
      closer to fp32 than u8s8-rows (7 bits cost about as much agreement with fp32 as all the activation
      quantization), at the cost of the u8s8 kernels (VNNI's included).
    - u8s8-reduce-range: one scale for the whole activation tensor (ONNX Runtime's DynamicQuantizeLinear),
      so a row's result depends on the rows it is batched with. 7-bit signed weights: x86 kernels without
      VNNI add pairs of u8 x s8 products in saturating 16-bit lanes; with 7 bits a pair is at most
      2 x 255 x 64 = 32640, under the lane's 32767, so the products are exact on AVX2, AVX-512 and VNNI
      alike, and the fast u8s8 kernels (VNNI's included) still run.
    - u8u8: 8-bit unsigned weights, multiplied in 16-bit lanes that accumulate in 32 bits: exact
      everywhere too, level at batch 1 but 6-14% fewer tokens/s at 8-32 rows on an AVX2 core, and off
      the VNNI kernels.
    - u8s8: 8-bit signed weights: exact on VNNI, saturating without it, so a model dir's outputs
      depend on the CPU (on an AVX2-only core 75% of held-out greedy outputs equal fp32's, against 83-84%
      for the exact schemes).
    - u8s8-fp32-logits: u8s8 with the vocabulary projection left in fp32.
    - w8-fp32: 8-bit weights in blocks of 32 (MatMulNBits), dequantized and multiplied in fp32:
      the closest to fp32, but 1.6-11x slower than fp32 on ONNX Runtime's CPU kernels.
    - w8a8-rows: the same 8-bit weight blocks, multiplied in int8 (MatMulNBits accuracy level 4), which
      quantizes each row's activations per block of 32 itself: batch-invariant and the closest of the
      int8 schemes to fp32, slower than u8s8-rows from 8 rows up, and measured only on AVX-512 VNNI.
    bench/results/int8_schemes.md has the measurements (nmt-int8-schemes).

    Pre-processing first: without it the tied output projection (a transposed embedding) stays
    fp32 and int8 gives no speed-up. Quantizing the embedding Gather too halves the dirs
    (24.9 -> 12.6 MB for the default model) at the same step time.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if scheme not in INT8_SCHEMES:
        raise ValueError(f"int8 scheme must be one of {', '.join(INT8_SCHEMES)}, got {scheme!r}")
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        fp32 = onnx.load(str(source), load_external_data=False)  # read once: for external data and for halves
        # An fp32 dir's shared tables go back into the graph, so it is converted as a graph holding its own weights.
        inlined = inline_shared_weights(fp32, source.parent)
        external = has_external_weights(fp32)
        expanded = not external and expand_exact_halves(fp32)  # quantization finds weights only as float32 initializers
        if expanded or inlined:
            source = Path(tmp) / "float32.onnx"
            onnx.save(fp32, str(source))
        # The pre-processing folds the tied output projection (a Transpose of the embedding) into a second copy of
        # it, so its models can be twice the source: past protobuf's 2 GB (NLLB-200 600M's 1 GB embedding) they
        # must keep their weights in a file beside them, or the folding fails quietly and every int8 step
        # dequantizes and transposes the whole embedding (3.2x slower there). A source with external data
        # (NLLB-200 600M's fp32 encoder) needs it too, or the pre-processing cannot read its own output back.
        large = external or 2 * source.stat().st_size >= PROTOBUF_LIMIT
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True, save_as_external_data=large, all_tensors_to_one_file=True)
        op_types = ["MatMul", "Gemm", "Gather"]
        if scheme in ("w8-fp32", "w8a8-rows"):
            quantize_weights_blockwise(prepared, prepared, accuracy_level=4 if scheme == "w8a8-rows" else None)
            op_types = ["Gather"]
        weight_type = QuantType.QUInt8 if scheme in ("u8u8", "u8u8-rows") else QuantType.QInt8
        excluded = [OUTPUT_PROJECTION] if scheme == "u8s8-fp32-logits" else []
        # Shape inference knows nothing of the contrib attention ops' outputs: they are float.
        quantize_dynamic(str(prepared), str(target), weight_type=weight_type, per_channel=True, op_types_to_quantize=op_types,
                         reduce_range=scheme in ("u8s8-reduce-range", "u8s8-rows"), nodes_to_exclude=excluded,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip
        if scheme in ROW_SCHEMES:
            model = onnx.load(str(target))
            quantize_rows(model, known_shapes(onnx.load(str(prepared), load_external_data=False)))
            onnx.save(model, str(target))


def quantize_weights_blockwise(source: Path, target: Path, block_size: int = 32, accuracy_level: int | None = None) -> None:
    """MatMul weights to symmetric 8-bit blocks (MatMulNBits); activations stay fp32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=8, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level)
    quantizer.process()
    onnx.save(quantizer.model.model, str(target))


def convert_precision(source: Path, target: Path, precision: str, int8_scheme: str = DEFAULT_INT8_SCHEME) -> None:
    if precision == "int8":
        convert_to_int8(source, target, int8_scheme)
    elif precision == "fp16":
        convert_to_fp16(source, target)
    else:
        raise ValueError(f"no conversion to {precision!r}; choose one of fp16, int8")
    logger.info("%s -> %s (%s)", source.name, target, precision)
