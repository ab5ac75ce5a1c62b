"""nmt-step-ablation: decoder variants with one part taken out, bound as the engine binds the decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from nmt_serve.bench.matmul_ceiling import MatmulCeiling
from nmt_serve.bench.step_ablation import (AS_EXPORTED, CROSS_ATTENTION, SELF_ATTENTION, VARIANTS, WEIGHT_PRODUCTS, BoundDecoder,
                                           BoundWeightProducts, Setting, format_table, main, variant_models, variant_sessions)  # fmt: skip
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.runtime.source_group import MIN_SOURCE_WIDTH, NARROW_SOURCE_WIDTH
from nmt_serve.runtime.source_layout import MIN_QUERIES


def op_types(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node}


def bound_variants(model_dir: Path, tmp_path: Path, setting: Setting) -> dict[str, BoundDecoder]:
    config = load_model_dir(model_dir).config
    sessions = variant_sessions(model_dir, 1, tmp_path)
    saved = sorted(tmp_path.glob("*.onnx"))
    assert len(saved) == len(sessions)
    for path in saved:
        onnx.checker.check_model(str(path))
    return {name: BoundDecoder(session, config, setting, [5, 9, 3]) for name, session in sessions.items()}


def test_int8_variants_take_out_only_their_part(int8_dir: Path) -> None:
    manifest = load_model_dir(int8_dir)
    models = variant_models(manifest.graph_path(int8_dir, "decoder"), manifest.config)
    assert set(models) == {AS_EXPORTED, *VARIANTS}
    assert {SELF_ATTENTION, CROSS_ATTENTION} <= op_types(models[AS_EXPORTED])
    assert SELF_ATTENTION not in op_types(models["self-attention"]) and CROSS_ATTENTION in op_types(models["self-attention"])
    assert CROSS_ATTENTION not in op_types(models["cross-attention"]) and SELF_ATTENTION in op_types(models["cross-attention"])
    assert not {SELF_ATTENTION, CROSS_ATTENTION} & op_types(models["all attention"])
    assert not any(output.name.startswith("present_") for output in models["self-attention"].graph.output)
    assert "LogSoftmax" not in op_types(models["log-softmax"])
    scale_nodes = [node for node in models["row-scale Abs and Mul"].graph.node if node.name.endswith((".row.abs", ".row.scale"))]
    assert not scale_nodes and "Abs" in op_types(models[AS_EXPORTED])


def test_fp32_dir_has_no_row_scales_to_take_out(tiny_model_dir: Path) -> None:
    manifest = load_model_dir(tiny_model_dir)
    variants = variant_models(manifest.graph_path(tiny_model_dir, "decoder"), manifest.config)
    assert set(variants) == {AS_EXPORTED, *VARIANTS} - {"row-scale Abs and Mul"}


def test_bound_decoder_computes_what_a_plain_run_computes(int8_dir: Path, tmp_path: Path) -> None:
    bound = bound_variants(int8_dir, tmp_path, Setting(rows=3, position=4))
    exported = bound[AS_EXPORTED]
    feeds = {name: array.copy() for name, array in exported.inputs.items()}  # before the bound call writes its cache slot
    exported.session.run_with_iobinding(exported.binding)
    plain = exported.session.run(["log_probs"], feeds)[0]
    np.testing.assert_allclose(exported.log_probs, plain, rtol=0, atol=1e-5)
    assert np.isfinite(exported.log_probs).all()
    np.testing.assert_allclose(np.exp(exported.log_probs).sum(axis=1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_runs_bound_as_the_engine_binds(variant: str, int8_dir: Path, tmp_path: Path) -> None:
    bound = bound_variants(int8_dir, tmp_path, Setting(rows=4, position=6))
    assert bound[variant].time_calls(2) > 0
    assert bound[variant].log_probs.shape == (4, load_model_dir(int8_dir).config.vocab_size)


def test_without_log_softmax_the_call_returns_the_logits(int8_dir: Path, tmp_path: Path) -> None:
    bound = bound_variants(int8_dir, tmp_path, Setting(rows=2, position=3))
    for decoder in (bound[AS_EXPORTED], bound["log-softmax"]):
        decoder.session.run_with_iobinding(decoder.binding)
    # log_softmax(logits) = logits - logsumexp(logits): the same row shifted by one constant.
    shift = bound["log-softmax"].log_probs - bound[AS_EXPORTED].log_probs
    np.testing.assert_allclose(shift, np.broadcast_to(shift[:, :1], shift.shape), rtol=0, atol=1e-4)


def test_bound_decoder_groups_and_queries_sources_as_the_engine_does(int8_dir: Path) -> None:
    """Short sources in the narrow group, the others in the wide one as wide as their longest; every source with
    MIN_QUERIES queries as the step cache gives it; each row's result read back from a query of its own source."""
    manifest = load_model_dir(int8_dir)
    session = make_session(manifest.graph_path(int8_dir, "decoder"), ["CPUExecutionProvider"], 1)
    inputs = BoundDecoder(session, manifest.config, Setting(rows=3, position=2), [40, 9, 25]).inputs
    assert inputs["narrow_src_mask"].sum(axis=1).tolist() == [9] and inputs["narrow_cross_key_0"].shape[2] == NARROW_SOURCE_WIDTH
    assert inputs["src_mask"].sum(axis=1).tolist() == [40, 25] and inputs["cross_key_0"].shape[2] == 48
    queries = np.concatenate([inputs["narrow_source_queries"], inputs["source_queries"]])
    assert queries.shape == (3, MIN_QUERIES)
    for row in range(3):
        assert queries.reshape(-1)[inputs["row_queries"][row]] == row


def test_a_width_setting_cuts_the_sources_and_binds_them_that_wide(int8_dir: Path, tmp_path: Path) -> None:
    """Calls that differ only in masked columns: the sources are cut to MIN_SOURCE_WIDTH tokens and bound as wide as asked."""
    manifest = load_model_dir(int8_dir)
    session = make_session(manifest.graph_path(int8_dir, "decoder"), ["CPUExecutionProvider"], 1)
    results = []
    for width in (16, 32, 48):
        decoder = BoundDecoder(session, manifest.config, Setting(rows=3, position=2, width=width), [40, 9, 25])
        assert decoder.inputs["cross_key_0"].shape[2] == width
        assert decoder.inputs["src_mask"].sum(axis=1).tolist() == [MIN_SOURCE_WIDTH, 9, MIN_SOURCE_WIDTH]
        decoder.session.run_with_iobinding(decoder.binding)
        results.append(decoder.log_probs.copy())
    assert all(result.shape == (3, manifest.config.vocab_size) and np.isfinite(result).all() for result in results)


def test_bound_weight_products_compute_what_a_plain_run_computes(int8_dir: Path) -> None:
    ceiling = MatmulCeiling(int8_dir, 1, "int8")
    bound = BoundWeightProducts(ceiling, 3)
    bound.session.run_with_iobinding(bound.binding)
    plain = ceiling.session.run(None, bound.inputs)
    assert len(plain) == len(bound.outputs) > 0
    for kept, expected in zip(bound.outputs, plain, strict=True):
        assert kept.shape == expected.shape and kept.shape[0] == 3
        np.testing.assert_array_equal(kept, expected)
    assert bound.time_calls(2) > 0


def test_the_rest_of_the_call_is_what_neither_weights_nor_attention_explain() -> None:
    """Call 100 us, weight products 50 us, 30 us faster without attention: 20 us is neither."""
    times = {AS_EXPORTED: 100e-6, WEIGHT_PRODUCTS: 50e-6, "all attention": 70e-6, "self-attention": 90e-6}
    row = format_table("dir", {Setting(8, 16): times}).splitlines()[-1]
    assert row == "| 8 | 16 | 100 | 50 us (50%) | 10 us (10%) | 30 us (30%) | 20 us (20%) |"


def test_report_has_a_table_per_model_dir(int8_dir: Path, tiny_model_dir: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "ablation.md"
    assert main(["--model-dir", str(int8_dir), "--model-dir", str(tiny_model_dir), "--checkpoint", str(tiny_checkpoint),
                 "--test", str(tmp_path / "absent.tsv"), "--rows", "1,3", "--positions", "2", "--widths", "16,32", "--rounds", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text(encoding="utf-8")
    assert report.count("### ") == 4 and "| 3 | 2 |" in report and "without all attention" in report
    assert report.count(f"| {WEIGHT_PRODUCTS} |") == 2 and report.count("| neither weight products nor attention |") == 2
    assert report.count("| 16 wide (us) | 32 wide (us) |") == 2
