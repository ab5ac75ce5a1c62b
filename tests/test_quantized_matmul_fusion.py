"""The in-memory fusion of each int8 weight product with its row quantization and epilogue
(runtime/quantized_matmul_fusion.py) and the native kernel that runs the fused node
(runtime/kernels/quantized_matmul.cc): the stock nodes' bits, at row counts on every path of the kernel (a few rows on
its vector tiles; 16 and more on AMX tiles where the CPU has them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.graph_index import FUSED_DOMAIN
from nmt_serve.runtime.onnx_proto import parse_model
from nmt_serve.runtime.quantized_matmul_fusion import FUSED_OP, fuse_quantized_matmuls
from nmt_serve.runtime.row_quantize_fusion import fuse_row_quantization
from tests.decoder_calls import CALLS, fused_and_stock_products, model_dir_for
from tests.kernel_tiles import kernel_session
from tests.kernel_tiles import on_tiles as on_instruction_set
from tests.level_boundaries import near_half_rows

# The kernel's tiles by instruction set (NMT_KERNELS_ISA caps them) and the /proc/cpuinfo flag each needs.
TILE_PATHS = {"avx2": "avx2", "avx512-vnni": "avx512_vnni", "amx": "amx_int8"}
PRODUCT = "MatMulIntegerToFloat"
INVERSE_LEVELS = np.float32(1.0 / 127.0)


def fused_graph(path: Path):  # -> the ModelProto of runtime/onnx_proto.py, its row quantizations fused first
    model = parse_model(path.read_bytes())
    fuse_row_quantization(model)
    return model


@pytest.mark.parametrize("graph", ["encoder.onnx", "decoder.onnx"])
def test_every_weight_product_becomes_one_node(graph: str, int8_dir: Path) -> None:
    """Each MatMulIntegerToFloat goes, with its bias Add and the Relu or residual Add after it: the int8 graphs keep no
    Relu (every ReLU follows a product) and one Add per product fewer at least."""
    model = fused_graph(int8_dir / graph)
    kinds = [node.op_type for node in model.graph.node]
    products, adds = kinds.count(PRODUCT), kinds.count("Add")
    assert products > 0 and fuse_quantized_matmuls(model) == products
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count(FUSED_OP) == products and PRODUCT not in kinds and "Relu" not in kinds
    assert kinds.count("Add") <= adds - products
    assert fuse_quantized_matmuls(model) == 0


def test_a_product_whose_output_others_read_keeps_its_epilogue(int8_dir: Path) -> None:
    """A product whose output a second node reads too keeps its bias Add (the product's tensor must stay)."""
    model = fused_graph(int8_dir / "decoder.onnx")
    product = next(node for node in model.graph.node if node.op_type == PRODUCT)
    bias_add = next(node for node in model.graph.node if product.output[0] in node.input)
    extra = model.graph.node.add()
    extra.CopyFrom(bias_add)
    extra.name, extra.output[0] = "second_reader", "second_reader_out"
    extra.op_type = "Identity"
    del extra.input[1:]
    extra.input[0] = product.output[0]
    model.graph.output.add(name="second_reader_out")
    products = sum(node.op_type == PRODUCT for node in model.graph.node)
    assert fuse_quantized_matmuls(model) == products
    fused = next(node for node in model.graph.node if node.op_type == FUSED_OP and node.output[0] == product.output[0])
    assert len(fused.input) == 4  # x, weight, weight scale, weight zero point: no bias, no residual
    assert bias_add.name in {node.name for node in model.graph.node}


def product_model(rows: int, inner: int, width: int, rng: np.random.Generator, epilogue: str, zero_points: bool):
    """One fused node alone on random weights in [-64, 64] (ONNX Runtime's reduce-range levels, both ends included):
    x (rows, inner) -> (rows, width)."""
    weight = rng.integers(-64, 65, (inner, width)).astype(np.int8)
    scale = (rng.random(width, dtype=np.float32) * 0.01 + 1e-4).astype(np.float32)
    weight_zero_point = rng.integers(-3, 4, width).astype(np.int8) if zero_points else np.zeros(width, np.int8)
    bias = rng.standard_normal(width).astype(np.float32)
    inputs = ["x", "weight", "scale", "zero_point"] + (["bias"] if epilogue != "none" else [])
    inputs += ["residual"] if epilogue == "residual" else []
    node = helper.make_node(FUSED_OP, inputs, ["y"], domain=FUSED_DOMAIN, inverse_levels=float(INVERSE_LEVELS), zero_point=128,
                            relu=int(epilogue == "relu"))
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, inner])]
    if epilogue == "residual":
        graph_inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT, [rows, width]))
    constants = [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(scale, "scale"),
                 numpy_helper.from_array(weight_zero_point, "zero_point"), numpy_helper.from_array(bias, "bias")]  # fmt: skip
    used = constants[: 3 + (epilogue != "none")]
    graph = helper.make_graph([node], "product", graph_inputs, [helper.make_empty_tensor_value_info("y")], used)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
    return model, weight, scale, weight_zero_point, bias


def set_weight(model, weight: np.ndarray) -> None:  # model: a product_model ModelProto
    """Replace the product's weight initializer with `weight`."""
    tensor = next(tensor for tensor in model.graph.initializer if tensor.name == "weight")
    tensor.CopyFrom(numpy_helper.from_array(weight, "weight"))


def expected_output(x: np.ndarray, weight: np.ndarray, scale: np.ndarray, weight_zero_point: np.ndarray, bias: np.ndarray,
                    residual: np.ndarray | None, epilogue: str) -> np.ndarray:  # fmt: skip
    """The definition in numpy's float32, each rounding in the stock nodes' order: the row's scale and levels as
    RowQuantize writes them, the exact integer sum, (float(sum) * weight scale) * row scale, + bias, + residual, ReLU."""
    row_scale = (np.abs(x).max(axis=-1, keepdims=True) * INVERSE_LEVELS).astype(np.float32)
    # A row of zeros has scale 0: whatever its levels, its product times 0 is 0.
    levels = np.clip(np.rint(x / np.where(row_scale == 0, 1, row_scale)), -128, 127).astype(np.int64)
    sums = levels @ (weight.astype(np.int64) - weight_zero_point.astype(np.int64))
    y = (sums.astype(np.float32) * scale) * row_scale
    if epilogue != "none":
        y = y + bias
    if residual is not None:
        y = y + residual
    return np.maximum(y, np.float32(0)) if epilogue == "relu" else y


def on_tiles(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels made from here on `path`'s tiles; skipped where the CPU has not that instruction set."""
    on_instruction_set(TILE_PATHS, path, monkeypatch)


@pytest.mark.parametrize("path", list(TILE_PATHS))
@pytest.mark.parametrize("epilogue", ["none", "bias", "relu", "residual"])
@pytest.mark.parametrize("rows,inner,width", [(1, 256, 768), (2, 64, 48), (3, 40, 24), (6, 72, 56), (8, 1024, 40), (37, 100, 200),
                                                (64, 256, 64)])  # fmt: skip
def test_quantized_matmul_kernel_matches_the_definition(native_kernels_library: Path, rows: int, inner: int, width: int,
                                                        epilogue: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The node alone against its definition, bit for bit, on each instruction set's tiles the CPU has: widths with a
    ragged last block (24, 40, 200), inner sizes padded to the kernel's step (40, 72, 100), weight zero points set, a
    row of zeros, a row of values a few units in the last place from half way between two levels, and row counts from 1
    to 64 (AVX2: wide tiles at 1 and 2 rows, tall ones of 4 rows and their remainders from 3; AMX from 8 rows, its last
    group of 16 padded)."""
    on_tiles(path, monkeypatch)
    rng = np.random.default_rng(rows * 7 + inner)
    model, weight, scale, zero_point, bias = product_model(rows, inner, width, rng, epilogue, zero_points=rows % 2 == 1)
    x = (rng.standard_normal((rows, inner)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
    x[rows // 2] = 0.0
    if rows > 2:
        x[0] = near_half_rows(rng, 1, inner)[0]
    feeds = {"x": x}
    residual = None
    if epilogue == "residual":
        residual = rng.standard_normal((rows, width)).astype(np.float32)
        feeds["residual"] = residual
    session = kernel_session(model, native_kernels_library)
    np.testing.assert_array_equal(session.run(None, feeds)[0], expected_output(x, weight, scale, zero_point, bias, residual, epilogue))


@pytest.mark.parametrize("value", [-128, -65, 65, 127])
def test_weights_past_64_on_avx2_tiles_are_refused(value: int, native_kernels_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vpmaddubsw's 16-bit pairs overflow with a weight past +-64: on the AVX2 tiles the kernel refuses it when the
    session is made, naming why (the runtime then makes the session without its fusions)."""
    on_tiles("avx2", monkeypatch)
    model, weight, *_ = product_model(2, 64, 32, np.random.default_rng(9), "none", zero_points=False)
    weight[0, 0] = value
    set_weight(model, weight)
    with pytest.raises(Exception, match=r"weights outside \[-64, 64\] need VNNI on this CPU"):
        kernel_session(model, native_kernels_library)


@pytest.mark.parametrize("path", list(TILE_PATHS))
def test_weights_at_64_with_full_levels_are_exact(path: str, native_kernels_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The widest pairs the AVX2 tiles admit: weights of +64 and -64 (ONNX Runtime's reduce-range levels reach both) met by
    levels 255 and 1 on every k, 2 x 255 x 64 = 32640 per 16-bit pair, and the sums of 256 k exact on every path."""
    on_tiles(path, monkeypatch)
    x = np.stack([np.full(256, 3.5), np.full(256, -3.5), np.where(np.arange(256) % 2 == 0, 2.0, -2.0)]).astype(np.float32)
    for rows in (2, 3):  # AVX2: the wide tiles take 2 rows, the tall ones 3
        model, weight, scale, zero_point, bias = product_model(rows, 256, 32, np.random.default_rng(11), "none", zero_points=False)
        weight[:] = np.where(np.arange(32) % 2 == 0, 64, -64).astype(np.int8)
        set_weight(model, weight)
        expected = expected_output(x[:rows], weight, scale, zero_point, bias, None, "none")
        assert np.abs(expected).max() > 0
        np.testing.assert_array_equal(kernel_session(model, native_kernels_library).run(None, {"x": x[:rows]})[0], expected)


@pytest.mark.parametrize("model,path", [("int8", "best"), ("int8", "avx2"), ("int8 with an int8 cache", "best"),
                                        ("imported Marian int8", "best"), ("imported NLLB int8", "best")])  # fmt: skip
def test_fused_graphs_give_the_stock_products_bits(model: str, path: str, native_kernels_library: Path, request: pytest.FixtureRequest,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Encoder and decoder with their weight products fused against the same graphs with ONNX Runtime's products (the
    other fusions in both): identical log-probs in every decoder call and identical cross keys and values (3 sources
    of 24 positions: 72 encoder rows, past 16), and the fused nodes are what ran. On the CPU's best tiles, and on the
    AVX2 tiles every supported CPU has (the exported weights reach +-64, the widest those tiles admit)."""
    if path != "best":
        on_tiles(path, monkeypatch)
    model_dir = model_dir_for(model, request, {"int8": "int8_dir", "int8 with an int8 cache": "int8_cache_dir"})
    pairs, ran = fused_and_stock_products(model_dir, native_kernels_library, "int8 weight products", "quantized_matmul", monkeypatch)
    decoder_products = sum(node.op_type == PRODUCT for node in parse_model((model_dir / "decoder.onnx").read_bytes()).graph.node)
    encoder_products = sum(node.op_type == PRODUCT for node in parse_model((model_dir / "encoder.onnx").read_bytes()).graph.node)
    assert ran == decoder_products * len(CALLS) + encoder_products
    for fused_values, stock_values in pairs:
        np.testing.assert_array_equal(fused_values, stock_values)
