"""The in-memory fusion of an int8 encoder's layout moves around its attention (runtime/head_layout_fusion.py) and the
native kernels that run the fused nodes (runtime/kernels/head_layout.cc): copies only, so the stock nodes' bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.head_layout_fusion import TO_HEADS_OP, TO_PACKED_OP, fuse_head_layouts
from nmt_serve.runtime.native_kernels import NativeKernels
from nmt_serve.runtime.onnx_proto import parse_model
from nmt_serve.runtime.quantized_matmul_fusion import fuse_quantized_matmuls
from nmt_serve.runtime.row_quantize_fusion import fuse_row_quantization
from tests.decoder_calls import model_dir_for, run_calls, with_and_without

CPU = ["CPUExecutionProvider"]
FUSION = "encoder attention head layouts"


def int8_encoder(model_dir: Path):  # -> the ModelProto of runtime/onnx_proto.py, with the fusions that run before
    model = parse_model((model_dir / "encoder.onnx").read_bytes())
    fuse_row_quantization(model)
    fuse_quantized_matmuls(model)
    return model


@pytest.mark.parametrize("model", ["int8", "imported Marian int8", "imported NLLB int8"])
def test_every_int8_encoder_layout_run_becomes_one_node(model: str, request: pytest.FixtureRequest) -> None:
    """Per layer one run into the heads and one back to rows, and one into the heads for the cross projection: no
    Transpose or Split is left around the attention, whose products and softmax stay."""
    graph = int8_encoder(model_dir_for(model, request, {"int8": "int8_dir"}))
    layers = sum(node.op_type == "Softmax" for node in graph.graph.node)
    assert layers > 0 and fuse_head_layouts(graph) == 2 * layers + 1
    kinds = [node.op_type for node in graph.graph.node]
    assert kinds.count(TO_HEADS_OP) == layers + 1 and kinds.count(TO_PACKED_OP) == layers
    assert "Split" not in kinds and kinds.count("Softmax") == layers and kinds.count("Transpose") <= 1
    assert fuse_head_layouts(graph) == 0


def test_a_float_encoder_is_left_to_the_whole_block_fusion(tiny_model_dir: Path) -> None:
    assert fuse_head_layouts(parse_model((tiny_model_dir / "encoder.onnx").read_bytes())) == 0


def test_a_run_in_another_form_is_left_as_it_is(int8_dir: Path) -> None:
    """A self-attention whose queries are laid out in another order keeps that run's nine nodes; the rest fuse."""
    graph = int8_encoder(int8_dir)
    layers = sum(node.op_type == "Softmax" for node in graph.graph.node)
    heads_order = [node for node in graph.graph.node if node.op_type == "Transpose" and list(node.attribute[0].ints) == [0, 2, 1, 3]]
    heads_order[0].attribute[0].ints[:] = [0, 1, 2, 3]  # the first layer's queries
    assert fuse_head_layouts(graph) == 2 * layers


@pytest.mark.parametrize("model", ["int8", "imported Marian int8", "imported NLLB int8"])
def test_fused_encoders_give_the_stock_nodes_bits(model: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The encoder with its layout runs fused against the same graph without (every other fusion in both): identical
    cross keys and values for sources of several lengths, padded and not, and identical decoder log-probs over them;
    the fused nodes are what ran."""
    model_dir = model_dir_for(model, request, {"int8": "int8_dir"})
    fused, stock = with_and_without(model_dir, native_kernels_library, FUSION, monkeypatch)
    counters = NativeKernels(native_kernels_library)
    rng = np.random.default_rng(11)
    for lengths in ([24, 24, 7], [1], [3, 17, 9, 30, 2]):
        width = max(lengths)
        ids = rng.integers(4, fused.config.vocab_size, (len(lengths), width)).astype(np.int64)
        mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
        before = counters.calls()["head_layout"]
        fused_values = fused.encode(ids, mask)
        assert counters.calls()["head_layout"] > before
        middle = counters.calls()["head_layout"]
        for fused_value, stock_value in zip(fused_values, stock.encode(ids, mask), strict=True):
            np.testing.assert_array_equal(fused_value, stock_value)
        assert counters.calls()["head_layout"] == middle
    for fused_call, stock_call in zip(run_calls(fused), run_calls(stock), strict=True):
        np.testing.assert_array_equal(fused_call, stock_call)


def layout_session(library: Path, op_type: str, inputs: list, outputs: int, **attributes) -> ort.InferenceSession:
    names = [f"out{index}" for index in range(outputs)]
    node = helper.make_node(op_type, [value.name for value in inputs], names, domain=FUSED_DOMAIN, **attributes)
    graph = helper.make_graph([node], "layout", inputs, [helper.make_empty_tensor_value_info(name) for name in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=CPU)


def to_heads_session(library: Path, transposed: list[int]) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, "P", "W"]),
              helper.make_tensor_value_info("grid", TensorProto.INT64, ["NS"]),
              helper.make_tensor_value_info("grid_shape", TensorProto.INT64, [3]),
              helper.make_tensor_value_info("head_shape", TensorProto.INT64, [4])]  # fmt: skip
    return layout_session(library, TO_HEADS_OP, inputs, len(transposed), transposed=transposed)


def packed_layout(lengths: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The exporter's index pair for sources of `lengths` padded to `width`: each grid position's packed row (a padded
    one repeats its source's last real row) and the real positions."""
    flat = (np.arange(width)[None, :] < np.array(lengths)[:, None]).reshape(-1)
    return np.maximum(np.cumsum(flat) - 1, 0).astype(np.int64), np.flatnonzero(flat).astype(np.int64)


@pytest.mark.parametrize("lengths,width,heads,head_size,transposed", [([5, 2, 7], 7, 4, 64, [0, 1, 0]), ([1], 1, 2, 8, [0, 1, 0]),
                                                                       ([3, 9], 12, 3, 16, [0, 0, 0, 0, 0, 0]),
                                                                       ([19, 4, 16], 19, 2, 64, [0, 1, 0]),
                                                                       ([8, 21], 21, 3, 12, [1, 0, 1])])  # fmt: skip
def test_packed_to_heads_matches_its_definition(native_kernels_library: Path, lengths: list[int], width: int, heads: int,
                                                head_size: int, transposed: list[int]) -> None:  # fmt: skip
    """The stock nodes' definition in numpy: gather the grid's rows, split, heads to (N, H, S, Dh) or (N, H, Dh, S); the
    transposed parts at widths of whole blocks of eight positions and with a tail past them, and head sizes a multiple
    of eight or not."""
    grid, _ = packed_layout(lengths, width)
    parts, sources = len(transposed), len(lengths)
    rows = np.random.default_rng(3).standard_normal((1, sum(lengths), parts * heads * head_size)).astype(np.float32)
    grid[-1] -= sum(lengths)  # Gather's negative index, counted from the end: the same row
    feeds = {"rows": rows, "grid": grid, "grid_shape": np.array([sources, width, rows.shape[2]], dtype=np.int64),
             "head_shape": np.array([sources, width, heads, head_size], dtype=np.int64)}
    results = to_heads_session(native_kernels_library, transposed).run(None, feeds)
    laid = np.take(rows, grid, axis=1).reshape(sources, width, parts, heads, head_size)
    for part, (flag, result) in enumerate(zip(transposed, results, strict=True)):
        np.testing.assert_array_equal(result, laid[:, :, part].transpose((0, 2, 3, 1) if flag else (0, 2, 1, 3)))


@pytest.mark.parametrize("lengths,width,heads,head_size", [([5, 2, 7], 7, 4, 64), ([1], 1, 2, 8), ([3, 9, 1], 12, 3, 16)])
def test_heads_to_packed_matches_its_definition(native_kernels_library: Path, lengths: list[int], width: int, heads: int,
                                                head_size: int) -> None:  # fmt: skip
    """The stock nodes' definition in numpy: heads back to (1, N x S, H x Dh) rows, then the real positions' rows."""
    _, real = packed_layout(lengths, width)
    values = np.random.default_rng(4).standard_normal((len(lengths), heads, width, head_size)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("heads", TensorProto.FLOAT, ["N", "H", "S", "D"]),
              helper.make_tensor_value_info("real", TensorProto.INT64, ["P"])]  # fmt: skip
    (result,) = layout_session(native_kernels_library, TO_PACKED_OP, inputs, 1).run(None, {"heads": values, "real": real})
    rows = values.transpose(0, 2, 1, 3).reshape(1, len(lengths) * width, heads * head_size)
    np.testing.assert_array_equal(result, np.take(rows, real, axis=1))


def test_a_packed_row_out_of_range_is_an_error_not_a_read(native_kernels_library: Path) -> None:
    grid, _ = packed_layout([2, 3], 3)
    grid[1] = 5  # 5 packed rows: 0-4
    feeds = {"rows": np.zeros((1, 5, 3 * 8), dtype=np.float32), "grid": grid, "grid_shape": np.array([2, 3, 24], dtype=np.int64),
             "head_shape": np.array([2, 3, 1, 8], dtype=np.int64)}  # fmt: skip
    with pytest.raises(Exception, match="packed row is out of range"):
        to_heads_session(native_kernels_library, [0, 1, 0]).run(None, feeds)
