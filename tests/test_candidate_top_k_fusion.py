"""The in-memory fusion of the decoder's candidate search (runtime/candidate_top_k_fusion.py) and the native kernel
that runs the fused node (runtime/kernels/candidate_top_k.cc): ONNX Runtime's Gather + TopK outputs, ties included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nmt_serve.runtime.candidate_top_k_fusion import FUSED_OP, fuse_candidate_top_k
from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.onnx_proto import parse_model
from tests.decoder_calls import fused_and_stock_calls, model_dir_for, set_attribute
from tests.node_sessions import stock_and_fused

CANDIDATES = 8


@pytest.mark.parametrize("which", ["tiny_model_dir", "int8_dir"])
def test_the_decoders_candidate_search_becomes_one_node(which: str, request: pytest.FixtureRequest) -> None:
    model = parse_model((request.getfixturevalue(which) / "decoder.onnx").read_bytes())
    assert fuse_candidate_top_k(model) == 1
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count(FUSED_OP) == 1 and "TopK" not in kinds
    assert fuse_candidate_top_k(model) == 0


def test_a_smallest_first_top_k_is_left_as_it_is(tiny_model_dir: Path) -> None:
    model = parse_model((tiny_model_dir / "decoder.onnx").read_bytes())
    set_attribute(next(node for node in model.graph.node if node.op_type == "TopK"), "largest", 0)
    assert fuse_candidate_top_k(model) == 0


def top_k_sessions(library: Path, rows: int, width: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """Gather + TopK on ONNX Runtime's kernels, and the fused node on the library's."""
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [rows, width]),
              helper.make_tensor_value_info("rows", TensorProto.INT64, ["n"]), helper.make_tensor_value_info("k", TensorProto.INT64, [1])]
    outputs = [helper.make_empty_tensor_value_info("values"), helper.make_empty_tensor_value_info("ids")]
    stock_nodes = [helper.make_node("Gather", ["data", "rows"], ["picked"], axis=0),
                   helper.make_node("TopK", ["picked", "k"], ["values", "ids"], axis=-1, largest=1, sorted=1)]
    fused_nodes = [helper.make_node(FUSED_OP, ["data", "rows", "k"], ["values", "ids"], domain=FUSED_DOMAIN)]
    return stock_and_fused(library, stock_nodes, fused_nodes, inputs, outputs, [])


@pytest.mark.parametrize("k", [1, 4, 8, 37])
@pytest.mark.parametrize("width", [8000, 45, 37])
def test_candidate_top_k_kernel_gives_onnx_runtimes_outputs(native_kernels_library: Path, k: int, width: int) -> None:
    """Rows of few distinct values (many ties: equal values must come lower index first), a row of one value, rows
    picked twice, out of order and from the end (a negative index), widths with a tail of fewer than 8 and k = width."""
    rng = np.random.default_rng(k * width)
    rows = 6
    data = np.log(rng.random((rows, width), dtype=np.float32)).astype(np.float32)
    data[1] = np.round(data[1] * 2) / 2  # a few distinct values, each many times
    data[2] = -3.0
    stock, fused = top_k_sessions(native_kernels_library, rows, width)
    feeds = {"data": data, "rows": np.array([2, 0, 1, 1, 5, -1], dtype=np.int64), "k": np.array([min(k, width)], dtype=np.int64)}
    for expected, got in zip(stock.run(None, feeds), fused.run(None, feeds), strict=True):
        assert expected.dtype == got.dtype and expected.shape == got.shape
        np.testing.assert_array_equal(got, expected)


def test_no_candidate_rows_gives_empty_outputs(native_kernels_library: Path) -> None:
    _, fused = top_k_sessions(native_kernels_library, 3, 16)
    values, ids = fused.run(None, {"data": np.zeros((3, 16), np.float32), "rows": np.zeros(0, np.int64), "k": np.array([4], np.int64)})
    assert values.shape == ids.shape == (0, 4)


@pytest.mark.parametrize("model", ["fp32", "int8", "imported Marian int8"])
def test_fused_decoder_gives_the_stock_candidates(model: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoder with its candidate search fused against the same decoder with ONNX Runtime's Gather and TopK: the
    same log-probs, candidate log-probs and token ids in every call, and the fused node is what ran."""
    model_dir = model_dir_for(model, request, {"fp32": "tiny_model_dir", "int8": "int8_dir"})
    pairs = fused_and_stock_calls(model_dir, native_kernels_library, "candidate searches", "candidate_top_k", monkeypatch, CANDIDATES)
    for fused_result, stock_result in pairs:
        np.testing.assert_array_equal(fused_result, stock_result)
