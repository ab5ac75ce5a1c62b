"""The in-memory fusion of an int8 decoder's input embedding (runtime/decoder_embedding_fusion.py) and the native
kernel that runs the fused node (runtime/kernels/decoder_embedding.cc): the stock nodes' floats, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.decoder_embedding_fusion import FUSED_OP, fuse_decoder_embedding
from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.onnx_proto import parse_model
from tests.decoder_calls import fused_and_stock_calls, model_dir_for
from tests.node_sessions import stock_and_fused

EMBEDDING_NODES = ("Gather", "DequantizeLinear", "Mul", "Unsqueeze")


@pytest.mark.parametrize("model", ["int8", "imported Marian int8", "imported NLLB int8"])
def test_an_int8_decoders_embedding_becomes_one_node(model: str, request: pytest.FixtureRequest) -> None:
    graph = parse_model((model_dir_for(model, request, {"int8": "int8_dir"}) / "decoder.onnx").read_bytes())
    before = [node.op_type for node in graph.graph.node]
    assert fuse_decoder_embedding(graph) == 1
    after = [node.op_type for node in graph.graph.node]
    assert after.count(FUSED_OP) == 1
    assert "DequantizeLinear" not in after and after.count("Gather") == before.count("Gather") - 2
    assert fuse_decoder_embedding(graph) == 0


def test_a_float_decoders_embedding_is_left_as_it_is(tiny_model_dir: Path) -> None:
    """Float tables are not the kernel's form: nothing is fused."""
    assert fuse_decoder_embedding(parse_model((tiny_model_dir / "decoder.onnx").read_bytes())) == 0


def test_a_position_unsqueezed_on_another_axis_is_left_as_it_is(int8_dir: Path) -> None:
    graph = parse_model((int8_dir / "decoder.onnx").read_bytes())
    unsqueeze = next(node for node in graph.graph.node if node.op_type == "Unsqueeze" and node.output[0] == "position_embedding_3d")
    other_axis = next(tensor for tensor in graph.graph.initializer if tensor.name == unsqueeze.input[1])
    other_axis.raw_data = np.array([0], np.int64).tobytes()
    assert fuse_decoder_embedding(graph) == 0


def embedding_sessions(library: Path, width: int, scaled: bool) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """The stock nodes on ONNX Runtime's kernels and the fused node on the library's, over random uint8 tables with
    zero points away from 0 and scales that round."""
    rng = np.random.default_rng(width)
    constants = [numpy_helper.from_array(rng.integers(0, 256, (50, width), dtype=np.uint8), "tokens"),
                 numpy_helper.from_array(np.array(0.0038871018, np.float32), "token_scale"),
                 numpy_helper.from_array(np.array(137, np.uint8), "token_zero"),
                 numpy_helper.from_array(np.array([np.sqrt(np.float32(width))], np.float32), "embed_scale"),
                 numpy_helper.from_array(rng.integers(0, 256, (40, width), dtype=np.uint8), "positions_table"),
                 numpy_helper.from_array(np.array(0.007843138, np.float32), "position_scale"),
                 numpy_helper.from_array(np.array(128, np.uint8), "position_zero"),
                 numpy_helper.from_array(np.array([1], np.int64), "axis_1")]  # fmt: skip
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 1]),
              helper.make_tensor_value_info("steps", TensorProto.INT64, ["n"])]
    outputs = [helper.make_empty_tensor_value_info("embedded")]
    token_rows = "scaled" if scaled else "token_values"
    stock_nodes = [helper.make_node("Gather", ["tokens", "ids"], ["token_levels"]),
                   helper.make_node("DequantizeLinear", ["token_levels", "token_scale", "token_zero"], ["token_values"]),
                   *([helper.make_node("Mul", ["token_values", "embed_scale"], ["scaled"])] if scaled else []),
                   helper.make_node("Gather", ["positions_table", "steps"], ["position_levels"]),
                   helper.make_node("DequantizeLinear", ["position_levels", "position_scale", "position_zero"], ["position_values"]),
                   helper.make_node("Unsqueeze", ["position_values", "axis_1"], ["position_3d"]),
                   helper.make_node("Add", [token_rows, "position_3d"], ["embedded"])]  # fmt: skip
    fused_inputs = ["tokens", "token_scale", "token_zero", "ids", "embed_scale" if scaled else "", "positions_table", "position_scale",
                    "position_zero", "steps"]  # fmt: skip
    fused_nodes = [helper.make_node(FUSED_OP, fused_inputs, ["embedded"], domain=FUSED_DOMAIN)]
    return stock_and_fused(library, stock_nodes, fused_nodes, inputs, outputs, constants)


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("width", [256, 37])
def test_decoder_embedding_kernel_gives_the_stock_nodes_floats(native_kernels_library: Path, width: int, scaled: bool) -> None:
    """Every level of both tables, rows picked twice, out of order and from the end (negative indices), with and without
    the embedding scale."""
    stock, fused = embedding_sessions(native_kernels_library, width, scaled)
    feeds = {"ids": np.array([[3], [0], [49], [3], [-1], [17]], np.int64), "steps": np.array([0, 39, 5, 5, -2, 1], np.int64)}
    expected, got = stock.run(None, feeds)[0], fused.run(None, feeds)[0]
    assert expected.shape == got.shape == (6, 1, width)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_an_id_past_the_table_fails_the_call(native_kernels_library: Path) -> None:
    _, fused = embedding_sessions(native_kernels_library, 16, True)
    with pytest.raises(Exception, match="token id lies outside the embedding table"):
        fused.run(None, {"ids": np.array([[50]], np.int64), "steps": np.array([0], np.int64)})
    with pytest.raises(Exception, match="position lies outside the position table"):
        fused.run(None, {"ids": np.array([[1]], np.int64), "steps": np.array([40], np.int64)})


@pytest.mark.parametrize("model", ["int8", "imported Marian int8", "imported NLLB int8"])
def test_fused_decoder_gives_the_stock_log_probs(model: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoder with its embedding fused against the same decoder with the stock nodes: the same log-probs bit for
    bit in every call, and the fused node is what ran."""
    model_dir = model_dir_for(model, request, {"int8": "int8_dir"})
    pairs = fused_and_stock_calls(model_dir, native_kernels_library, "int8 decoder embeddings", "decoder_embedding", monkeypatch)
    for fused_result, stock_result in pairs:
        np.testing.assert_array_equal(fused_result.view(np.uint32), stock_result.view(np.uint32))
