"""bench/matmul_ceiling.py: the decoder's weight products cut out whole and exact, timed as a bench system; the ceiling table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from nmt_serve.bench.engine_bench import format_ceilings
from nmt_serve.bench.matmul_ceiling import MatmulCeiling, optimized_decoder, weight_products_model
from nmt_serve.bench.systems import Cell
from nmt_serve.export.optimize import convert_to_int8
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.server.engine.jobs import StepProfile


def decoder_path(model_dir: Path) -> Path:
    return load_model_dir(model_dir).graph_path(model_dir, "decoder")


def test_weight_products_are_every_decoder_matmul_and_compute_x_times_w(tiny_model_dir: Path) -> None:
    layers = load_model_dir(tiny_model_dir).config.n_decoder_layers
    model = weight_products_model(optimized_decoder(decoder_path(tiny_model_dir), threads=1))
    # Per layer: self-attention QKV and output, cross-attention query and output, FFN up and down; then the vocabulary.
    assert [node.op_type for node in model.graph.node] == ["MatMul"] * (6 * layers + 1)
    weights = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {
        tensor.name: rng.standard_normal((3, tensor.type.tensor_type.shape.dim[1].dim_value), dtype=np.float32)
        for tensor in model.graph.input
    }
    for node, output in zip(model.graph.node, session.run(None, feed), strict=True):
        np.testing.assert_allclose(output, feed[node.input[0]] @ weights[node.input[1]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("scheme", "kernel", "element"), [("u8s8-rows", "MatMulIntegerToFloat", np.uint8),
                                                            ("u8s8-reduce-range", "DynamicQuantizeMatMul", np.float32)])  # fmt: skip
def test_weight_products_of_an_int8_decoder_are_the_fused_quantized_kernels(tiny_model_dir: Path, tmp_path: Path, scheme: str, kernel: str,
                                                                            element: type) -> None:  # fmt: skip
    layers = load_model_dir(tiny_model_dir).config.n_decoder_layers
    int8_decoder = tmp_path / "decoder.onnx"
    convert_to_int8(decoder_path(tiny_model_dir), int8_decoder, scheme)
    model = weight_products_model(optimized_decoder(int8_decoder, threads=1))
    assert [node.op_type for node in model.graph.node] == [kernel] * (6 * layers + 1)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # u8s8-rows' products take the quantized rows and each row's scale (export/row_quantization.py)
    assert {tensor.type.tensor_type.elem_type for tensor in model.graph.input if tensor.name != "row_scale"} == {
        helper.np_dtype_to_tensor_dtype(np.dtype(element))
    }
    assert ("row_scale" in {tensor.name for tensor in model.graph.input}) == (scheme == "u8s8-rows")
    feed = {tensor.name: np.ones((2, tensor.type.tensor_type.shape.dim[1].dim_value), dtype=helper.tensor_dtype_to_np_dtype(tensor.type.tensor_type.elem_type))
            for tensor in model.graph.input}  # fmt: skip
    widths = [int(tensor.type.tensor_type.shape.dim[1].dim_value) for tensor in model.graph.output]
    assert [output.shape for output in session.run(None, feed)] == [(2, width) for width in widths]


def test_weight_products_refuse_a_graph_without_them(tiny_model_dir: Path) -> None:
    decoder = optimized_decoder(decoder_path(tiny_model_dir), threads=1)
    kept = [node for node in decoder.graph.node if node.op_type != "MatMul"]
    del decoder.graph.node[:]
    decoder.graph.node.extend(kept)
    with pytest.raises(ValueError, match="no weight MatMul"):
        weight_products_model(decoder)


def test_matmul_ceiling_reports_the_best_hypotheses_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    ceiling = MatmulCeiling(tiny_model_dir, threads=1, label="fp32")
    assert ceiling.name == "nmt-serve fp32 MatMuls alone"
    assert ceiling.run([[5, 6], [7, 8], [9]], Cell(batch=3, beam=4, length=5)) == 3 * 5
    assert {feed.shape[0] for feed in ceiling.feed(12).values()} == {12}  # batch x beam rows per step


def test_ceiling_table_divides_the_ceiling_by_each_target() -> None:
    cell = Cell(batch=8, beam=4, length=32)
    medians = {"pytorch fp32": 100.0, "ctranslate2 fp32": 400.0, "ctranslate2 int8": 1000.0, "nmt-serve fp32": 380.0,
               "nmt-serve int8": 900.0, "nmt-serve fp32 MatMuls alone": 900.0, "nmt-serve int8 MatMuls alone": 2600.0}  # fmt: skip
    systems = [type("S", (), {"name": name})() for name in medians]
    table = format_ceilings(systems, [cell], {(cell, name): [value] for name, value in medians.items()})
    row = table.splitlines()[-1].split("|")[1:-1]
    # fp32 target 1.15 x 400 = 460, ceiling 900 -> 1.96x; int8 target 1.15 x 1000 = 1150, ceiling 2600 -> 2.26x.
    assert [value.strip() for value in row] == ["8", "4", "32", "900", "380", "460", "1.96x", "n/a", "2600", "900", "1150", "2.26x", "n/a"]


def test_ceiling_table_gives_the_decoder_calls_alone_from_the_step_profile() -> None:
    """A system whose decoder calls took 3/4 of its step time would run at 4/3 of its tokens/s without the rest."""
    cell = Cell(batch=1, beam=1, length=32)
    medians = {"ctranslate2 fp32": 400.0, "ctranslate2 int8": 1000.0, "nmt-serve fp32": 300.0, "nmt-serve int8": 900.0,
               "nmt-serve fp32 MatMuls alone": 900.0, "nmt-serve int8 MatMuls alone": 2600.0}  # fmt: skip
    profiles = {
        "nmt-serve fp32": StepProfile(steps=32, total_s=1.0, decode_s=0.5),
        "nmt-serve int8": StepProfile(steps=32, total_s=1.0, decode_s=0.75),
    }
    systems = [type("S", (), {"name": name, "cell_profiles": {cell: profiles[name]} if name in profiles else {}})() for name in medians]
    row = format_ceilings(systems, [cell], {(cell, name): [value] for name, value in medians.items()}).splitlines()[-1].split("|")[1:-1]
    # fp32: 300 / 0.5 = 600 against 1.15 x 400 = 460 -> 1.30x; int8: 900 / 0.75 = 1200 against 1150 -> 1.04x.
    assert row[7].strip() == "600 (1.30x)" and row[12].strip() == "1200 (1.04x)"
