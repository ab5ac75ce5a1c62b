"""fp32 model dirs keep float16-exact weights as float16 (export/exact_halves.py): smaller files, the same numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.export.exact_halves import MIN_ELEMENTS, expand_exact_halves, store_exact_halves
from nmt_serve.export.optimize import convert_to_int8

ROWS, WIDTH = 64, 128  # 8,192 weights: past MIN_ELEMENTS


def matmul_model(weights: dict[str, np.ndarray], feed_weight: bool = False) -> onnx.ModelProto:
    """x @ w for each weight, summed: a graph whose only floats are those weights."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", ROWS])]
    nodes, outputs = [], []
    for name, values in weights.items():
        nodes.append(helper.make_node("MatMul", ["x", name], [f"{name}.out"], f"{name}.matmul"))
        outputs.append(helper.make_tensor_value_info(f"{name}.out", TensorProto.FLOAT, ["n", values.shape[1]]))
        if feed_weight:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(values.shape)))
    initializers = [numpy_helper.from_array(values, name) for name, values in weights.items()]
    graph = helper.make_graph(nodes, "weights", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.fixture
def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    halves = rng.standard_normal((ROWS, WIDTH)).astype(np.float16).astype(np.float32)
    full = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)  # not float16 values
    small = rng.standard_normal((ROWS, 2)).astype(np.float16).astype(np.float32)  # under MIN_ELEMENTS
    assert small.size < MIN_ELEMENTS <= halves.size
    return {"halves": halves, "full": full, "small": small}


def test_only_large_float16_exact_weights_are_stored_as_halves(weights: dict[str, np.ndarray]) -> None:
    model = matmul_model(weights)
    saved = store_exact_halves(model)
    assert saved == weights["halves"].nbytes // 2
    stored = {init.name: init.data_type for init in model.graph.initializer}
    assert stored == {"halves.fp16": TensorProto.FLOAT16, "full": TensorProto.FLOAT, "small": TensorProto.FLOAT}
    onnx.checker.check_model(model)


def test_a_model_with_halves_computes_the_same_bytes(weights: dict[str, np.ndarray]) -> None:
    x = np.random.default_rng(3).standard_normal((5, ROWS)).astype(np.float32)
    plain = run(matmul_model(weights), x)
    halved = matmul_model(weights)
    assert store_exact_halves(halved) > 0
    for before, after in zip(plain, run(halved, x), strict=True):
        assert np.array_equal(before, after)


def test_expand_gives_back_the_float32_initializers(weights: dict[str, np.ndarray]) -> None:
    model = matmul_model(weights)
    store_exact_halves(model)
    assert expand_exact_halves(model)
    assert not expand_exact_halves(model)  # nothing left to expand
    assert [node.op_type for node in model.graph.node] == ["MatMul"] * 3
    for init in model.graph.initializer:
        assert np.array_equal(numpy_helper.to_array(init), weights[init.name])


def test_a_weight_that_is_also_an_input_is_left_as_it_is(weights: dict[str, np.ndarray]) -> None:
    model = matmul_model({"halves": weights["halves"]}, feed_weight=True)
    assert store_exact_halves(model) == 0
    assert model.graph.initializer[0].data_type == TensorProto.FLOAT


def test_fp32_export_stores_the_checkpoints_float16_weights_as_halves(tiny_model_dir: Path) -> None:
    """Checkpoints keep their weights in float16, so an fp32 export of one holds them as halves with Casts."""
    for name in ("encoder.onnx", "decoder.onnx"):
        model = onnx.load(str(tiny_model_dir / name))
        halves = [init.name for init in model.graph.initializer if init.data_type == TensorProto.FLOAT16]
        assert halves, name
        casts = {node.input[0] for node in model.graph.node if node.op_type == "Cast"}
        assert set(halves) <= casts


def test_int8_from_an_fp32_dir_with_halves_is_the_same_as_from_plain_float32(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Quantization reads weights as float32 initializers: the halves are expanded first, so nothing is left unquantized."""
    plain = onnx.load(str(tiny_model_dir / "decoder.onnx"))
    assert expand_exact_halves(plain)
    onnx.save(plain, str(tmp_path / "plain.onnx"))
    convert_to_int8(tmp_path / "plain.onnx", tmp_path / "from-plain.onnx")
    convert_to_int8(tiny_model_dir / "decoder.onnx", tmp_path / "from-halves.onnx")
    assert (tmp_path / "from-plain.onnx").read_bytes() == (tmp_path / "from-halves.onnx").read_bytes()
