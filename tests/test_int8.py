"""int8 schemes: the shipped scheme's MatMuls are exact integer arithmetic on this host, whatever its instruction sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.export.optimize import DEFAULT_INT8_SCHEME, INT8_SCHEMES, convert_to_int8
from nmt_serve.runtime.host import cpu_facts
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.runtime.self_check import EIGHT_BIT_SIGNED_SCHEMES

ROWS, DEPTH, COLUMNS = 8, 64, 16


def one_matmul_model(path: Path, weight: np.ndarray) -> None:
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["y"], name="matmul")], "one_matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", weight.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", weight.shape[1]])],
                              [numpy_helper.from_array(weight, "weight")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


def quantized_weight(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The quantized weight, its per-column scales and zero points, as the converter stored them."""
    initializers = {init.name: numpy_helper.to_array(init) for init in onnx.load(str(path)).graph.initializer}
    return initializers["weight_quantized"], initializers["weight_scale"], initializers["weight_zero_point"]


def test_int8_per_tensor_scheme_matmul_is_exact_integer_arithmetic(tmp_path: Path) -> None:
    """The activations sit on the quantization grid (scale 1, zero point 3), so the quantized product is
    an exact integer sum; the kernel must return it times the weight scales. The inputs are the ones
    that make kernels adding pairs of u8 x s8 products in saturating 16-bit lanes wrong with 8-bit
    weights: activations near 255 and weights of one sign per column (2 x 255 x 127 > 32767). Only the
    two fp32 multiplies by the scales round, so the bound is a few units in the last place (1e-6 relative)."""
    rng = np.random.default_rng(0)
    weight = rng.uniform(0.5, 1.0, size=(DEPTH, COLUMNS)).astype(np.float32)
    weight[:, ::2] *= -1
    one_matmul_model(tmp_path / "fp32.onnx", weight)
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "u8s8-reduce-range")
    quantized, scales, zero_points = quantized_weight(tmp_path / "int8.onnx")
    assert quantized.dtype == np.int8 and np.abs(quantized.astype(np.int64) - zero_points).max() <= 64  # 7-bit signed weights
    activations = rng.integers(200, 256, size=(ROWS, DEPTH))
    activations[:, 0] = 0  # the grid's low end: min(x) = -3, max(x) = 252, so scale = 255 / 255 = 1
    x = (activations - 3).astype(np.float32)
    x[:, 1] = 252
    exact = (x.astype(np.int64) @ (quantized.astype(np.int64) - zero_points.astype(np.int64))) * scales.astype(np.float64)
    y = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(y - exact).max() <= 1e-6 * np.abs(exact).max()
    # and the quantization itself is close to the fp32 product (8-bit weights: ~1/255 of a column's range)
    assert np.abs(y - x @ weight).max() <= 0.01 * np.abs(x @ weight).max()


# The CPUs whose u8s8 kernel sums u8 x s8 products in 32-bit lanes (ONNX Runtime's VNNI and AMX kernels).
NON_SATURATING = {"avx512_vnni", "amx_int8"}
VNNI_HOST = bool(NON_SATURATING & set(cpu_facts()["features"]))
SATURATES = "8-bit u8s8 products saturate 16-bit lanes on a CPU without VNNI or AMX"


@pytest.mark.parametrize(("scheme", "weight_levels"), [
    ("u8s8-rows", 64), ("u8u8-rows", 255),
    pytest.param("u8s8-rows-vnni", 127, marks=pytest.mark.skipif(not VNNI_HOST, reason=SATURATES)),
])  # fmt: skip
def test_int8_row_schemes_quantize_each_row_on_its_own_grid_exactly(tmp_path: Path, scheme: str, weight_levels: int) -> None:
    """Per-row activations (u8s8-rows, the default, and u8u8-rows): a row whose largest |x| is 127 has scale 1, so
    integer activations are on its grid and the quantized product is an exact integer sum times the weight scales,
    whatever the other rows hold (here rows a thousand times larger). Activations near +127 become u8 values near
    255 and the weights have one sign per column: what saturating 16-bit kernels would get wrong with 8-bit signed
    weights (u8s8-rows keeps 7 bits; u8u8-rows has 8 unsigned bits, summed in 32-bit lanes)."""
    rng = np.random.default_rng(0)
    weight = rng.uniform(0.5, 1.0, size=(DEPTH, COLUMNS)).astype(np.float32)
    weight[:, ::2] *= -1
    one_matmul_model(tmp_path / "fp32.onnx", weight)
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", scheme)
    quantized, scales, zero_points = quantized_weight(tmp_path / "int8.onnx")
    assert np.abs(quantized.astype(np.int64) - zero_points).max() <= weight_levels
    x = rng.integers(100, 128, size=(ROWS, DEPTH)).astype(np.float32)
    x[:, 0] = 127  # each row's max |x|: scale 127 / 127 = 1
    x[1::2] *= -1  # rows of either sign
    big = np.concatenate([x, 1000 * rng.normal(size=(ROWS, DEPTH)).astype(np.float32)])
    session = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"])
    exact = (x.astype(np.int64) @ (quantized.astype(np.int64) - zero_points.astype(np.int64))) * scales.astype(np.float64)
    alone = session.run(None, {"x": x})[0]
    assert np.abs(alone - exact).max() <= 1e-6 * np.abs(exact).max()
    # Batched with rows of a thousand times the range, each of these rows' results is the same, bit for bit.
    assert np.array_equal(session.run(None, {"x": big})[0][:ROWS], alone)
    assert np.array_equal(np.concatenate([session.run(None, {"x": x[row : row + 1]})[0] for row in range(ROWS)]), alone)


@pytest.mark.parametrize("scheme", [scheme for scheme in INT8_SCHEMES if scheme not in ("w8-fp32", "w8a8-rows")])
def test_int8_schemes_with_8_bit_signed_weights_are_the_ones_the_self_check_names(tmp_path: Path, scheme: str) -> None:
    """The self-check's advice on a failed host names the schemes whose signed weights use all 8 bits: exactly those."""
    rng = np.random.default_rng(3)
    one_matmul_model(tmp_path / "fp32.onnx", rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", scheme)
    quantized, _, zero_points = quantized_weight(tmp_path / "int8.onnx")
    eight_bit_signed = quantized.dtype == np.int8 and np.abs(quantized.astype(np.int64) - zero_points).max() > 64
    assert eight_bit_signed == (scheme in EIGHT_BIT_SIGNED_SCHEMES)


@pytest.mark.skipif(not VNNI_HOST, reason=SATURATES)
def test_int8_vnni_scheme_is_batch_invariant_where_it_is_exact(tmp_path: Path) -> None:
    """u8s8-rows-vnni quantizes each row on its own, so where its products are exact a row's result is its own: alone,
    batched with rows a thousand times larger, or one row at a time, the bytes are the same. Elsewhere nothing is
    promised (a saturating kernel may pair products differently for one row than for many; the self-check refuses
    such a host)."""
    rng = np.random.default_rng(4)
    one_matmul_model(tmp_path / "fp32.onnx", rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "u8s8-rows-vnni")
    session = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"])
    x = rng.normal(size=(ROWS, DEPTH)).astype(np.float32)
    alone = session.run(None, {"x": x})[0]
    assert np.array_equal(session.run(None, {"x": np.concatenate([x, 1000 * x])})[0][:ROWS], alone)
    assert np.array_equal(np.concatenate([session.run(None, {"x": x[row : row + 1]})[0] for row in range(ROWS)]), alone)


def test_int8_default_scheme_is_per_row_with_7_bit_weights() -> None:
    assert DEFAULT_INT8_SCHEME == "u8s8-rows"


def test_int8_per_tensor_scheme_is_not_batch_invariant(tmp_path: Path) -> None:
    """What u8s8-rows fixes: one scale for the whole call lets a large row coarsen every other row's grid."""
    rng = np.random.default_rng(2)
    one_matmul_model(tmp_path / "fp32.onnx", rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "u8s8-reduce-range")
    session = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"])
    x = rng.normal(size=(ROWS, DEPTH)).astype(np.float32)
    batched = session.run(None, {"x": np.concatenate([x, 1000 * x])})[0][:ROWS]
    assert not np.array_equal(batched, session.run(None, {"x": x})[0])


def test_int8_unknown_scheme_refused(tmp_path: Path) -> None:
    one_matmul_model(tmp_path / "fp32.onnx", np.ones((DEPTH, COLUMNS), dtype=np.float32))
    with pytest.raises(ValueError, match=f"int8 scheme must be one of {', '.join(INT8_SCHEMES)}, got 's4'"):
        convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", "s4")


@pytest.mark.parametrize("scheme", ["u8s8-rows", "u8u8-rows", "u8s8-reduce-range", "u8u8", "w8-fp32"])
def test_int8_saturation_free_schemes_stay_close_to_fp32(tmp_path: Path, scheme: str) -> None:
    """The schemes that cannot saturate on any CPU (7-bit weights: 2 x 255 x 64 < 32767; u8u8 sums in
    32 bits; w8-fp32 multiplies in fp32) err on normal inputs by quantization alone: within 5% of the
    largest output. u8s8 is left out: on CPUs without VNNI it misses this bound on these very inputs
    (pairs of products near 128 x 127 saturate), which is why it is not the default."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32)
    one_matmul_model(tmp_path / "fp32.onnx", weight)
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", scheme)
    x = rng.normal(size=(ROWS, DEPTH)).astype(np.float32)
    y = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(y - x @ weight).max() <= 0.05 * np.abs(x @ weight).max()


def test_int8_conversion_reads_a_graph_with_external_weights(tmp_path: Path) -> None:
    """A graph past 2 GB keeps its weights in a data file beside it; converting one must give the same int8 graph."""
    weight = np.random.default_rng(3).normal(size=(DEPTH, COLUMNS)).astype(np.float32)
    one_matmul_model(tmp_path / "inline.onnx", weight)
    external = tmp_path / "external" / "fp32.onnx"
    external.parent.mkdir()
    onnx.save_model(onnx.load(str(tmp_path / "inline.onnx")), str(external), save_as_external_data=True, location="fp32.onnx.data", size_threshold=0)
    assert (external.parent / "fp32.onnx.data").is_file()
    convert_to_int8(tmp_path / "inline.onnx", tmp_path / "from-inline.onnx")
    convert_to_int8(external, tmp_path / "from-external.onnx")
    x = np.random.default_rng(4).normal(size=(ROWS, DEPTH)).astype(np.float32)
    outputs = [make_session(tmp_path / name, ["CPUExecutionProvider"]).run(None, {"x": x})[0] for name in ("from-inline.onnx", "from-external.onnx")]
    assert np.array_equal(*outputs)


def tied_projection_model(path: Path, embedding: np.ndarray) -> None:
    """The decoder's tied output: the embedding gathered for the token, and its Transpose as the vocabulary MatMul."""
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["tokens"], name="token_embedding"),
             helper.make_node("Transpose", ["embedding"], ["output_projection"], name="output_projection", perm=[1, 0]),
             helper.make_node("MatMul", ["tokens", "output_projection"], ["logits"], name="logits")]  # fmt: skip
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", embedding.shape[0]])],
                              [numpy_helper.from_array(embedding, "embedding")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


@pytest.mark.parametrize("large", [False, True])
def test_int8_tied_projection_is_folded_and_quantized_for_any_model_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool) -> None:
    """The Transpose of the tied embedding is folded into its own int8 weight, never dequantized whole at every step.
    A model whose folded copy passes protobuf's 2 GB takes the external-data path; a tiny limit sends this one there."""
    from nmt_serve.export import optimize

    if large:
        monkeypatch.setattr(optimize, "PROTOBUF_LIMIT", 1)
    embedding = np.random.default_rng(5).normal(size=(COLUMNS * 4, DEPTH)).astype(np.float32)
    tied_projection_model(tmp_path / "fp32.onnx", embedding)
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx")
    nodes = onnx.load(str(tmp_path / "int8.onnx")).graph.node
    assert not [node.name for node in nodes if node.op_type in ("Transpose", "DequantizeLinear") and "output_projection" in "".join(node.output)]
    assert any(node.op_type in ("MatMulInteger", "MatMulIntegerToFloat") for node in nodes), [node.op_type for node in nodes]
    ids = np.arange(8, dtype=np.int64)
    y = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    exact = embedding[ids] @ embedding.T
    assert np.abs(y - exact).max() <= 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("width", [256, 1024])
def test_int8_blocked_row_quantization_gives_the_bytes_of_divide_then_quantize(tmp_path: Path, width: int) -> None:
    """From opset 21 a row is quantized by one blocked QuantizeLinear; both forms divide by the row scale in
    IEEE arithmetic (correctly rounded everywhere) and round half to even, so they agree on every CPU."""
    from nmt_serve.export.row_quantization import BLOCKED_QUANTIZE_OPSET, add_constants, row_quantize_nodes

    def quantizer(opset: int) -> onnx.ModelProto:
        graph = helper.make_graph([], "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, width])],
                                  [helper.make_tensor_value_info("q", TensorProto.UINT8, ["n", 1, width])])  # fmt: skip
        names = add_constants(graph)
        node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero_point"], "quantize")
        nodes, _, _ = row_quantize_nodes(node, names, opset)
        graph.node.extend(nodes)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 10
        return model

    blocked, divided = quantizer(23), quantizer(BLOCKED_QUANTIZE_OPSET - 1)
    assert "Div" in {node.op_type for node in divided.graph.node} and "Div" not in {node.op_type for node in blocked.graph.node}
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((64, 1, width)) * rng.uniform(1e-3, 50.0, (64, 1, 1))).astype(np.float32)
    rows[0] = 0.0  # an all-zero row: scale 0, u8 values from 0 / 0 (a product multiplies them by 0), left out below
    rows[1] = np.clip(rows[1], -100.0, 100.0)
    rows[1, 0, :4] = [127.0, -127.0, 0.5, -0.5]  # row scale 1: 0.5 and -0.5 are ties, rounded half to even
    outputs = []
    for name, model in (("blocked", blocked), ("divided", divided)):
        onnx.save(model, tmp_path / f"{name}.onnx")
        outputs.append(make_session(tmp_path / f"{name}.onnx", threads=1).run(None, {"x": rows})[0])
    assert np.array_equal(outputs[0][1:], outputs[1][1:])


@pytest.mark.parametrize("scheme", ["u8s8-rows", pytest.param("u8s8-rows-vnni", marks=pytest.mark.skipif(not VNNI_HOST, reason=SATURATES)), "u8u8-rows"])
def test_int8_row_schemes_give_an_all_zero_row_a_zero_result(tmp_path: Path, scheme: str) -> None:
    """A row of zeros has the row scale 0 (no floor): whatever its u8 values, its product is the integer sum times 0,
    so 0 plus the bias exactly, as in fp32, next to rows of any size, and the other rows' bytes are those they get alone."""
    rng = np.random.default_rng(5)
    weight, bias = rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32), rng.normal(size=COLUMNS).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["product"], name="matmul"), helper.make_node("Add", ["product", "bias"], ["y"], name="bias")],
                              "matmul_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", DEPTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", COLUMNS])],
                              [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(tmp_path / "fp32.onnx"))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", scheme)
    session = make_session(tmp_path / "int8.onnx", ["CPUExecutionProvider"])
    x = rng.normal(size=(ROWS, DEPTH)).astype(np.float32) * np.array([[1.0], [0.0], [1000.0], [0.0], [1e-3], [1.0], [0.0], [1.0]], np.float32)
    y = session.run(None, {"x": x})[0]
    assert np.isfinite(y).all()
    assert np.array_equal(y[[1, 3, 6]], np.broadcast_to(bias, (3, COLUMNS)))
    assert np.array_equal(np.concatenate([session.run(None, {"x": x[row : row + 1]})[0] for row in range(ROWS)]), y)


@pytest.mark.parametrize("shape", [(64, DEPTH), (64, 1, DEPTH), (1, 1, DEPTH)])
def test_int8_row_scale_folded_into_the_product_gives_the_bytes_of_a_separate_multiply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                        shape: tuple[int, ...]) -> None:  # fmt: skip
    """MatMulIntegerToFloat with the (..., 1) row scale as its activation scale multiplies the product by the weight
    scales, then by it, after the integer GEMM, as the unfused MatMulInteger -> Cast -> Mul -> Mul(row scale) does:
    the same IEEE float32 multiplications, so the same bytes on every CPU, for 2-D and 3-D activations and for a
    single row (a (1, 1, 1) scale is not taken as a scalar)."""
    from nmt_serve.export import row_quantization

    rng = np.random.default_rng(0)
    one_matmul_model(tmp_path / "fp32.onnx", rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "folded.onnx", DEFAULT_INT8_SCHEME)
    monkeypatch.setattr(row_quantization, "fuse_products", lambda graph, row_scales: None)
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "separate.onnx", DEFAULT_INT8_SCHEME)
    folded, separate = (onnx.load(str(tmp_path / f"{name}.onnx")).graph for name in ("folded", "separate"))
    assert [node.op_type for node in separate.node].count("Mul") > [node.op_type for node in folded.node].count("Mul")
    assert not any(node.name.endswith(".unit_scale") for node in folded.node)  # the unit scale nobody reads is gone
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, shape[:-1] + (1,))).astype(np.float32)
    for path in (tmp_path / "folded.onnx", tmp_path / "separate.onnx"):
        graph = onnx.load(str(path))
        for value in (graph.graph.input[0], graph.graph.output[0]):  # the test feeds 2-D and 3-D activations
            value.type.tensor_type.ClearField("shape")
        del graph.graph.value_info[:]
        onnx.save(graph, str(path))
    outputs = [make_session(tmp_path / f"{name}.onnx", threads=1).run(None, {"x": x})[0] for name in ("folded", "separate")]
    assert outputs[0].shape == shape[:-1] + (COLUMNS,)
    assert np.array_equal(outputs[0], outputs[1])


def test_int8_activations_with_the_same_rows_share_one_zero_point_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two quantized activations of shape (rows, ...) get their per-row zero points from one node; the output is
    the bytes of the graph where each makes its own (as where shapes cannot be inferred)."""
    from nmt_serve.export import optimize

    rng = np.random.default_rng(0)
    first, second = rng.normal(size=(DEPTH, DEPTH)).astype(np.float32), rng.normal(size=(DEPTH, COLUMNS)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "first"], ["hidden"], name="first_matmul"), helper.make_node("Relu", ["hidden"], ["relu"], name="relu"),
             helper.make_node("MatMul", ["relu", "second"], ["y"], name="second_matmul")]  # fmt: skip
    graph = helper.make_graph(nodes, "two_matmuls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 1, DEPTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 1, COLUMNS])],
                              [numpy_helper.from_array(first, "first"), numpy_helper.from_array(second, "second")])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10), str(tmp_path / "fp32.onnx"))
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "shared.onnx")
    monkeypatch.setattr(optimize, "known_shapes", lambda model: {})
    convert_to_int8(tmp_path / "fp32.onnx", tmp_path / "own.onnx")

    def zero_point_nodes(name: str) -> int:
        return sum(node.name.endswith(".row.zero_points") for node in onnx.load(str(tmp_path / name)).graph.node)

    assert (zero_point_nodes("shared.onnx"), zero_point_nodes("own.onnx")) == (1, 2)
    x = (rng.standard_normal((16, 1, DEPTH)) * rng.uniform(1e-2, 1e2, (16, 1, 1))).astype(np.float32)
    shared, own = (make_session(tmp_path / name, threads=1).run(None, {"x": x})[0] for name in ("shared.onnx", "own.onnx"))
    assert np.array_equal(shared, own)
