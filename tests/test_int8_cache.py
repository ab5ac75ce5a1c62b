"""The int8 self-attention cache (export/int8_cache.py): calibrated scales, the rewritten decoder, the runtime's int8 buffers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from nmt_serve.export.int8_cache import CACHE_SCALE_MARGIN, INT8_LEVELS, cache_scales, calibrate_cache_scales, calibration_sources
from nmt_serve.export.onnx_export import main as export_main
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.padding import pad_sources
from nmt_serve.model.search import FinishReason, SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import INT8_CACHE_BOUND, SELF_CHECK_BOUNDS, SELF_CHECK_FILE


def cached_values(checkpoint: Path, sources: list[list[int]]) -> list[np.ndarray]:
    """Per decoder layer, |key| and |value| of every token the model feeds itself while it translates each source
    greedily, recomputed teacher-forced on its own output through the model's decode (one source at a time, no
    padding): (2, tokens, d_model)."""
    loaded = load_checkpoint(checkpoint)
    model, config = loaded.model, loaded.config
    outputs = generate(TorchStep(model), sources, SearchOptions(beam_size=1), config.bos_id, config.eos_id, config.max_positions)
    found: list[list[np.ndarray]] = [[] for _ in range(config.n_decoder_layers)]
    with torch.no_grad():
        for source, hypotheses in zip(sources, outputs, strict=True):
            src_ids, src_mask = pad_sources([source], config.pad_id, config.eos_id)
            src, mask = torch.from_numpy(src_ids), torch.from_numpy(src_mask)
            best = hypotheses[0]
            # Every token fed: BOS and each token written, but the last of a hypothesis cut at its length limit (an EOS
            # is not in token_ids and was never fed either).
            fed = [config.bos_id, *best.token_ids][: len(best.token_ids) + (best.finish_reason is FinishReason.EOS)]
            tgt = torch.tensor([fed])
            positions = torch.zeros(1, dtype=torch.long)
            past_mask = torch.zeros(1, 0, dtype=torch.bool)
            _, present = model.decode(tgt, positions, model.empty_past(1, tgt.device), past_mask, model.cross_kv(model.encode(src, mask)), mask)
            for layer, (key, value) in enumerate(present):  # (1, H, T, Dh) each
                flat = [tensor[0].permute(1, 0, 2).reshape(tgt.shape[1], -1).abs().numpy() for tensor in (key, value)]
                found[layer].append(np.stack(flat))
    return [np.concatenate(parts, axis=1) for parts in found]


def test_calibrated_scales_are_each_channels_largest_cached_value_widened_by_the_margin(tiny_checkpoint: Path, tiny_corpus: dict[str, Path]) -> None:
    """The hooks on the key and value projections see what the decoder caches while it translates: checked against
    the model's own outputs fed back through its full-sequence decode (the same values up to rounding)."""
    loaded = load_checkpoint(tiny_checkpoint)
    sources = calibration_sources(tiny_corpus["valid"], loaded.tokenizer)
    assert len(sources) == 20
    scales = calibrate_cache_scales(loaded.model, sources)
    assert scales.shape == (loaded.config.n_decoder_layers, 2, loaded.config.d_model)
    for layer, values in enumerate(cached_values(tiny_checkpoint, sources)):
        np.testing.assert_allclose(scales[layer] * INT8_LEVELS / CACHE_SCALE_MARGIN, values.max(axis=1), rtol=1e-4)


def test_calibration_without_sources_is_refused(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="at least one source sentence"):
        calibrate_cache_scales(load_checkpoint(tiny_checkpoint).model, [])


def test_an_int8_cache_dir_binds_int8_caches_and_records_its_calibration(int8_cache_dir: Path, tiny_corpus: dict[str, Path]) -> None:
    manifest = load_model_dir(int8_cache_dir)
    past = [spec for spec in manifest.graph("decoder").inputs if spec.name.startswith("past_")]
    present = [spec for spec in manifest.graph("decoder").outputs if spec.name.startswith("present_")]
    assert past and {spec.dtype for spec in [*past, *present]} == {"int8"}
    assert manifest.created_by["int8_cache"] == {"calibration": str(tiny_corpus["valid"]), "sentences": 20, "margin": CACHE_SCALE_MARGIN}
    decoder = onnx.load(str(int8_cache_dir / "decoder.onnx"), load_external_data=False)
    attention = [node for node in decoder.graph.node if node.op_type == "GroupQueryAttention"]
    assert attention
    for node in attention:
        attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}
        assert (attributes["k_quant_type"], attributes["v_quant_type"], attributes["kv_cache_bit_width"]) == (b"PER_CHANNEL", b"PER_CHANNEL", 8)
    assert OrtStep(int8_cache_dir).cache.cache_dtype is np.int8
    # The parity compared the cache in its own units (steps x scale). Its random tokens take some values past the
    # calibrated range, which clip, but never past the largest value the cache holds; raw steps (up to 127) would be.
    largest = INT8_LEVELS * max(float(scale.max()) for scale in cache_scales(decoder).values())
    assert 0.0 < manifest.parity["tensors"]["max_abs_present_kv_diff"] < largest < 0.5 * INT8_LEVELS


def test_a_new_slot_holds_the_float_caches_value_rounded_to_its_channels_step(int8_cache_dir: Path, tiny_checkpoint: Path,
                                                                                  tiny_corpus: dict[str, Path], tmp_path: Path) -> None:  # fmt: skip
    """Layer 0's first slot depends on the token and position alone, so the int8 dir and the same export with a float
    cache compute the same key and value there: the int8 slot must be that value / its channel's scale, rounded and
    clipped to int8, as the graph's scales say."""
    float_dir = tmp_path / "int8-float-cache"
    assert export_main([str(tiny_checkpoint), "--out", str(float_dir), "--precision", "int8", "--no-parity"]) == 0
    assert OrtStep(float_dir).cache.cache_dtype is np.float32
    scales = cache_scales(onnx.load(str(int8_cache_dir / "decoder.onnx"), load_external_data=False))
    assert set(scales) == {f"past_{kind}_{layer}" for layer in range(load_model_dir(int8_cache_dir).config.n_decoder_layers) for kind in ("key", "value")}
    sources = load_checkpoint(tiny_checkpoint).tokenizer.encode_batch([source for source, _ in read_tsv(str(tiny_corpus["test"]))[:6]])
    slots = {}
    for directory in (int8_cache_dir, float_dir):
        step = OrtStep(directory)
        step.begin(sources)
        rows = np.arange(len(sources))
        step(rows, np.full(len(sources), -1), np.arange(4, 4 + len(sources)))
        slots[directory] = [np.stack([step.cache.row_cache(row)[index] for row in rows]) for index in (0, 1)]  # past_key_0, past_value_0
    for index, name in enumerate(("past_key_0", "past_value_0")):
        # In steps of the scale, clipped to int8. How a kernel divides (by the scale, or times its reciprocal) and breaks
        # a tie may differ between instruction sets, so the stored step is held to within half a step (and a float
        # rounding's hair) of the exact quotient, not to numpy's own rounding of it.
        quotient = np.clip(slots[float_dir][index].astype(np.float64) / scales[name], -128, 127)
        stored = slots[int8_cache_dir][index]
        assert stored.dtype == np.int8
        assert np.abs(stored - quotient).max() <= 0.5 + 1e-3
        assert np.abs(stored).max() > 8  # the values span many steps: a scale off by a large factor would not pass


def test_cache_calibration_is_refused_for_a_float_precision(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--cache-calibration is for --precision int8"):
        export_main([str(tiny_checkpoint), "--out", str(tmp_path / "fp32"), "--cache-calibration", str(tiny_corpus["valid"]), "--no-parity"])


def test_an_int8_cache_dir_answers_alike_alone_and_packed(int8_cache_dir: Path) -> None:
    """Constant scales: a row's cache depends on its own tokens only. The export's own batch check says so too."""
    batch = json.loads((int8_cache_dir / "manifest.json").read_text())["parity"]["batch"]
    for search in ("greedy", "beam4"):
        assert batch[search]["identical_tokens"] == batch["sentences"]
        assert batch[search]["max_score_diff"] == 0.0


def test_ort_reads_the_graph_types_it_was_given(int8_cache_dir: Path) -> None:
    """The session's own view of the rewritten graph: int8 past K/V in, int8 present K/V out."""
    session = ort.InferenceSession(str(int8_cache_dir / "decoder.onnx"), providers=["CPUExecutionProvider"])
    types = {value.name: value.type for value in [*session.get_inputs(), *session.get_outputs()]}
    assert {types[name] for name in types if name.startswith(("past_", "present_"))} == {"tensor(int8)"}


def test_int8_schemes_measures_each_scheme_again_with_an_int8_cache(tiny_checkpoint: Path, tiny_model_dir: Path,
                                                                     tiny_corpus: dict[str, Path], tmp_path: Path) -> None:  # fmt: skip
    """nmt-int8-schemes --cache-calibration: a second row per scheme, whose agreement with PyTorch is measured on its own dir."""
    from nmt_serve.bench.int8_schemes import main as schemes_main

    out = tmp_path / "schemes.md"
    assert schemes_main(["--checkpoint", str(tiny_checkpoint), "--fp32-dir", str(tiny_model_dir), "--test", str(tiny_corpus["test"]),
                         "--limit", "4", "--schemes", "u8s8-rows", "--cache-calibration", str(tiny_corpus["valid"]),
                         "--batches", "2", "--beams", "1,2", "--length", "4", "--repeats", "1", "--out", str(out)]) == 0  # fmt: skip
    labels = [line.split(" | ")[0].lstrip("| ") for line in out.read_text().splitlines() if line.startswith("| u8s8-rows")]
    assert labels == ["u8s8-rows", "u8s8-rows + int8 cache"] * 2  # the agreement table, then the tokens/s table


def test_an_imported_marian_model_exports_an_int8_cache_and_agrees_with_itself_alone_and_packed(marian_dir: Path, tmp_path: Path) -> None:
    """The benchmarks of imported shapes export as a user would (nmt-import, then nmt-export per precision): the int8
    dir's cache is int8, scaled on what the imported model writes for the calibration sentences, and the fp32 dir's stays
    float32; both keep their parity report's batch invariance."""
    from nmt_serve.bench.import_timing import ImportTimings, import_and_export
    from nmt_serve.bench.random_marian import german_sentences

    timings = ImportTimings("marian", parity_limit=4, export_parity=4)
    checkpoint = import_and_export(marian_dir, "marian", tmp_path, german_sentences(8, seed=1), timings, german_sentences(12, seed=2))
    dtypes = {precision: {spec.dtype for spec in load_model_dir(checkpoint / f"onnx-{precision}").graph("decoder").inputs if spec.name.startswith("past_")}
              for precision in ("fp32", "int8")}  # fmt: skip
    assert dtypes == {"fp32": {"float32"}, "int8": {"int8"}}
    manifest = load_model_dir(checkpoint / "onnx-int8")
    assert manifest.created_by["int8_cache"]["sentences"] == 12
    assert all(manifest.parity["batch"][search]["max_score_diff"] == 0.0 for search in ("greedy", "beam4"))


def test_the_self_check_of_an_int8_cache_dir_allows_its_wider_rounding(int8_cache_dir: Path, int8_dir: Path) -> None:
    """Each dir's reference stores its bound: the int8 cache's (a key or value rounded once more per slot), the float cache's."""
    bounds = {directory: json.loads((directory / SELF_CHECK_FILE).read_text())["bound"] for directory in (int8_cache_dir, int8_dir)}
    assert bounds == {int8_cache_dir: INT8_CACHE_BOUND, int8_dir: SELF_CHECK_BOUNDS["int8"]}
    assert SELF_CHECK_BOUNDS["int8"] < INT8_CACHE_BOUND
