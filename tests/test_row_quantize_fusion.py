"""The in-memory fusion of per-row activation quantization (runtime/row_quantize_fusion.py) and the native kernel that
runs the fused node (runtime/kernels/row_quantize.cc): the same levels and scales as the stock nodes, bit for bit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.export.optimize import DEFAULT_INT8_SCHEME, INT8_SCHEMES, convert_to_int8
from nmt_serve.runtime import native_fusions, ort_step
from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.native_fusions import fused_model_bytes
from nmt_serve.runtime.native_kernels import NativeKernels
from nmt_serve.runtime.onnx_proto import parse_model
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.runtime.row_quantize_fusion import FUSED_OP, fuse_row_quantization
from tests.level_boundaries import near_half_rows

CPU = ["CPUExecutionProvider"]
ROW_SCHEMES = ["u8s8-rows", "u8s8-rows-vnni", "u8u8-rows"]  # the schemes with per-row activation scales
assert DEFAULT_INT8_SCHEME in ROW_SCHEMES and set(ROW_SCHEMES) <= set(INT8_SCHEMES)
STOCK_CHAIN = {"Abs", "ReduceMax"}  # node types only the per-row quantization chains have in a one-product graph


def two_product_model(path: Path, width: int, rng: np.random.Generator) -> None:
    """x -> MatMul -> Relu -> MatMul: two activations to quantize, of different widths."""
    first = rng.standard_normal((width, 2 * width)).astype(np.float32)
    second = rng.standard_normal((2 * width, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "first"], ["hidden"], name="first"),
             helper.make_node("Relu", ["hidden"], ["relu"], name="relu"),
             helper.make_node("MatMul", ["relu", "second"], ["y"], name="second")]  # fmt: skip
    graph = helper.make_graph(nodes, "two_products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "rows", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "rows", 8])],
                              [numpy_helper.from_array(first, "first"), numpy_helper.from_array(second, "second")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10), str(path))


def quantized_model(tmp_path: Path, width: int, scheme: str = DEFAULT_INT8_SCHEME) -> Path:
    two_product_model(tmp_path / "fp32.onnx", width, np.random.default_rng(width))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", scheme)
    return tmp_path / "int8.onnx"


def hard_rows(rng: np.random.Generator, batch: int, rows: int, width: int) -> np.ndarray:
    """Rows of mixed magnitudes, a row of zeros (scale 0) and rows whose values fall exactly half way between two
    levels (the rounding is to even), so every branch of the quantization is taken."""
    x = (rng.standard_normal((batch, rows, width)) * rng.uniform(0.01, 100, (batch, rows, 1))).astype(np.float32)
    x[0, 0] = 0.0
    halves = rng.integers(-126, 126, (rows, width)).astype(np.float32) + 0.5
    halves[:, 0] = 127.0  # max |x| = 127: the scale is 1, so x / scale is x itself
    x[-1] = halves
    if batch > 1:
        x[0, 1:] = near_half_rows(rng, rows - 1, width)
    return x


@pytest.mark.parametrize("scheme", ROW_SCHEMES)
def test_every_row_quantization_chain_becomes_one_node(tmp_path: Path, scheme: str) -> None:
    """Each quantized product's chain goes, and its zero-point node with it; the products keep their inputs' names."""
    model = parse_model(quantized_model(tmp_path, 32, scheme).read_bytes())
    products = sum(node.op_type == "MatMulIntegerToFloat" for node in model.graph.node)
    assert fuse_row_quantization(model) == products == 2
    kinds = {node.op_type for node in model.graph.node}
    assert FUSED_OP in kinds and not kinds & STOCK_CHAIN and "QuantizeLinear" not in kinds
    assert any(opset.domain == FUSED_DOMAIN for opset in model.opset_import)
    assert fuse_row_quantization(model) == 0  # nothing left to fuse


def test_a_chain_in_another_form_is_left_as_it_is(tmp_path: Path) -> None:
    """A row scale read by something besides the quantization (here the max also leaves the graph) is not the
    exporter's form: that chain stays, the other is fused."""
    model = onnx.load(str(quantized_model(tmp_path, 32)))
    row_max = next(node for node in model.graph.node if node.op_type == "ReduceMax")
    model.graph.output.append(helper.make_empty_tensor_value_info(row_max.output[0]))
    model = parse_model(model.SerializeToString())
    assert fuse_row_quantization(model) == 1
    assert sum(node.op_type == "ReduceMax" for node in model.graph.node) == 1


def test_an_fp32_graph_has_no_quantization_to_fuse(tiny_model_dir: Path) -> None:
    assert fuse_row_quantization(parse_model((tiny_model_dir / "decoder.onnx").read_bytes())) == 0


def test_an_fp32_encoder_loads_with_the_library(native_kernels_library: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Nothing to fuse in it (its self-attention blocks left as they are here), and no com.microsoft import on disk:
    ONNX Runtime's own FusedMatMul, which it writes into this graph, must still resolve with the library's
    com.microsoft kernels registered (the copy in memory imports the domain). Loaded with the library, no fallback,
    the same outputs as without it."""
    monkeypatch.delitem(native_fusions.FUSIONS, "encoder self-attention blocks")
    path = tiny_model_dir / "encoder.onnx"
    assert all(opset.domain != "com.microsoft" for opset in onnx.load(str(path), load_external_data=False).opset_import)
    feeds = {"src_ids": np.array([[5, 6, 7, 2]], dtype=np.int64), "src_mask": np.ones((1, 4), dtype=bool)}
    with caplog.at_level(logging.WARNING):
        native = make_session(path, CPU, threads=1, kernels_library=native_kernels_library).run(None, feeds)
    assert "not loadable" not in caplog.text
    for a, b in zip(native, make_session(path, CPU, threads=1).run(None, feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fused_model_bytes(path) is not None


@pytest.mark.parametrize("width", [256, 1000, 24])
@pytest.mark.parametrize("scheme", ROW_SCHEMES)
def test_fused_graph_gives_the_stock_graphs_bits(native_kernels_library: Path, tmp_path: Path, width: int, scheme: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The fused graph on the native kernel against the same graph's stock nodes on ONNX Runtime's: identical outputs
    (levels and scales are the same bytes), widths on the 32-wide vector path, past it with a tail (1000) and on the
    scalar path alone (24). The weight products' fusion, which takes RowQuantize nodes into its own, is left out here
    (tests/test_quantized_matmul_fusion.py)."""
    monkeypatch.delitem(native_fusions.FUSIONS, "int8 weight products")
    path = quantized_model(tmp_path, width, scheme)
    x = hard_rows(np.random.default_rng(1), 3, 5, width)
    stock = make_session(path, CPU, threads=1).run(None, {"x": x})[0]
    before = NativeKernels(native_kernels_library).calls()["row_quantization"]
    fused = make_session(path, CPU, threads=1, kernels_library=native_kernels_library)
    assert NativeKernels(native_kernels_library).calls()["row_quantization"] == before  # made, not yet run
    np.testing.assert_array_equal(fused.run(None, {"x": x})[0], stock)
    assert NativeKernels(native_kernels_library).calls()["row_quantization"] == before + 2, "the fused nodes did not run"


@pytest.mark.parametrize("width", [256, 40])
def test_row_quantize_kernel_matches_the_definition(native_kernels_library: Path, width: int) -> None:
    """The node alone: scale = fp32(max |x| * inverse_levels); level = clamp(round-half-even(x / scale)) + zero point,
    computed here in numpy's float32 (a division, as ONNX Runtime's QuantizeLinear does)."""
    inverse_levels = np.float32(1.0 / 127.0)
    node = helper.make_node(FUSED_OP, ["x"], ["levels", "scales"], domain=FUSED_DOMAIN, inverse_levels=float(inverse_levels),
                            zero_point=128)
    graph = helper.make_graph([node], "row_quantize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, width])],
                              [helper.make_empty_tensor_value_info("levels"), helper.make_empty_tensor_value_info("scales")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
    x = hard_rows(np.random.default_rng(2), 2, 7, width)
    x[0, 1] = 0.0
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_kernels_library))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
    levels, scales = session.run(None, {"x": x})
    expected_scales = (np.abs(x).max(axis=-1, keepdims=True) * inverse_levels).astype(np.float32)
    np.testing.assert_array_equal(scales, expected_scales)
    live = expected_scales[..., 0] > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.clip(np.rint(x / expected_scales), -128, 127) + 128
    assert levels.dtype == np.uint8 and levels.shape == x.shape
    np.testing.assert_array_equal(levels[live], expected[live].astype(np.uint8))


def test_a_fused_graph_that_will_not_load_falls_back_to_the_file(native_kernels_library: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """If ONNX Runtime refuses the rewritten graph, the session is made from the file as it is, with the library."""
    path = quantized_model(tmp_path, 32)
    monkeypatch.setattr(ort_step, "fused_model_bytes", lambda _path: b"not a model")
    with caplog.at_level(logging.WARNING):
        session = make_session(path, CPU, threads=1, kernels_library=native_kernels_library)
    assert "not loadable with its nodes fused" in caplog.text
    x = hard_rows(np.random.default_rng(3), 1, 4, 32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], make_session(path, CPU, threads=1).run(None, {"x": x})[0])


def test_exported_int8_dir_gives_the_same_bits_fused(native_kernels_library: Path, int8_dir: Path) -> None:
    """The tiny model's exported encoder, fused, against its stock nodes with the same library loaded: identical cross
    keys and values (in an int8 graph every fusion keeps the stock nodes' bits)."""
    rng = np.random.default_rng(4)
    ids = rng.integers(4, 60, (3, 9)).astype(np.int64)
    mask = np.ones((3, 9), dtype=bool)
    mask[1, 5:] = False
    feeds = {"src_ids": ids, "src_mask": mask}
    path = int8_dir / "encoder.onnx"
    fused = make_session(path, CPU, threads=1, kernels_library=native_kernels_library).run(None, feeds)
    stock = make_session(path, CPU, threads=1).run(None, feeds)
    for a, b in zip(fused, stock, strict=True):
        np.testing.assert_array_equal(a, b)
