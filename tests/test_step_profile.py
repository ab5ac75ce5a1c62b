"""nmt-step-profile: ONNX Runtime's node profile of the decoder step, read back and sorted by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt_serve.bench.step_profile import ACTIVATION_QUANTIZATION, KINDS, main, node_kind, profile_cell
from nmt_serve.bench.systems import Cell


@pytest.mark.parametrize(("op_type", "node", "kind"), [
    ("MatMulIntegerToFloat", "layer0.ffn_up.matmul_quant.to_float", "weight MatMuls"),
    ("Abs", "layer0.ffn_up.matmul_QuantizeLinear.row.abs", ACTIVATION_QUANTIZATION),
    ("Mul", "layer0.ffn_up.matmul_output.row_rescale", ACTIVATION_QUANTIZATION),
    ("DynamicQuantizeLinear", "layer0.ffn_up.matmul_QuantizeLinear", ACTIVATION_QUANTIZATION),
    ("GroupQueryAttention", "layer0.self_attn", "attention"),
    ("QuantizedMatMul", "layer0.ffn_up.matmul_quant.to_float.fused", "weight MatMuls"),
    ("FloatMatMul", "layer0.ffn_up.matmul.fused", "weight MatMuls"),
    ("RowQuantize", "hidden_QuantizeLinear.row.quantize.fused", ACTIVATION_QUANTIZATION),
    ("GroupedCrossAttention", "layer0.cross_attn_rows.fused", "attention"),
    ("Mul", "layer0.something_else", "other nodes"),
])  # fmt: skip
def test_node_kinds_follow_op_types_and_the_exporters_row_names(op_type: str, node: str, kind: str) -> None:
    assert node_kind(op_type, node) == kind


@pytest.mark.parametrize("which", ["tiny_model_dir", "int8_dir"])
def test_profiled_cell_counts_each_decoder_run_once(which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model_dir = request.getfixturevalue(which)
    cell = Cell(batch=2, beam=2, length=6)
    profile = profile_cell(model_dir, [[5, 6, 7, 8], [9, 10, 11]], cell, repeats=2, threads=1, work=tmp_path)
    # Two timed repeats of a forced length of 6 tokens: 6 decoder runs each (every step is one run).
    assert profile.steps == profile.nodes.runs == 12
    shares = profile.kernel_shares()
    assert set(shares) == set(KINDS) and sum(shares.values()) == pytest.approx(1.0)
    assert shares["weight MatMuls"] > 0 and shares["attention"] > 0
    assert (shares[ACTIVATION_QUANTIZATION] > 0) == (which == "int8_dir")
    assert sum(profile.step_shares().values()) == pytest.approx(1.0)


def test_profile_on_the_native_kernels_shows_the_fused_nodes(int8_dir: Path, native_kernels_library: Path, tmp_path: Path) -> None:
    """--native-kernels: the engine as the server runs it where the kernels are built; the profile names the fused
    nodes, the int8 products (with their quantization) among the weight MatMuls."""
    cell = Cell(batch=2, beam=2, length=4)
    profile = profile_cell(int8_dir, [[5, 6, 7, 8], [9, 10, 11]], cell, repeats=1, threads=1, work=tmp_path,
                           native_kernels=str(native_kernels_library))  # fmt: skip
    assert any(name.endswith("(QuantizedMatMul)") for name in profile.nodes.by_node)
    assert not any("(MatMulIntegerToFloat)" in name for name in profile.nodes.by_node)
    assert profile.kernel_shares()["weight MatMuls"] > 0


def test_report_names_every_kind_and_cell(tiny_model_dir: Path, int8_dir: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.md"
    assert main(["--model-dir", f"fp32={tiny_model_dir}", "--model-dir", f"int8={int8_dir}", "--checkpoint", str(tiny_checkpoint),
                 "--test", str(tmp_path / "absent.tsv"), "--batches", "1,2", "--beams", "1", "--length", "4", "--repeats", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text(encoding="utf-8")
    assert "### fp32" in report and "### int8" in report
    assert all(kind in report for kind in KINDS) and "| b2 k1 |" in report and "| b1 k1 |" in report
