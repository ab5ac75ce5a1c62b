"""nmt-serve's start-up self-check: passes and is reported (GetModelInfo, metrics); beyond the bound it refuses, unless told to warn."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.runtime.manifest import load_model_dir, write_manifest
from nmt_serve.runtime.self_check import SELF_CHECK_FILE
from nmt_serve.server.main import main as serve_main
from tests.serving import RunningServer, scrape, server_settings, total


def shifted_copy(model_dir: Path, tmp_path: Path, shift: float) -> Path:
    """A copy whose reference's first log-prob is moved by `shift`, hashes made to match (a host that differs by it)."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    reference = json.loads((copy / SELF_CHECK_FILE).read_text(encoding="utf-8"))
    reference["sentences"][0]["log_probs"][0] += shift
    (copy / SELF_CHECK_FILE).write_text(json.dumps(reference), encoding="utf-8")
    manifest = load_model_dir(copy, verify_hashes=False)
    write_manifest(copy, dataclasses.replace(manifest, files={}), list(manifest.files))
    return copy


def test_serve_self_check_reported_in_model_info_and_metrics(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir)) as running:
        channel, stub = running.stub()
        with channel:
            check = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).host_check
        samples = scrape(running.server.metrics_port)
    # The exporting host itself, one thread against the export's default: fp32 rounding only (1e-4, as every fp32 parity test)
    assert check.checked and check.bound == 1e-3 and 0.0 <= check.max_log_prob_diff <= 1e-4
    assert check.exported_on == check.checked_on != ""
    model = (("model", running.server.runtime.manifest.model_name),)
    assert samples[("nmt_self_check_max_log_prob_diff", model)] == pytest.approx(check.max_log_prob_diff)
    assert samples[("nmt_self_check_bound", model)] == 1e-3


def test_serve_refuses_a_host_beyond_the_bound_naming_file_and_figure(tiny_model_dir: Path, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    doctored = shifted_copy(tiny_model_dir, tmp_path, 0.01)
    with caplog.at_level(logging.ERROR):
        assert serve_main([str(doctored), "--port", "0", "--metrics-port", "-1", "--threads", "1"]) == 1
    message = caplog.text
    # 0.01 moved, give or take this host's fp32 rounding (at most 1e-4)
    assert re.search(re.escape(f"{doctored / SELF_CHECK_FILE}: max |log-prob diff| ") + r"(9\.9\de-03|1\.0\de-02) over", message)
    assert "BEYOND the bound 0.001" in message and "--self-check warn serves anyway" in message


def test_serve_self_check_warn_serves_and_reports_the_failure(tiny_model_dir: Path, tmp_path: Path) -> None:
    doctored = shifted_copy(tiny_model_dir, tmp_path, 0.01)
    with RunningServer(server_settings(doctored, self_check="warn")) as running:
        channel, stub = running.stub()
        with channel:
            check = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).host_check
            assert stub.Translate(pb.TranslateRequest(texts=["ich sehe den hund."]), timeout=20).translations[0].hypotheses
    assert check.checked and check.max_log_prob_diff == pytest.approx(0.01, abs=1e-4) and check.max_log_prob_diff > check.bound


def test_serve_self_check_off_and_missing_reference_are_not_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "no-reference"
    shutil.copytree(tiny_model_dir, copy)
    manifest = load_model_dir(copy)
    write_manifest(copy, dataclasses.replace(manifest, files={}), [name for name in manifest.files if name != SELF_CHECK_FILE])
    (copy / SELF_CHECK_FILE).unlink()
    for model_dir, mode in ((copy, "refuse"), (tiny_model_dir, "off")):
        with RunningServer(server_settings(model_dir, self_check=mode)) as running:
            channel, stub = running.stub()
            with channel:
                assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).host_check.checked
            assert total(scrape(running.server.metrics_port), "nmt_self_check_max_log_prob_diff") == -1


def test_serve_self_check_mode_validated() -> None:
    with pytest.raises(ValueError, match="--self-check must be one of refuse, warn, off, got 'maybe'"):
        server_settings(Path("unused"), self_check="maybe").validate()


def test_serve_refusing_an_eight_bit_signed_int8_dir_says_which_cpus_it_needs(tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A u8s8-rows-vnni dir whose host differs beyond the int8 bound (as one without VNNI would, its 16-bit lanes
    saturating): the refusal names the scheme, the CPUs it is exact on and the scheme to serve instead."""
    from nmt_serve.export.onnx_export import main as export_main

    exported = tmp_path / "onnx-int8-vnni"
    assert export_main([str(tiny_checkpoint), "--out", str(exported), "--precision", "int8", "--int8-scheme", "u8s8-rows-vnni", "--no-parity"]) == 0
    assert load_model_dir(exported).created_by["int8_scheme"] == "u8s8-rows-vnni"
    doctored = shifted_copy(exported, tmp_path, 0.5)
    with caplog.at_level(logging.ERROR):
        assert serve_main([str(doctored), "--port", "0", "--metrics-port", "-1", "--threads", "1"]) == 1
    assert "BEYOND the bound 0.05" in caplog.text
    advice = ("its int8 scheme u8s8-rows-vnni has 8-bit signed weights, exact only on CPUs with VNNI or AMX: serve an export made "
              "with --int8-scheme u8s8-rows (7-bit weights, exact on every x86 CPU) here")
    assert advice in caplog.text
    # The same line from the check by hand (nmt-parity MODEL_DIR), which reads the same result.
    from nmt_serve.export.parity_command import main as parity_main

    capsys.readouterr()
    assert parity_main([str(doctored)]) == 1
    assert advice in capsys.readouterr().out


def test_serve_refusing_a_seven_bit_int8_dir_gives_no_kernel_advice(int8_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doctored = shifted_copy(int8_dir, tmp_path, 0.5)
    with caplog.at_level(logging.ERROR):
        assert serve_main([str(doctored), "--port", "0", "--metrics-port", "-1", "--threads", "1"]) == 1
    assert "BEYOND the bound 0.05" in caplog.text and "8-bit signed weights" not in caplog.text
