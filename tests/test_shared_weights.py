"""A model dir keeps the tensors its two graphs both hold (the tied embedding) once, in shared_weights.bin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import uses_external_data

from nmt_serve.export.optimize import convert_to_int8
from nmt_serve.export.shared_weights import SHARED_WEIGHTS_FILE, share_weights
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.runtime.manifest import ModelDirError, load_model_dir, write_manifest
from nmt_serve.runtime.ort_step import OrtStep

GRAPHS = ("encoder.onnx", "decoder.onnx")


def shared_tensors(path: Path) -> dict[str, list[int]]:
    model = onnx.load(str(path), load_external_data=False)
    return {tensor.name: list(tensor.dims) for tensor in model.graph.initializer if uses_external_data(tensor)}


def inlined_copy(model_dir: Path, out: Path) -> Path:
    """`model_dir` with every graph holding its own weights again (the layout before sharing), manifest rewritten."""
    shutil.copytree(model_dir, out)
    for name in GRAPHS:
        onnx.save(onnx.load(str(model_dir / name)), str(out / name))  # onnx.load reads the external data in
    (out / SHARED_WEIGHTS_FILE).unlink()
    manifest = load_model_dir(model_dir)
    write_manifest(out, manifest, [name for name in manifest.files if name != SHARED_WEIGHTS_FILE])
    return out


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "int8_dir"])
def test_exported_dirs_hold_the_tied_embedding_once(fixture: str, tiny_checkpoint: Path, tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:  # fmt: skip
    model_dir: Path = request.getfixturevalue(fixture)
    config = load_checkpoint(tiny_checkpoint).config
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert len(manifest["files"][SHARED_WEIGHTS_FILE]) == 64
    for name in GRAPHS:
        shared = shared_tensors(model_dir / name)
        assert [config.vocab_size, config.d_model] in shared.values(), (name, shared)
    plain = inlined_copy(model_dir, tmp_path / "plain")
    shared_bytes = sum((model_dir / name).stat().st_size for name in (*GRAPHS, SHARED_WEIGHTS_FILE))
    plain_bytes = sum((plain / name).stat().st_size for name in GRAPHS)
    embedding_bytes = config.vocab_size * config.d_model * (2 if fixture == "tiny_model_dir" else 1)  # fp16 or uint8
    assert plain_bytes - shared_bytes >= 0.9 * embedding_bytes  # less the references each graph keeps and the alignment


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "int8_dir"])
def test_shared_weights_give_the_outputs_of_graphs_holding_their_own(fixture: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    plain = inlined_copy(model_dir, tmp_path / "plain")
    sources = [[5, 9, 14, 7, 2], [11, 6, 2]]
    outputs = []
    for directory in (model_dir, plain):
        step = OrtStep(directory, threads=1)
        step.begin(sources)
        cross = [array.copy() for array in step.cross]
        first = step(np.array([0, 1]), np.array([0, 1]), np.array([1, 1]))
        second = step(np.array([0, 1]), np.array([0, 1]), np.array([first[0].argmax(), first[1].argmax()]))
        outputs.append((cross, first, second))
    (cross_a, *steps_a), (cross_b, *steps_b) = outputs
    assert all(np.array_equal(a, b) for a, b in zip(cross_a, cross_b, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(steps_a, steps_b, strict=True))


def test_int8_from_a_shared_fp32_dir_equals_int8_from_one_holding_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    """nmt-int8-schemes converts a shipped fp32 dir: the shared table is read back in, so the conversion sees what it always saw."""
    plain = inlined_copy(tiny_model_dir, tmp_path / "plain")
    for name in GRAPHS:
        convert_to_int8(tiny_model_dir / name, tmp_path / f"shared-{name}")
        convert_to_int8(plain / name, tmp_path / f"plain-{name}")
        from_shared, from_plain = (onnx.load(str(tmp_path / f"{kind}-{name}")) for kind in ("shared", "plain"))
        assert {t.name: t.raw_data for t in from_shared.graph.initializer} == {t.name: t.raw_data for t in from_plain.graph.initializer}
        assert [node.op_type for node in from_shared.graph.node] == [node.op_type for node in from_plain.graph.node]


def test_a_changed_shared_weights_file_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "dir")
    data = bytearray((model_dir / SHARED_WEIGHTS_FILE).read_bytes())
    data[100] ^= 1
    (model_dir / SHARED_WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelDirError, match=f"{SHARED_WEIGHTS_FILE}: sha256 mismatch"):
        load_model_dir(model_dir)


def test_graphs_with_external_data_of_their_own_are_left_as_they_are(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model past protobuf's 2 GB writes its weights beside each graph; sharing leaves that layout alone."""
    plain = inlined_copy(tiny_model_dir, tmp_path / "plain")
    for name in GRAPHS:
        onnx.save(onnx.load(str(plain / name)), str(plain / name), save_as_external_data=True, location=f"{name}.data", size_threshold=0)
    before = {name: (plain / name).read_bytes() for name in GRAPHS}
    assert share_weights(plain, GRAPHS) == 0
    assert not (plain / SHARED_WEIGHTS_FILE).exists()
    assert {name: (plain / name).read_bytes() for name in GRAPHS} == before


def test_share_weights_shares_only_what_several_graphs_hold(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Written again from graphs holding their own weights, the layout is the exporter's: the same tensors shared, nothing else."""
    plain = inlined_copy(tiny_model_dir, tmp_path / "plain")
    assert share_weights(plain, GRAPHS) > 0
    for name in GRAPHS:
        assert shared_tensors(plain / name) == shared_tensors(tiny_model_dir / name)
    encoder, decoder = (onnx.load(str(plain / name), load_external_data=False) for name in GRAPHS)
    encoder_own = {tensor.raw_data for tensor in encoder.graph.initializer if not uses_external_data(tensor) and len(tensor.raw_data) >= 1024}
    decoder_own = {tensor.raw_data for tensor in decoder.graph.initializer if not uses_external_data(tensor) and len(tensor.raw_data) >= 1024}
    assert not encoder_own & decoder_own


def test_a_file_left_from_graphs_written_before_is_replaced_or_removed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A dir written again: its new graphs point into nothing old, so the old file goes (one graph alone shares nothing)."""
    plain = inlined_copy(tiny_model_dir, tmp_path / "plain")
    (plain / SHARED_WEIGHTS_FILE).write_bytes(b"left from an earlier export")
    assert share_weights(plain, GRAPHS) > 0
    assert (plain / SHARED_WEIGHTS_FILE).read_bytes() == (tiny_model_dir / SHARED_WEIGHTS_FILE).read_bytes()
    alone = inlined_copy(tiny_model_dir, tmp_path / "alone")
    (alone / SHARED_WEIGHTS_FILE).write_bytes(b"left from an earlier export")
    assert share_weights(alone, ("encoder.onnx",)) == 0
    assert not (alone / SHARED_WEIGHTS_FILE).exists()
