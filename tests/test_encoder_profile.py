"""nmt-encoder-profile: an encoder call with every fusion against the same call without one, timed and profiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt_serve.bench.encoder_profile import fusions_without, main
from nmt_serve.runtime import native_fusions


def test_report_compares_the_sessions_and_shows_the_fused_nodes(int8_dir: Path, tiny_checkpoint: Path, native_kernels_library: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "encoder.md"
    assert main(["--model-dir", str(int8_dir), "--checkpoint", str(tiny_checkpoint), "--test", str(tmp_path / "absent.tsv"),
                 "--native-kernels", str(native_kernels_library), "--batches", "1,3", "--repeats", "1", "--top", "40",
                 "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text(encoding="utf-8")
    assert "| every fusion | without the encoder attention head layouts | ratio |" in report
    assert "| 1 | " in report and "| 3 | " in report
    profile = report.split("by operator at batch 3", 1)[1]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in profile.splitlines() if line.startswith("| ")}
    assert rows["PackedToHeads"][1].startswith("0.0%") and not rows["PackedToHeads"][0].startswith("0.0%")
    assert rows["Split"][0].startswith("0.0%") and not rows["Split"][1].startswith("0.0%")


def test_the_fusion_left_out_comes_back_and_an_unknown_one_is_refused() -> None:
    every = list(native_fusions.FUSIONS)
    with fusions_without("encoder attention head layouts"):
        assert "encoder attention head layouts" not in native_fusions.FUSIONS
    assert list(native_fusions.FUSIONS) == every
    with pytest.raises(SystemExit, match="--without must name one of the runtime's fusions"), fusions_without("no such fusion"):
        pass
