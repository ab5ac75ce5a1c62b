"""Tests for runtime/manifest.py: writing, loading and refusing model dirs (dummy graph bytes; no ONNX parsed)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nmt_serve.model.config import PRESETS
from nmt_serve.runtime.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    GraphSpec,
    Manifest,
    ModelDirError,
    TensorSpec,
    load_model_dir,
    sha256_file,
    update_parity,
    write_manifest,
)

DUMMY_FILES = {
    "encoder.onnx": b"dummy encoder graph bytes",
    "decoder.onnx": b"dummy decoder graph bytes",
    "tokenizer.json": b'{"model": "dummy"}',
}


def make_manifest(**overrides: Any) -> Manifest:
    config = PRESETS["tiny"]
    layers = range(config.n_decoder_layers)
    kv_shape = ("batch", config.n_heads, "src_len", config.head_dim)
    past_shape = ("batch", config.n_heads, "capacity", config.head_dim)
    cross = tuple(TensorSpec(f"cross_{kv}_{i}", "float32", kv_shape) for i in layers for kv in "kv")
    encoder = GraphSpec(
        file="encoder.onnx",
        inputs=(TensorSpec("src_ids", "int64", ("batch", "src_len")), TensorSpec("src_mask", "bool", ("batch", "src_len"))),
        outputs=cross,
    )
    decoder = GraphSpec(
        file="decoder.onnx",
        inputs=(TensorSpec("tgt_ids", "int64", ("batch", 1)), TensorSpec("positions", "int64", ("batch",)),
                TensorSpec("src_mask", "bool", ("batch", "src_len")),
                *(TensorSpec(f"past_{kv}_{i}", "float32", past_shape) for i in layers for kv in "kv"), *cross),  # fmt: skip
        outputs=(TensorSpec("log_probs", "float32", ("batch", config.vocab_size)),
                 *(TensorSpec(f"present_{kv}_{i}", "float32", past_shape) for i in layers for kv in "kv")),  # fmt: skip
    )
    values: dict[str, Any] = dict(model_name="tiny-de-en", model_version="2024.1", config=config, precision="fp32", opset=18,
                                  graphs={"encoder": encoder, "decoder": decoder}, created_by={"nmt-serve": "0.1.0"})  # fmt: skip
    values.update(overrides)
    return Manifest(**values)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    for name, content in DUMMY_FILES.items():
        (directory / name).write_bytes(content)
    write_manifest(directory, make_manifest(), sorted(DUMMY_FILES))
    return directory


def edit_manifest(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change manifest.json in place, as a hand edit or a buggy exporter would."""
    path = directory / MANIFEST_FILE
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw, indent=2))


def flip_byte(path: Path, index: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def test_write_manifest_round_trips_through_load(model_dir: Path) -> None:
    written = write_manifest(model_dir, make_manifest(), sorted(DUMMY_FILES))
    assert written.files == {name: hashlib.sha256(content).hexdigest() for name, content in DUMMY_FILES.items()}
    assert load_model_dir(model_dir) == written
    assert written.format_version == FORMAT_VERSION


def test_write_manifest_writes_special_ids_explicitly(model_dir: Path) -> None:
    raw = json.loads((model_dir / MANIFEST_FILE).read_text())
    assert raw["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert raw["graphs"]["decoder"]["inputs"][0] == {"name": "tgt_ids", "dtype": "int64", "shape": ["batch", 1]}


def test_write_manifest_leaves_no_temp_files(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == sorted([*DUMMY_FILES, MANIFEST_FILE])


def test_write_manifest_refuses_missing_file_and_unlisted_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "encoder.onnx").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="decoder.onnx: missing"):
        write_manifest(tmp_path, make_manifest(), ["encoder.onnx", "decoder.onnx"])
    (tmp_path / "decoder.onnx").write_bytes(b"y")
    with pytest.raises(ModelDirError, match="files: tokenizer.json not listed"):
        write_manifest(tmp_path, make_manifest(), ["encoder.onnx", "decoder.onnx"])
    assert not (tmp_path / MANIFEST_FILE).exists()


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "./encoder.onnx", MANIFEST_FILE])
def test_write_manifest_refuses_names_outside_the_dir(model_dir: Path, name: str) -> None:
    with pytest.raises(ModelDirError, match="files: .* (not a plain relative path|must not be listed)"):
        write_manifest(model_dir, make_manifest(), [*DUMMY_FILES, name])


def test_manifest_to_dict_from_dict_round_trip() -> None:
    manifest = make_manifest(files={name: hashlib.sha256(c).hexdigest() for name, c in DUMMY_FILES.items()},
                             parity={"max_abs_diff": 1e-5, "greedy_identical": True})  # fmt: skip
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda raw: raw.update(opset="18"), r"opset: expected integer, got string"),
        (lambda raw: raw.update(model_name=""), r"model_name must not be empty"),
        (lambda raw: raw["config"].pop("d_model"), r"config\.d_model missing"),
        (lambda raw: raw["config"].update(n_heads=True), r"config\.n_heads: expected integer, got boolean"),
        (lambda raw: raw["config"].update(banned_ids=[None]), r"config\.banned_ids\[0\]: expected integer, got null"),
        (lambda raw: raw["config"].update(banned_ids=5), r"config\.banned_ids: expected array, got integer"),
        (lambda raw: raw["special_ids"].update(eos=5), r"special_ids\.eos 5 does not match config\.eos_id 2"),
        (lambda raw: raw["graphs"]["encoder"]["inputs"][0].update(dtype="int65"), r"graphs\.encoder\.inputs\[0\]\.dtype 'int65'"),
        (lambda raw: raw["graphs"]["decoder"]["outputs"][0].update(shape=["batch", -1]), r"graphs\.decoder\.outputs\[0\]\.shape\[1\]"),
        (lambda raw: raw["graphs"]["decoder"].update(outputs=[]), r"graphs\.decoder\.outputs: must not be empty"),
        (lambda raw: raw.update(colour="blue"), r"colour: unknown field"),
        (lambda raw: raw["files"].update({"encoder.onnx": "abc"}), r"files\.encoder\.onnx: expected a lowercase sha256"),
    ],
)
def test_manifest_from_dict_names_the_bad_field(edit: Callable[[dict[str, Any]], None], match: str) -> None:
    raw = json.loads(json.dumps(make_manifest(files={name: "0" * 64 for name in DUMMY_FILES}).to_dict()))
    edit(raw)
    with pytest.raises(ValueError, match=match):
        Manifest.from_dict(raw)


def test_manifest_accessors_name_graph_files_and_tensors(model_dir: Path) -> None:
    manifest = load_model_dir(model_dir)
    assert manifest.graph_path(model_dir, "decoder") == model_dir / "decoder.onnx"
    assert manifest.input_names("encoder") == ("src_ids", "src_mask")
    assert manifest.output_names("decoder")[0] == "log_probs"
    with pytest.raises(KeyError, match="no graph 'joiner'"):
        manifest.input_names("joiner")


def test_sha256_file_matches_hashlib_across_chunks(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 5)
    assert sha256_file(path, chunk_bytes=100) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_load_model_dir_refuses_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"model dir .*nowhere: does not exist"):
        load_model_dir(tmp_path / "nowhere")


def test_load_model_dir_refuses_missing_manifest(model_dir: Path) -> None:
    (model_dir / MANIFEST_FILE).unlink()
    with pytest.raises(ModelDirError, match=r"manifest\.json: missing"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_invalid_json(model_dir: Path) -> None:
    (model_dir / MANIFEST_FILE).write_text('{\n  "format_version": 2,\n  "model_name": oops\n}\n')
    with pytest.raises(ModelDirError, match=r"manifest\.json: not valid JSON \(line 3"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_wrong_format_version(model_dir: Path) -> None:
    edit_manifest(model_dir, lambda raw: raw.update(format_version=7))
    with pytest.raises(ModelDirError, match=r"manifest\.json: format_version 7 not supported \(this server reads 5\); write the model dir "
                                            r"again with nmt-export from its checkpoint$"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_unknown_precision(model_dir: Path) -> None:
    edit_manifest(model_dir, lambda raw: raw.update(precision="fp8"))
    with pytest.raises(ModelDirError, match=r"manifest\.json: precision 'fp8' not one of fp32, fp16, int8"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_missing_graph(model_dir: Path) -> None:
    edit_manifest(model_dir, lambda raw: raw["graphs"].pop("decoder"))
    with pytest.raises(ModelDirError, match=r"manifest\.json: graphs\.decoder missing"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_graph_and_tokenizer_not_listed(model_dir: Path) -> None:
    def unlist(raw: dict[str, Any]) -> None:
        del raw["files"]["decoder.onnx"], raw["files"]["tokenizer.json"]

    edit_manifest(model_dir, unlist)
    with pytest.raises(ModelDirError, match=r"graphs\.decoder\.file 'decoder\.onnx' not listed in files; .*tokenizer\.json not listed"):
        load_model_dir(model_dir)


def test_load_model_dir_names_missing_file(model_dir: Path) -> None:
    (model_dir / "encoder.onnx").unlink()
    with pytest.raises(ModelDirError, match=r"model dir .*: encoder\.onnx: missing$"):
        load_model_dir(model_dir)


def test_load_model_dir_names_corrupted_file(model_dir: Path) -> None:
    expected = hashlib.sha256(DUMMY_FILES["decoder.onnx"]).hexdigest()
    flip_byte(model_dir / "decoder.onnx")
    actual = sha256_file(model_dir / "decoder.onnx")
    with pytest.raises(ModelDirError, match=rf"decoder\.onnx: sha256 mismatch \(manifest {expected[:12]}\.\.\., file {actual[:12]}\.\.\.\)"):
        load_model_dir(model_dir)


def test_load_model_dir_reports_several_problems_together(model_dir: Path) -> None:
    edit_manifest(model_dir, lambda raw: raw.update(precision="fp8", opset=0))
    (model_dir / "encoder.onnx").unlink()
    flip_byte(model_dir / "tokenizer.json")
    with pytest.raises(ModelDirError) as caught:
        load_model_dir(model_dir)
    problems = caught.value.problems
    assert len(problems) == 4, problems
    assert problems[:2] == ("manifest.json: precision 'fp8' not one of fp32, fp16, int8", "manifest.json: opset must be >= 1, got 0")
    assert problems[2] == "encoder.onnx: missing"
    assert problems[3].startswith("tokenizer.json: sha256 mismatch")
    assert all(problem in str(caught.value) for problem in problems)


def test_load_model_dir_without_verify_skips_hashing_but_checks_presence(model_dir: Path) -> None:
    flip_byte(model_dir / "decoder.onnx")
    assert load_model_dir(model_dir, verify_hashes=False).model_name == "tiny-de-en"
    (model_dir / "encoder.onnx").unlink()
    with pytest.raises(ModelDirError, match=r"encoder\.onnx: missing$"):
        load_model_dir(model_dir, verify_hashes=False)


def test_update_parity_keeps_hashes_valid(model_dir: Path) -> None:
    before = load_model_dir(model_dir)
    report = {"max_abs_diff": 2.5e-6, "greedy_identical": True, "cases": [1, 2]}
    updated = update_parity(model_dir, report)
    assert updated.parity == report
    assert updated.files == before.files
    assert load_model_dir(model_dir) == updated  # hashes still verify


def test_manifest_module_imports_without_torch_or_onnx() -> None:
    # The server image carries neither; a stray import here would break it only in deployment.
    code = "import sys, runtime.manifest; bad = {'torch', 'onnx', 'onnxruntime'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
