"""fp32 weights stored as fp16 where that loses nothing: about half the bytes of an fp32 model dir, the same numbers.

Checkpoints ship their weights in float16 (model/checkpoint.py), so the fp32 graphs exported from them hold
float32 copies of float16 values: every such weight survives float32 -> float16 -> float32 bit for bit.
Stored as float16 and read through a Cast back to float32, the file halves; ONNX Runtime folds each Cast of
an initializer when it loads the model (constant folding, on at every level but "disable all"), so the
session holds and multiplies the very same float32 weights. Anything that would change (the sinusoidal
position table, a weight trained and saved in float32) stays float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

logger = logging.getLogger(__name__)

# Small constants (scales, shapes, a LayerNorm's 256 gains) stay as they are: a Cast node each would add more
# to the file and to the load than the bytes it saves.
MIN_ELEMENTS = 4096
HALF_SUFFIX = ".fp16"


def exactly_half(values: np.ndarray) -> bool:
    """Whether every value of a float32 array is a float16 value (NaN never is: NaN != NaN)."""
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def store_exact_halves(model: onnx.ModelProto) -> int:
    """In place: each float32 initializer of at least MIN_ELEMENTS values, all exactly float16, becomes a
    float16 initializer `NAME.fp16` and a Cast to float32 named NAME at the head of the graph. Returns the
    bytes saved."""
    graph = model.graph
    graph_inputs = {value.name for value in graph.input}  # an initializer that is also an input can be fed: leave it
    casts, saved = [], 0
    for index, initializer in enumerate(graph.initializer):
        if initializer.data_type != onnx.TensorProto.FLOAT or initializer.name in graph_inputs:
            continue
        values = numpy_helper.to_array(initializer)
        if values.size < MIN_ELEMENTS or not exactly_half(values):
            continue
        name = initializer.name
        graph.initializer[index].CopyFrom(numpy_helper.from_array(values.astype(np.float16), name + HALF_SUFFIX))
        casts.append(helper.make_node("Cast", [name + HALF_SUFFIX], [name], f"{name}.to_float32", to=onnx.TensorProto.FLOAT))
        saved += values.nbytes // 2
    if casts:
        nodes = [*casts, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
    return saved


def has_external_weights(model: onnx.ModelProto) -> bool:
    """Whether `model` (loaded with or without its external data) keeps any initializer in an external data file."""
    return any(uses_external_data(tensor) for tensor in model.graph.initializer)


def store_file_exact_halves(path: Path) -> int:
    """store_exact_halves on the ONNX file at `path`, rewritten in place; returns the bytes saved. A model that keeps
    its weights in an external data file (past protobuf's 2 GB) is left as it is."""
    model = onnx.load(str(path), load_external_data=False)
    if has_external_weights(model):
        return 0
    saved = store_exact_halves(model)
    if saved:
        onnx.save(model, str(path))
        logger.info("%s: %.1f MB of float32 weights stored as the float16 values they are", path.name, saved / 1e6)
    return saved


def expand_exact_halves(model: onnx.ModelProto) -> bool:
    """Undo store_exact_halves in place (each Cast of a float16 initializer to float32 becomes the float32
    initializer it makes), for tools that read weights as initializers (quantization, the fp16 converter).
    Returns whether anything changed."""
    graph = model.graph
    halves = {init.name: index for index, init in enumerate(graph.initializer) if init.data_type == onnx.TensorProto.FLOAT16}
    expanded = []
    for node in graph.node:
        if (node.op_type == "Cast" and len(node.input) == 1 and node.input[0] in halves
                and helper.get_node_attr_value(node, "to") == onnx.TensorProto.FLOAT):  # fmt: skip
            index = halves.pop(node.input[0])
            values = numpy_helper.to_array(graph.initializer[index]).astype(np.float32)
            graph.initializer[index].CopyFrom(numpy_helper.from_array(values, node.output[0]))
            expanded.append(node)
    if expanded:
        kept = [node for node in graph.node if all(node is not cast for cast in expanded)]
        del graph.node[:]
        graph.node.extend(kept)
    return bool(expanded)
