"""The shipped Multi30k model: its fp32 and int8 dirs verify, pass this host's self-check, record their parity, and
the int8 one serves beside the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import check_model_dir
from tests.serving import RunningServer, server_settings

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "artifacts" / "de-en-multi30k"
INT8 = CHECKPOINT / "onnx-int8"
MODEL_DIRS = {"fp32": CHECKPOINT / "onnx-fp32", "int8": INT8}
DEFAULT_INT8 = ROOT / "artifacts" / "de-en-small" / "onnx-int8"


@pytest.mark.parametrize("precision", sorted(MODEL_DIRS))
def test_multi30k_dir_verifies_and_passes_the_self_check_here(precision: str) -> None:
    model_dir = MODEL_DIRS[precision]
    manifest = load_model_dir(model_dir)  # every file's sha256 against the manifest
    assert (manifest.model_name, manifest.precision) == ("de-en-multi30k", precision)
    step = OrtStep(model_dir)
    result = check_model_dir(model_dir, step.encode, step.cache, step.config)
    assert result is not None and result.passed and result.batch_diff == 0.0


@pytest.mark.parametrize("precision", sorted(MODEL_DIRS))
def test_multi30k_records_its_parity_and_credits_its_data(precision: str) -> None:
    parity = load_model_dir(MODEL_DIRS[precision]).parity
    assert parity["test"].endswith("multi30k-test_2016_flickr.tsv") and parity["search"]["beam4"]["sentences"] == 1000
    record = json.loads((CHECKPOINT / "train.json").read_text())
    assert "Multi30K" in record["credits"]["multi30k"] and record["legs"]
    assert "Elliott" in (CHECKPOINT / "CREDITS.md").read_text()


def test_multi30k_serves_beside_the_default_model() -> None:
    settings = server_settings(DEFAULT_INT8, more_model_dirs=(INT8,), max_chars_per_text=400)
    with RunningServer(settings) as server:
        channel, stub = server.stub()
        with channel:
            names = {model.name for model in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
            reply = stub.Translate(pb.TranslateRequest(texts=["Ein Hund läuft über eine grüne Wiese."], model="de-en-multi30k"), timeout=30)
    assert names == {"de-en-small", "de-en-multi30k"}
    assert "dog" in reply.translations[0].hypotheses[0].text.lower()
