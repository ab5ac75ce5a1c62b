"""The host self-check: the reference nmt-export writes, its re-check by nmt-parity, and refusals that name the file."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nmt_serve.export.parity_command import main as parity_main
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.host import INT8_FEATURES, cpu_facts, describe_cpu
from nmt_serve.runtime.manifest import load_model_dir, write_manifest
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import (
    SELF_CHECK_BOUNDS,
    SELF_CHECK_FILE,
    SELF_CHECK_SENTENCES,
    SelfCheckError,
    check_host,
    forced_log_probs,
    load_reference,  # fmt: skip
)


def reference_of(model_dir: Path) -> dict:
    return json.loads((model_dir / SELF_CHECK_FILE).read_text(encoding="utf-8"))


def with_reference(model_dir: Path, tmp_path: Path, change) -> Path:
    """A copy of `model_dir` whose reference `change` edits, with the manifest's hashes made to match."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    reference = reference_of(copy)
    change(reference)
    (copy / SELF_CHECK_FILE).write_text(json.dumps(reference), encoding="utf-8")
    manifest = load_model_dir(copy, verify_hashes=False)
    write_manifest(copy, dataclasses.replace(manifest, files={}), list(manifest.files))
    return copy


def test_export_writes_a_self_check_reference_listed_in_the_manifest(tiny_model_dir: Path) -> None:
    manifest = load_model_dir(tiny_model_dir)
    assert SELF_CHECK_FILE in manifest.files
    reference = reference_of(tiny_model_dir)
    assert reference["precision"] == "fp32" and reference["bound"] == SELF_CHECK_BOUNDS["fp32"]
    assert reference["cpu"] == cpu_facts()
    assert len(reference["sentences"]) == SELF_CHECK_SENTENCES
    for sentence in reference["sentences"]:
        assert len(sentence["log_probs"]) == len(sentence["target_ids"]) + 1  # each token and EOS
        assert all(value <= 0.0 for value in sentence["log_probs"])


def test_export_parity_report_names_the_cpu(tiny_model_dir: Path) -> None:
    facts = load_model_dir(tiny_model_dir).parity["cpu"]
    assert {"vendor", "model_name", "features"} <= set(facts) <= {"vendor", "model_name", "features", "family", "model"}
    assert set(facts["features"]) <= set(INT8_FEATURES)


def test_cpu_facts_read_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2 avx512f avx512_vnni\n\n"
                       "processor\t: 1\nvendor_id\t: Other\n", encoding="utf-8")  # fmt: skip
    facts = cpu_facts(cpuinfo)
    assert facts == {"vendor": "GenuineIntel", "model_name": "Intel(R) Xeon(R)", "features": ["avx2", "avx512f", "avx512_vnni"]}
    assert describe_cpu(facts) == "Intel(R) Xeon(R) (GenuineIntel; avx2, avx512f, avx512_vnni)"


def test_cpu_facts_name_the_family_and_model(tmp_path: Path) -> None:
    """A brand-only model name ("AMD EPYC", as virtual machines give it) is told apart by its family and model numbers."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
                       "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n\n", encoding="utf-8")  # fmt: skip
    facts = cpu_facts(cpuinfo)
    assert facts["family"] == 25 and facts["model"] == 17
    assert describe_cpu(facts) == "AMD EPYC (AuthenticAMD family 25 model 17; avx2, avx512f, avx512bw, avx512_vnni)"


def test_self_check_forced_log_probs_equal_torch_teacher_forced(tiny_model_dir: Path, tiny_checkpoint: Path) -> None:
    """Each stored token's log-prob is what the PyTorch model gives it after the same prefix (fp32, 1e-4)."""
    sentences = reference_of(tiny_model_dir)["sentences"][:3]
    sources, targets = [s["source_ids"] for s in sentences], [s["target_ids"] for s in sentences]
    step = OrtStep(tiny_model_dir)
    ours = forced_log_probs(step.encode, step.cache, step.config, sources, targets)
    config = step.config
    torch_step = TorchStep(load_checkpoint(tiny_checkpoint).model)
    torch_step.begin(sources)
    rows = np.arange(len(sources))
    fed = [[config.bos_id, *target] for target in targets]
    for position in range(max(map(len, fed))):
        tokens = np.array([row[position] if position < len(row) else config.eos_id for row in fed])
        log_probs = torch_step(rows, np.full(len(rows), -1) if position == 0 else rows, tokens)
        for row, target in enumerate(targets):
            followed = [*target, config.eos_id]
            if position < len(followed):
                assert abs(ours[row][position] - log_probs[row, followed[position]]) <= 1e-4


def test_self_check_passes_on_the_exporting_host(tiny_model_dir: Path) -> None:
    # Another thread count than the export's, on the exporting host: kernels may split their sums otherwise, so fp32
    # rounding only (1e-4, the fp32 parity bound of every other test).
    step = OrtStep(tiny_model_dir, threads=1)
    result = check_host(tiny_model_dir, load_reference(tiny_model_dir, step.config), step.encode, step.cache, step.config)
    assert result.passed and result.max_log_prob_diff <= 1e-4
    assert result.sentences == SELF_CHECK_SENTENCES and result.cpu == describe_cpu(cpu_facts())


def test_nmt_parity_without_checkpoint_checks_this_host(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parity_main([str(tiny_model_dir)]) == 0
    assert "within the bound 0.001" in capsys.readouterr().out


def test_nmt_parity_beyond_the_bound_exits_1_naming_the_file_and_figure(tiny_model_dir: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    def shift(reference: dict) -> None:
        reference["sentences"][2]["log_probs"][0] -= 0.25

    doctored = with_reference(tiny_model_dir, tmp_path, shift)
    assert parity_main([str(doctored)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{doctored / SELF_CHECK_FILE}: max |log-prob diff| 2.50e-01") and "BEYOND the bound 0.001" in out


@pytest.mark.parametrize(("change", "problem"), [
    (lambda reference: reference["sentences"][0]["log_probs"].pop(), "one value per target token and one for EOS"),
    (lambda reference: reference["sentences"][0]["source_ids"].append(10**9), "a token id outside the vocabulary"),
    (lambda reference: reference.pop("bound"), "'bound'"),
    (lambda reference: reference["sentences"].clear(), "no sentences"),
])  # fmt: skip
def test_self_check_unusable_reference_named(tiny_model_dir: Path, tmp_path: Path, change, problem: str) -> None:
    broken = with_reference(tiny_model_dir, tmp_path, change)
    with pytest.raises(SelfCheckError, match=f"{broken / SELF_CHECK_FILE}: unusable self-check reference: .*{problem}"):
        load_reference(broken, load_model_dir(broken).config)


def test_self_check_model_dir_without_reference_has_none(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    (copy / SELF_CHECK_FILE).unlink()
    assert load_reference(copy, load_model_dir(tiny_model_dir).config) is None
