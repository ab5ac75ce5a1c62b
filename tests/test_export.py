"""nmt-export and parity on the tiny checkpoint: fp32 and int8 model dirs, empty past, mixed rows, broken files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from nmt_serve.export.decoder_graph import ACTIVATION_WRITERS, write_activation
from nmt_serve.export.graph_writer import GraphWriter
from nmt_serve.export.onnx_export import main as export_main
from nmt_serve.export.parity import run_parity
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.config import ACTIVATIONS
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.transformer import ACTIVATION_FUNCTIONS
from nmt_serve.runtime import source_group, step_cache
from nmt_serve.runtime.graph_links import readers, writers
from nmt_serve.runtime.manifest import ModelDirError, load_model_dir
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.source_group import NARROW_SOURCE_WIDTH
from nmt_serve.runtime.source_layout import MIN_QUERIES
from tests.extensions import compiled_extension


@pytest.fixture(scope="session")
def fp32_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session", params=["int8", "fp16"])
def variant_dir(request: pytest.FixtureRequest, tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"onnx-{request.param}")
    args = [str(tiny_checkpoint), "--out", str(out), "--precision", request.param, "--parity-test", str(tiny_corpus["test"])]
    assert export_main(args) == 0
    return out


def begin_both(model_dir: Path, checkpoint: Path, sources: list[list[int]]) -> tuple[TorchStep, OrtStep]:
    """The PyTorch step and the ONNX Runtime step of one model, both begun on `sources`."""
    torch_step, ort_step = TorchStep(load_checkpoint(checkpoint).model), OrtStep(model_dir)
    for step in (torch_step, ort_step):
        step.begin(sources)
    return torch_step, ort_step


def test_graph_writer_knows_exactly_the_configs_activations() -> None:
    """An activation the config accepts but the graph writer lacks would fail only at export of such a model."""
    assert set(ACTIVATION_WRITERS) == set(ACTIVATIONS) == set(ACTIVATION_FUNCTIONS)


def test_write_activation_refuses_an_unknown_activation() -> None:
    graph = GraphWriter()
    with pytest.raises(ValueError, match="'tanh'"):
        write_activation(graph, "x", "tanh", "layer0.ffn")
    assert graph.nodes == []


def test_export_writes_a_verified_model_dir(fp32_dir: Path) -> None:
    manifest = load_model_dir(fp32_dir)
    assert manifest.precision == "fp32"
    assert set(manifest.files) == {"encoder.onnx", "decoder.onnx", "shared_weights.bin", "tokenizer.json", "self_check.json"}
    for name in ("encoder.onnx", "decoder.onnx"):
        onnx.checker.check_model(str(fp32_dir / name))
    decoder_inputs = manifest.input_names("decoder")
    assert list(decoder_inputs[:8]) == ["tgt_ids", "positions", "src_mask", "source_queries", "row_queries", "narrow_src_mask",
                                        "narrow_source_queries", "past_key_0"]  # fmt: skip
    assert "narrow_cross_key_0" in decoder_inputs
    assert manifest.output_names("decoder")[:2] == ("log_probs", "present_key_0")


def test_export_has_one_decoder_graph_without_control_flow(fp32_dir: Path) -> None:
    graph = onnx.load(str(fp32_dir / "decoder.onnx")).graph
    assert not {"If", "Loop", "Scan"} & {node.op_type for node in graph.node}
    assert sorted(path.name for path in fp32_dir.glob("*.onnx")) == ["decoder.onnx", "encoder.onnx"]


def test_export_fp32_parity_in_manifest(fp32_dir: Path) -> None:
    parity = load_model_dir(fp32_dir).parity
    assert parity["tensors"]["max_abs_log_prob_diff"] <= 1e-4
    assert parity["tensors"]["max_abs_present_kv_diff"] <= 1e-4
    for name in ("greedy", "beam4"):
        assert parity["search"][name]["identical_ratio"] == 1.0
        assert parity["search"][name]["bleu_delta"] == 0.0


def test_export_empty_past_first_step_matches_torch(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[5, 6, 7, 8], [9], [10, 11]])
    args = (np.array([0, 1, 2]), np.array([-1, -1, -1]), np.full(3, ort_step.config.bos_id))
    np.testing.assert_allclose(ort_step(*args), torch_step(*args), atol=1e-4)
    assert ort_step.cache.positions.tolist() == [1, 1, 1]  # each row has cached its first token


def test_encoder_runs_its_products_on_the_real_tokens_only(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """Sources of 3, 9 and 5 tokens padded to 14 columns: the first product reads 17 rows, not 42; the stacked
    projections make four products a layer and one for every decoder layer's cross keys and values; and each
    source's real positions get PyTorch's padded outputs and its outputs alone."""
    encoder = onnx.load(str(fp32_dir / "encoder.onnx"))
    # Weights are initializers, or the Casts of float16 ones (exact halves).
    weights = {tensor.name for tensor in encoder.graph.initializer}
    weights |= {node.output[0] for node in encoder.graph.node if node.op_type == "Cast"}
    products = [node for node in encoder.graph.node if node.op_type == "MatMul" and node.input[1] in weights]  # not attention
    model = load_checkpoint(tiny_checkpoint).model
    assert len(products) == 4 * model.config.n_encoder_layers + 1
    first_rows = products[0].input[0]
    encoder.graph.output.append(onnx.helper.make_tensor_value_info(first_rows, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(encoder.SerializeToString(), providers=["CPUExecutionProvider"])
    lengths = [3, 9, 5]
    ids = np.zeros((3, 14), np.int64)
    mask = np.zeros((3, 14), bool)
    for row, length in enumerate(lengths):
        ids[row, :length], mask[row, :length] = np.arange(5, 5 + length) + row, True
    *packed, rows = session.run(None, {"src_ids": ids, "src_mask": mask})
    assert rows.shape[:2] == (1, sum(lengths))
    with torch.no_grad():
        padded = [t.numpy() for pair in model.cross_kv(model.encode(torch.from_numpy(ids), torch.from_numpy(mask))) for t in pair]
    for row, length in enumerate(lengths):
        *alone, _ = session.run(None, {"src_ids": ids[row:row + 1, :length], "src_mask": mask[row:row + 1, :length]})
        for ours, reference, by_itself in zip(packed, padded, alone, strict=True):
            # Outputs of magnitude up to ~3.5, whose float32 spacing is 2.4e-7: PyTorch's kernels sum in another order
            # (measured here within 9.2e-7), so 1e-5 leaves room for any CPU's kernels. Alone and packed run the same
            # kernels on the same rows: padded keys add exact zeros to the attention sums (0.0 apart here); 1e-6 is four
            # spacings, not a tolerance for a real difference.
            np.testing.assert_allclose(ours[row, :, :length], reference[row, :, :length], atol=1e-5)
            np.testing.assert_allclose(ours[row, :, :length], by_itself[0], atol=1e-6)


def test_export_mixed_positions_and_source_lengths_match_torch(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """Batch of 4 rows: two continue (one duplicated, as in a beam), one joins at position 0, sources of 3 lengths."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]])
    calls = [
        (np.array([0, 1]), np.array([-1, -1]), np.array([1, 1])),
        (np.array([0, 1]), np.array([0, 1]), np.array([20, 21])),
        (np.array([0, 0, 1, 2]), np.array([0, 0, 1, -1]), np.array([22, 23, 24, 1])),
        (np.array([0, 2, 1, 0]), np.array([1, 3, 2, 0]), np.array([25, 26, 27, 28])),
    ]
    for call in calls:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
    assert ort_step.cache.positions.tolist() == [4, 2, 4, 4]


def test_step_cache_reuses_the_binding_of_a_layout_it_returns_to(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """Rows joining and leaving switch between kept IO bindings (same buffers), and the results stay torch's."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]])
    three, two = (np.array([0, 1, 2]), np.array([0, 1, 2])), (np.array([0, 1]), np.array([1, 0]))
    calls = [
        (three[0], np.full(3, -1), np.array([1, 1, 1])),
        # layout (3 rows, 3 short sources, no long one, MIN_QUERIES queries)
        (three[0], three[1], np.array([20, 21, 22])),
        (two[0], two[1], np.array([23, 24])),  # a source left, rows swapped: (2, 2, 0, MIN_QUERIES)
        (three[0], np.array([1, 0, -1]), np.array([25, 26, 1])),  # back to (3, 3, 0, MIN_QUERIES): the kept binding
        (two[0], two[1], np.array([27, 28])),  # and back to (2, 2, 0, MIN_QUERIES)
    ]
    seen: dict[tuple[int, int, int, int], object] = {}
    for call in calls:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        bound = ort_step.cache._binding
        assert bound is not None
        assert seen.setdefault(bound.layout, bound.io_binding) is bound.io_binding  # one binding per layout, reused
    assert set(seen) == {(3, 3, 0, MIN_QUERIES), (2, 2, 0, MIN_QUERIES)}


def test_step_cache_buffers_grow_keeping_what_they_held() -> None:
    """`grown`: the old array in the corner of the new shape, the fill elsewhere; `kept` carries fewer leading rows."""
    block = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) + 1
    whole = source_group.grown(block, (2, 5, 6))
    assert np.array_equal(whole[:, :3, :4], block) and not whole[:, 3:].any() and not whole[:, :, 4:].any()
    live = source_group.grown(block, (2, 5, 6), kept=(2, 1))  # both tensors, the first row only
    assert np.array_equal(live[:, :1, :4], block[:, :1]) and not live[:, 1:].any()
    keys = source_group.grown(np.array([7, 8]), (4,), fill=-1)
    assert keys.tolist() == [7, 8, -1, -1]
    narrowed = source_group.grown(block, (4, 3, 2))  # more rows, a narrower last axis: what fits is carried
    assert np.array_equal(narrowed[:2], block[:, :, :2]) and not narrowed[2:].any()


@pytest.fixture(scope="module")
def compiled_cache_moves(tmp_path_factory: pytest.TempPathFactory) -> object:
    return compiled_extension("cache_moves", tmp_path_factory.mktemp("cache_moves"))


@pytest.mark.parametrize("layout_rows", [0, step_cache.PYTHON_LAYOUT_ROWS])
@pytest.mark.parametrize("small_copy_slots", [0, 1000])
@pytest.mark.parametrize("compiled_moves", [False, True], ids=["numpy-moves", "compiled-moves"])
def test_step_cache_moves_copy_only_the_slots_a_row_does_not_share(fp32_dir: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    request: pytest.FixtureRequest, small_copy_slots: int,
                                                                    layout_rows: int, compiled_moves: bool) -> None:  # fmt: skip
    """Beams sharing a prefix: a row taking a sibling's hypothesis copies only the slots after the shared
    ones (lineage path); in numpy, small moves copy every used slot at once, and so does a swap, which reads both rows
    first; the compiled moves find the shared slots of every move between distinct rows. Torch's log-probs at every
    step either way, with the rows laid out on lists (at most PYTHON_LAYOUT_ROWS) or numpy."""
    monkeypatch.setattr(step_cache, "SMALL_COPY_SLOTS", small_copy_slots)
    monkeypatch.setattr(step_cache, "PYTHON_LAYOUT_ROWS", layout_rows)
    monkeypatch.setattr(step_cache, "native_cache_moves", request.getfixturevalue("compiled_cache_moves") if compiled_moves else None)
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[5, 6, 7, 8, 9, 10]])
    one, eight = np.zeros(1, dtype=np.int64), np.zeros(8, dtype=np.int64)
    calls = [(one, np.array([-1]), np.array([1]))] + [(one, np.array([0]), np.array([20 + step])) for step in range(5)]  # slots 0..5
    calls += [(eight, np.zeros(8, dtype=np.int64), np.arange(30, 38))]  # 8 beams from one row: slot 6 differs
    calls += [(eight, np.arange(8), np.arange(40, 48) + 8 * step) for step in range(3)]  # slots 7..9
    copied = [ort_step.cache.slots_copied]
    reordered = (eight, np.array([0, 0, 2, 2, 4, 4, 6, 6]), np.arange(70, 78))  # rows 1, 3, 5, 7 take 0, 2, 4, 6
    swapped = (eight, np.array([1, 0, 2, 3, 4, 5, 6, 7]), np.arange(80, 88))  # rows 0 and 1 trade places
    for call in [*calls, reordered, swapped]:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        copied.append(ort_step.cache.slots_copied)
    steps = np.diff(copied).tolist()
    assert steps[6] == 7 * 6  # the fan-out: each new beam copies the first row's 6 slots
    # Slots 6..9 (0..5 are shared), then only the last written slot; or every used slot.
    assert steps[-2] == (4 * 10 if small_copy_slots and not compiled_moves else 4 * 4)
    assert steps[-1] == (2 * 11 if small_copy_slots else 2 * 1)


def test_export_cross_attention_reads_each_source_once_as_rows_come_and_go(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """Beams of unequal width share a source's cross K/V; a source leaving, one joining and rows moving keep torch's results."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14], [15, 16]])
    calls = [
        (np.array([0, 0, 0, 1, 2, 2]), np.full(6, -1), np.array([1, 1, 1, 1, 1, 1])),
        (np.array([0, 0, 0, 1, 2, 2]), np.array([0, 0, 2, 3, 5, 4]), np.array([20, 21, 22, 23, 24, 25])),
        (np.array([2, 1, 2, 3]), np.array([4, 3, 5, -1]), np.array([26, 27, 28, 1])),  # source 0 left, 3 joined
        (np.array([3, 1, 2, 3, 3]), np.array([3, 1, 2, 3, 3]), np.array([29, 30, 31, 32, 33])),
    ]
    expected_sources = [3, 3, 3, 3]
    copied = []
    for call, count in zip(calls, expected_sources, strict=True):
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        assert ort_step.cache.sources == count
        copied.append(ort_step.cache.sources_copied)
    # Each source's K/V are copied once: sources 1 and 2 keep their places as rows move and source 0
    # leaves; source 3 takes source 0's place.
    assert copied == [3, 3, 4, 4]
    assert ort_step.cache.positions.tolist() == [2, 4, 4, 2, 2]


def test_step_cache_source_absent_while_buffers_narrow_is_copied_again(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """A 40-token source in the third place sits out a call whose only long source has 20 tokens (the wide group
    narrows to 32 columns and cuts its K/V, its place keeps its key); when its rows come back it is copied whole
    again, so torch's log-probs hold. A call of short sources alone leaves the idle wide group as it is."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[11, 12], list(range(50, 70)), list(range(5, 45))])
    calls = [
        (np.array([0, 1, 2]), np.full(3, -1), np.array([1, 1, 1])),
        (np.array([0]), np.array([0]), np.array([20])),  # short sources only: the wide group is idle and kept
        (np.array([1]), np.array([-1]), np.array([1])),  # one 20-token source (a new row): the wide group narrows
        (np.array([0, 1, 2]), np.array([-1, 0, -1]), np.array([1, 22, 1])),  # the long source is read again
    ]
    widths = []
    for call in calls:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        widths.append(ort_step.cache.wide.width)
    assert widths == [48, 48, 32, 48]  # 40 tokens and EOS rounded up; 20 and EOS rounded up


@pytest.mark.parametrize("dummy_places", [False, True])
def test_step_cache_groups_short_and_long_sources(fp32_dir: Path, tiny_checkpoint: Path, dummy_places: bool) -> None:
    """Sources of at most 16 tokens are read from the narrow group, the others from the wide one; a group no row reads
    binds nothing on the CPU, or one dummy place (as on other execution providers). torch's log-probs hold either way,
    with only short sources, both kinds, and only a long one."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [[11, 12], list(range(5, 45)), [13]])
    ort_step.cache.dummy_places = dummy_places
    calls = [
        (np.array([0, 2]), np.full(2, -1), np.array([1, 1])),
        (np.array([0, 1, 2]), np.array([0, -1, 1]), np.array([20, 1, 21])),
        (np.array([1]), np.array([1]), np.array([22])),
    ]
    bound = []
    for call in calls:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        cache = ort_step.cache
        assert cache.narrow.width == NARROW_SOURCE_WIDTH and cache.sources == len(set(call[0].tolist()))
        bound.append((cache.narrow.bound, cache.wide.bound))
    assert bound == ([(2, 1), (2, 1), (1, 1)] if dummy_places else [(2, 0), (2, 1), (0, 1)])


def test_step_cache_narrows_once_a_whole_width_multiple_is_unused(fp32_dir: Path, tiny_checkpoint: Path) -> None:
    """After the 40-token source's rows leave, the 20-token one needs 32 of the 48 columns: the buffers narrow
    to 32 at once (cross-attention reads every bound column), and torch's log-probs hold across the change."""
    torch_step, ort_step = begin_both(fp32_dir, tiny_checkpoint, [list(range(5, 45)), list(range(50, 70))])
    calls = [
        (np.array([0, 1]), np.full(2, -1), np.array([1, 1])),
        (np.array([1]), np.array([1]), np.array([30])),  # the long source's row has left
        (np.array([1]), np.array([0]), np.array([31])),
    ]
    widths = []
    for call in calls:
        np.testing.assert_allclose(ort_step(*call), torch_step(*call), atol=1e-4)
        widths.append(ort_step.cache.wide.width)
    assert widths == [48, 32, 32]


@pytest.mark.parametrize(("width", "needed", "spare", "fitted"), [
    (48, 21, source_group.SOURCE_WIDTH_MULTIPLE, 32),  # the step cache: 16 columns free are enough
    (48, 21, None, 48),  # the engine's pool: it waits for half the width
    (48, 10, None, 16),
    (48, 41, source_group.SOURCE_WIDTH_MULTIPLE, 48),
    (32, 10, source_group.SOURCE_WIDTH_MULTIPLE, source_group.MIN_SOURCE_WIDTH),
    (16, 40, None, 48),  # grown to fit, rounded up
])  # fmt: skip
def test_fitted_width_narrows_when_the_spare_columns_are_unused(width: int, needed: int, spare: int | None, fitted: int) -> None:
    assert source_group.fitted_width(width, needed, spare) == fitted


def test_export_decoder_extends_the_cache_in_place(fp32_dir: Path) -> None:
    """Fused attention, no cache copies in the graph; a step writes one slot per row into the bound buffers."""
    nodes = onnx.load(str(fp32_dir / "decoder.onnx")).graph.node
    assert {"GroupQueryAttention", "MultiHeadAttention"} <= {node.op_type for node in nodes}
    # The only Concat joins the two source groups' cross-attention results (rows x d_model), never a cache.
    assert all(node.name.endswith(".cross_attn_both") for node in nodes if node.op_type == "Concat")
    ort_step = OrtStep(fp32_dir)
    ort_step.begin([[5, 6, 7], [8, 9]])
    ort_step(np.array([0, 1]), np.array([-1, -1]), np.array([1, 1]))
    buffers = list(ort_step.cache._self_kv)
    before = [buffer.copy() for buffer in buffers]
    ort_step(np.array([0, 1]), np.array([0, 1]), np.array([20, 21]))
    for buffer, old in zip(ort_step.cache._self_kv, before, strict=True):
        assert buffer is buffers.pop(0)  # the same memory, not a new present
        assert np.array_equal(buffer[:2, :, :1], old[:2, :, :1])  # slot 0 kept
        assert np.abs(buffer[:2, :, 1]).sum() > 0 and not old[:2, :, 1].any()  # slot 1 written by the step


def test_export_decoder_returns_the_asked_rows_best_candidates(fp32_dir: Path) -> None:
    """The in-graph TopK equals a stable sort of log_probs for the rows asked, and asks for nothing when none are named."""
    ort_step = OrtStep(fp32_dir)
    ort_step.begin([[5, 6, 7], [8, 9]])
    cache = ort_step.cache
    sources = np.array([0, 1, 1, 0])
    cache.arrange(np.full(4, -1), np.array([1, 1, 1, 1]), sources, sources, ort_step.cross, ort_step.src_mask, np.array([3, 1]), 5)
    log_probs = cache.run()
    values, ids = cache.candidates()
    expected_ids = np.argsort(-log_probs[[3, 1]], axis=1, kind="stable")[:, :5]
    assert ids.tolist() == expected_ids.tolist()
    assert np.array_equal(values, np.take_along_axis(log_probs[[3, 1]], expected_ids, axis=1))
    assert cache.first_candidates(2) == (values.ravel().tolist(), ids.ravel().tolist(), 5)
    assert cache.first_candidates(1) == (values[0].tolist(), ids[0].tolist(), 5)
    cache.arrange(np.arange(4), np.array([9, 9, 9, 9]), sources, sources, ort_step.cross, ort_step.src_mask)
    cache.run()
    assert [part.shape for part in cache.candidates()] == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="candidate_count must be between 1 and"):
        cache.arrange(np.arange(4), np.array([9, 9, 9, 9]), sources, sources, ort_step.cross, ort_step.src_mask, np.array([0]), 100)


def test_a_call_laid_out_from_lists_equals_one_laid_out_from_arrays(fp32_dir: Path) -> None:
    """`arrange` takes lists for a few rows (the engine's beams) as it takes arrays: the same rows continued, moved and
    new, the same sources and candidates give the same log-probs, candidates and positions, step after step, also once
    the row buffers have grown."""
    runs = {}
    for kind in (np.array, list):
        ort_step = OrtStep(fp32_dir)
        ort_step.begin([[5, 6, 7], [8, 9]])
        cache = ort_step.cache
        results = []
        layouts = [([-1, -1, -1], [1, 1, 1], [0, 1, 1]), ([0, 0, 2, 1], [4, 5, 6, 7], [0, 0, 1, 1]),
                   ([0, 1, 2, 3], [8, 9, 10, 11], [0, 0, 1, 1]), ([3, 2, 2], [12, 13, 14], [1, 1, 1]),
                   ([0, 1, 2, *[-1] * 7], list(range(15, 25)), [1, 1, 1, 0, 0, 0, 0, 1, 1, 1])]  # past the first buffers' rows  # fmt: skip
        for parents, tokens, sources in layouts:
            cache.arrange(kind(parents), kind(tokens), kind(sources), kind(sources), ort_step.cross, ort_step.src_mask,
                          kind(list(range(len(parents)))), 3)  # fmt: skip
            results.append((cache.run().copy(), *(part.copy() for part in cache.candidates()), cache.positions.copy()))
        runs[kind] = results
    for from_arrays, from_lists in zip(runs[np.array], runs[list], strict=True):
        for array_part, list_part in zip(from_arrays, from_lists, strict=True):
            assert np.array_equal(array_part, list_part)


def test_export_variant_is_converted_and_has_parity_report(variant_dir: Path) -> None:
    manifest = load_model_dir(variant_dir)
    graph = onnx.load(str(variant_dir / "decoder.onnx")).graph
    if manifest.precision == "int8":
        assert any(node.op_type in {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"} for node in graph.node)
    else:
        assert manifest.precision == "fp16"
        assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in graph.initializer)
        # fp32 in and out, so the caller never handles fp16 (token ids stay int64)
        assert {spec.dtype for spec in manifest.graph("decoder").outputs if spec.name != "candidate_ids"} == {"float32"}
    # int8: every integer product is exact on any x86 CPU (tests/test_int8.py), so the difference from
    # fp32 is the quantization error of 7-bit weights and 8-bit activations on this model, the same on
    # every CPU but where fp32 rounding moves an activation across a quantization step: 0.106 measured,
    # bound at 0.25. Kernels that saturate (8-bit u8s8 without VNNI) gave 1.2 here. fp16: rounding of
    # 11-bit mantissas, 5e-3 measured, bound at 0.1.
    bound = 0.25 if manifest.precision == "int8" else 0.1
    assert manifest.parity["tensors"]["max_abs_log_prob_diff"] < bound
    search = manifest.parity["search"]
    assert {"greedy", "beam4"} <= set(search)
    assert 0.0 <= search["greedy"]["identical_ratio"] <= 1.0


@pytest.mark.parametrize("variant_dir", ["fp16"], indirect=True)
def test_fp16_export_keeps_the_cached_self_attention_in_fp32(variant_dir: Path) -> None:
    """ONNX Runtime's fp16 CUDA GroupQueryAttention parted from the CPU over a host-bound cache (export/optimize.py):
    in an fp16 dir every such node reads its query cast up to fp32 and the fp32 cache inputs as they come, writes the
    fp32 cache outputs directly, and its attention output is cast back down."""
    assert load_model_dir(variant_dir).precision == "fp16"
    graph = onnx.load(str(variant_dir / "decoder.onnx")).graph
    producers, consumers = writers(graph), readers(graph)
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert attention
    fp32_inputs = {v.name for v in graph.input if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    fp32_outputs = {v.name for v in graph.output if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    for node in attention:
        cast = producers[node.input[0]]  # the packed QKV
        assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT, node.name
        assert {node.input[3], node.input[4]} <= fp32_inputs  # past K and V, no fp16 round trip
        assert {node.output[1], node.output[2]} <= fp32_outputs  # present K and V
        assert [(c.op_type, c.attribute[0].i) for c in consumers[node.output[0]]] == [("Cast", onnx.TensorProto.FLOAT16)], node.name
    onnx.checker.check_model(onnx.load(str(variant_dir / "decoder.onnx")))


def copy_dir(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def test_model_dir_corrupted_onnx_named(fp32_dir: Path, tmp_path: Path) -> None:
    broken = copy_dir(fp32_dir, tmp_path)
    data = bytearray((broken / "decoder.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / "decoder.onnx").write_bytes(bytes(data))
    with pytest.raises(ModelDirError, match="decoder.onnx: sha256 mismatch"):
        OrtStep(broken)


def test_model_dir_unloadable_onnx_named_even_with_matching_hash(fp32_dir: Path, tmp_path: Path) -> None:
    """A garbage file whose hash was (wrongly) updated still fails with the file's name."""
    broken = copy_dir(fp32_dir, tmp_path)
    (broken / "encoder.onnx").write_bytes(b"not an onnx model")
    manifest = json.loads((broken / "manifest.json").read_text())
    from nmt_serve.runtime.manifest import sha256_file

    manifest["files"]["encoder.onnx"] = sha256_file(broken / "encoder.onnx")
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="encoder.onnx: onnxruntime cannot load it"):
        OrtStep(broken)


def test_model_dir_manifest_hash_mismatch_named(fp32_dir: Path, tmp_path: Path) -> None:
    broken = copy_dir(fp32_dir, tmp_path)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = "0" * 64
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match="tokenizer.json: sha256 mismatch"):
        load_model_dir(broken)


def test_model_dir_missing_file_named(fp32_dir: Path, tmp_path: Path) -> None:
    broken = copy_dir(fp32_dir, tmp_path)
    (broken / "encoder.onnx").unlink()
    with pytest.raises(ModelDirError, match="encoder.onnx: missing"):
        load_model_dir(broken)


def test_parity_reports_random_sentences_without_a_test_file(fp32_dir: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    target = copy_dir(fp32_dir, tmp_path)
    report = run_parity(target, tiny_checkpoint)
    assert report["search"]["greedy"]["identical_ratio"] == 1.0
    assert load_model_dir(target).parity == json.loads(json.dumps(report))
