"""The in-memory fusion of the decoder's self-attention lengths (runtime/decoder_lengths_fusion.py) and the native
kernel that runs the fused node (runtime/kernels/decoder_lengths.cc): the stock nodes' two int32 tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.decoder_lengths_fusion import FUSED_OP, fuse_decoder_lengths
from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.onnx_proto import parse_model
from tests.decoder_calls import fused_and_stock_calls, model_dir_for
from tests.node_sessions import stock_and_fused


@pytest.mark.parametrize("model", ["fp32", "int8", "imported Marian int8", "imported NLLB int8"])
def test_the_decoders_length_nodes_become_one(model: str, request: pytest.FixtureRequest) -> None:
    graph = parse_model((model_dir_for(model, request, {"fp32": "tiny_model_dir", "int8": "int8_dir"}) / "decoder.onnx").read_bytes())
    before = [node.op_type for node in graph.graph.node]
    assert fuse_decoder_lengths(graph) == 1
    kinds = [node.op_type for node in graph.graph.node]
    assert kinds.count(FUSED_OP) == 1 and kinds.count("ReduceMax") == before.count("ReduceMax") - 1
    assert len(kinds) == len(before) - 3
    fused_at = kinds.index(FUSED_OP)
    assert all(index > fused_at for index, kind in enumerate(kinds) if kind == "GroupQueryAttention")
    assert fuse_decoder_lengths(graph) == 0


def test_lengths_kept_in_int64_are_left_as_they_are(tiny_model_dir: Path) -> None:
    """A total length not cast to int32 is not the exporter's form: nothing is fused."""
    graph = parse_model((tiny_model_dir / "decoder.onnx").read_bytes())
    total = next(node for node in graph.graph.node if node.output[0] == "total_sequence_length")
    next(found for found in total.attribute if found.name == "to").i = TensorProto.INT64
    assert fuse_decoder_lengths(graph) == 0


def lengths_sessions(library: Path, offset: np.ndarray) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    inputs = [helper.make_tensor_value_info("positions", TensorProto.INT64, ["n"])]
    outputs = [helper.make_empty_tensor_value_info("seqlens_k"), helper.make_empty_tensor_value_info("total")]
    constants = [numpy_helper.from_array(offset, "offset")]
    stock_nodes = [helper.make_node("ReduceMax", ["positions"], ["longest"], keepdims=0),
                   helper.make_node("Cast", ["positions"], ["seqlens_k"], to=TensorProto.INT32),
                   helper.make_node("Add", ["longest", "offset"], ["total_64"]),
                   helper.make_node("Cast", ["total_64"], ["total"], to=TensorProto.INT32)]  # fmt: skip
    fused_nodes = [helper.make_node(FUSED_OP, ["positions"], ["seqlens_k", "total"], domain=FUSED_DOMAIN, offset=int(offset.reshape(-1)[0]),
                                    total_rank=offset.ndim)]  # fmt: skip
    return stock_and_fused(library, stock_nodes, fused_nodes, inputs, outputs, constants)


@pytest.mark.parametrize("offset", [np.array([1], np.int64), np.array(1, np.int64), np.array([3], np.int64)])
def test_decoder_lengths_kernel_gives_the_stock_tensors(native_kernels_library: Path, offset: np.ndarray) -> None:
    """One row and several, the largest first, last and repeated; a one-value or scalar total as the constant has it."""
    stock, fused = lengths_sessions(native_kernels_library, offset)
    for positions in ([0], [7, 2, 7, 0], [1, 5, 300], [511]):
        feeds = {"positions": np.array(positions, np.int64)}
        for expected, got in zip(stock.run(None, feeds), fused.run(None, feeds), strict=True):
            assert expected.dtype == got.dtype == np.int32 and expected.shape == got.shape
            np.testing.assert_array_equal(got, expected)


def test_no_positions_fail_the_call(native_kernels_library: Path) -> None:
    _, fused = lengths_sessions(native_kernels_library, np.array([1], np.int64))
    with pytest.raises(Exception, match="at least one position"):
        fused.run(None, {"positions": np.zeros(0, np.int64)})


@pytest.mark.parametrize("model", ["fp32", "int8", "imported NLLB int8"])
def test_fused_decoder_gives_the_stock_log_probs(model: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoder with its lengths fused against the same decoder with the stock nodes: the same log-probs bit for bit
    in every call, and the fused node is what ran."""
    model_dir = model_dir_for(model, request, {"fp32": "tiny_model_dir", "int8": "int8_dir"})
    pairs = fused_and_stock_calls(model_dir, native_kernels_library, "self-attention lengths", "decoder_lengths", monkeypatch)
    for fused_result, stock_result in pairs:
        np.testing.assert_array_equal(fused_result.view(np.uint32), stock_result.view(np.uint32))
