"""The in-memory fusion of each float weight product with its epilogue (runtime/float_matmul_fusion.py) and the native
kernel that runs the fused node (runtime/kernels/float_matmul.cc): within float rounding of ONNX Runtime's products,
the same bits on both instruction sets' tiles, and a row's outputs independent of the rows beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.float_matmul_fusion import FUSED_OP, fuse_float_matmuls
from nmt_serve.runtime.graph_index import FUSED_DOMAIN, GraphIndex
from nmt_serve.runtime.onnx_proto import parse_model
from nmt_serve.runtime.self_check import SELF_CHECK_BOUNDS
from tests.decoder_calls import CALLS, fused_and_stock_products
from tests.kernel_tiles import kernel_session
from tests.kernel_tiles import on_tiles as on_instruction_set

FLOAT = 1  # TensorProto.FLOAT
UNIT_ROUNDOFF = 2.0**-24  # float32's
# The kernel's tiles by instruction set (NMT_KERNELS_ISA=avx2 keeps an AVX-512 CPU on the AVX2 ones) and the
# /proc/cpuinfo flag each needs.
TILE_PATHS = {"avx2": "avx2", "avx512": "avx512f"}


@pytest.fixture
def fused_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fusion applied whatever the CPU (the runtime applies it only where AVX-512 is): its matching and, on a CPU
    without AVX-512, the AVX2 tiles are tested everywhere."""
    monkeypatch.setattr("nmt_serve.runtime.float_matmul_fusion.fusion_pays_here", lambda: True)


def weight_products(path: Path) -> tuple[int, int]:
    """How many MatMuls of `path` multiply by a constant float (K, N) weight, and how many of those a bias Add follows."""
    model = parse_model(path.read_bytes())
    index = GraphIndex(model.graph)
    products = [node for node in model.graph.node if node.op_type == "MatMul" and index.constant_dims(node.input[1], FLOAT) is not None]
    biased = sum(index.sole_reader(node.output[0], "Add") is not None for node in products)
    return len(products), biased


@pytest.mark.parametrize("graph", ["encoder.onnx", "decoder.onnx"])
def test_every_float_weight_product_becomes_one_node(graph: str, tiny_model_dir: Path, fused_on_any_cpu: None) -> None:
    """Each MatMul on a constant weight (behind the Cast of its float16 copy, or the Transpose of the tied embedding)
    goes, with its bias Add and the Relu or residual Add after it: no Relu and no such MatMul stay, and one Add per
    biased product fewer at least."""
    products, biased = weight_products(tiny_model_dir / graph)
    model = parse_model((tiny_model_dir / graph).read_bytes())
    adds = sum(node.op_type == "Add" for node in model.graph.node)
    assert products > 0 and biased > 0 and fuse_float_matmuls(model) == products
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count(FUSED_OP) == products and "Relu" not in kinds and kinds.count("Add") <= adds - biased
    index = GraphIndex(model.graph)
    assert not [node for node in model.graph.node if node.op_type == "MatMul" and index.constant_dims(node.input[1], FLOAT) is not None]
    assert fuse_float_matmuls(model) == 0


def test_without_avx512_the_products_stay_onnx_runtimes(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AVX-512 the graph is left as it is: the AVX2 tiles were not measured faster than ONNX Runtime's
    products on such a CPU."""
    monkeypatch.setattr("nmt_serve.runtime.float_matmul_fusion.cpu_facts", lambda: {"features": ["avx2"]})
    data = (tiny_model_dir / "decoder.onnx").read_bytes()
    model = parse_model(data)
    assert fuse_float_matmuls(model) == 0
    assert model.SerializeToString() == parse_model(data).SerializeToString()


def test_int8_graphs_keep_their_float_products(int8_dir: Path, fused_on_any_cpu: None) -> None:
    """A graph with int8 weights is left as it is: there a moved rounding could move a quantization level."""
    for graph in ("encoder.onnx", "decoder.onnx"):
        data = (int8_dir / graph).read_bytes()
        model = parse_model(data)
        assert fuse_float_matmuls(model) == 0
        assert model.SerializeToString() == parse_model(data).SerializeToString()


def product_model(shape: list[int], width: int, rng: np.random.Generator, epilogue: str, declared: list[int | str] | None = None):
    """One fused node alone on random weights: x (*shape) -> (*shape[:-1], width), x declared as `declared` (default
    `shape`); its weight and bias."""
    inner = shape[-1]
    weight = (rng.standard_normal((inner, width)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    inputs = ["x", "weight"] + (["bias"] if epilogue != "none" else []) + (["residual"] if epilogue == "residual" else [])
    node = helper.make_node(FUSED_OP, inputs, ["y"], domain=FUSED_DOMAIN, relu=int(epilogue == "relu"))
    declared = declared or shape
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, declared)]
    if epilogue == "residual":
        graph_inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT, [*declared[:-1], width]))
    constants = [numpy_helper.from_array(weight, "weight")] + ([numpy_helper.from_array(bias, "bias")] if epilogue != "none" else [])
    graph = helper.make_graph([node], "product", graph_inputs, [helper.make_empty_tensor_value_info("y")], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)], ir_version=9)
    return model, weight, bias


def on_tiles(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels made from here on `path`'s tiles; skipped where the CPU has not that instruction set."""
    on_instruction_set(TILE_PATHS, path, monkeypatch)


def within_rounding(y: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, residual: np.ndarray | None, epilogue: str) -> None:
    """y against the exact value in float64: a sum of K products and up to two adds, n = K + 2 roundings in all, is
    within gamma_n = n u / (1 - n u) of the sum of the terms' magnitudes (the classic bound for recursive summation,
    u float32's unit roundoff; a ReLU after it moves no value further)."""
    x64, weight64 = x.astype(np.float64), weight.astype(np.float64)
    exact, magnitude = x64 @ weight64, np.abs(x64) @ np.abs(weight64)
    if epilogue != "none":
        exact, magnitude = exact + bias, magnitude + np.abs(bias)
    if residual is not None:
        exact, magnitude = exact + residual, magnitude + np.abs(residual)
    if epilogue == "relu":
        exact = np.maximum(exact, 0.0)
    roundings = (x.shape[-1] + 2) * UNIT_ROUNDOFF
    bound = roundings / (1 - roundings) * magnitude
    assert y.shape == exact.shape and np.all(np.abs(y - exact) <= bound)


@pytest.mark.parametrize("epilogue", ["none", "bias", "relu", "residual"])
@pytest.mark.parametrize("shape,width", [([1, 256], 768), ([2, 64], 48), ([3, 40], 24), ([7, 1, 72], 56), ([8, 1024], 40),
                                         ([1, 37, 100], 200), ([13, 17], 1), ([0, 16], 32)])  # fmt: skip
def test_float_matmul_kernel_within_rounding_and_the_same_on_both_paths(native_kernels_library: Path, shape: list[int], width: int,
                                                                       epilogue: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The node alone on the CPU's best tiles: within float rounding of the exact product, its shape the input's with N
    last; ragged last panels (24, 40, 56, 200, 1), row counts from 0 to 37 across the tiles' 6 rows, 3-D inputs. The
    AVX2 tiles (every supported CPU's) give the same bits, and every row alone gives its bits within the call."""
    rng = np.random.default_rng(sum(shape) * 7 + width)
    model, weight, bias = product_model(shape, width, rng, epilogue)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 10, [*shape[:-1], 1])).astype(np.float32)
    feeds = {"x": x}
    residual = None
    if epilogue == "residual":
        residual = rng.standard_normal([*shape[:-1], width]).astype(np.float32)
        feeds["residual"] = residual
    best = kernel_session(model, native_kernels_library).run(None, feeds)[0]
    within_rounding(best, x, weight, bias, residual, epilogue)
    on_tiles("avx2", monkeypatch)
    avx2 = kernel_session(model, native_kernels_library)
    np.testing.assert_array_equal(avx2.run(None, feeds)[0], best)
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] > 1 and len(shape) == 2:
        alone_model, *_ = product_model([1, shape[-1]], width, np.random.default_rng(sum(shape) * 7 + width), epilogue)
        alone = kernel_session(alone_model, native_kernels_library)
        for row in (0, rows.shape[0] - 1):
            row_feeds = {"x": x[row : row + 1]} | ({"residual": residual[row : row + 1]} if residual is not None else {})
            np.testing.assert_array_equal(alone.run(None, row_feeds)[0], best[row : row + 1])


def test_refusals_name_the_input(native_kernels_library: Path) -> None:
    """A weight the session does not hold as a constant is refused when the session is made; an input whose last axis
    is not K, and a residual not of the output's shape, when the node runs: each naming what is wrong."""
    model, *_ = product_model([2, 8], 16, np.random.default_rng(3), "bias")
    model.graph.input.append(helper.make_tensor_value_info("weight", TensorProto.FLOAT, [8, 16]))
    del model.graph.initializer[0]
    with pytest.raises(Exception, match="float weight product kernel: the weight must be a constant initializer"):
        kernel_session(model, native_kernels_library)
    model, *_ = product_model([2, 8], 16, np.random.default_rng(3), "residual", declared=["r", "k"])
    session = kernel_session(model, native_kernels_library)
    with pytest.raises(Exception, match="the input's last axis must be the weight's K"):
        session.run(None, {"x": np.ones((2, 9), np.float32), "residual": np.ones((2, 16), np.float32)})
    with pytest.raises(Exception, match="the residual must have the output's shape"):
        session.run(None, {"x": np.ones((2, 8), np.float32), "residual": np.ones((3, 16), np.float32)})


@pytest.mark.parametrize("model,path", [("fp32", "best"), ("fp32", "avx2"), ("imported Marian fp32", "best")])
def test_fused_float_graphs_stay_within_the_self_checks_bound(model: str, path: str, native_kernels_library: Path,
                                                              tiny_model_dir: Path, request: pytest.FixtureRequest,
                                                              monkeypatch: pytest.MonkeyPatch, fused_on_any_cpu: None) -> None:  # fmt: skip
    """Encoder and decoder with their float products fused against the same graphs with ONNX Runtime's products (the
    other fusions in both): every decoder call's log-probs and the cross keys and values within the fp32 self-check's
    bound (the bound the server holds a model dir to), and the fused nodes are what ran, once per product and call."""
    if path != "best":
        on_tiles(path, monkeypatch)
    model_dir = tiny_model_dir if model == "fp32" else request.getfixturevalue("imported_marian") / "onnx-fp32"
    pairs, ran = fused_and_stock_products(model_dir, native_kernels_library, "float weight products", "float_matmul", monkeypatch)
    decoder_products, _ = weight_products(model_dir / "decoder.onnx")
    encoder_products, _ = weight_products(model_dir / "encoder.onnx")
    assert ran == decoder_products * len(CALLS) + encoder_products
    for fused_values, stock_values in pairs:
        finite = np.isfinite(stock_values)  # a banned token's log-prob is -inf in both (an imported Marian's pad)
        np.testing.assert_array_equal(fused_values[~finite], stock_values[~finite])
        assert np.abs(fused_values[finite] - stock_values[finite]).max() <= SELF_CHECK_BOUNDS["fp32"]
