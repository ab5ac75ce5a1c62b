"""nmt-quality-report on the tiny checkpoint and its fp32 dir: one row per test set and decoding, sacreBLEU signatures."""

from __future__ import annotations

from pathlib import Path

from nmt_serve.bench.quality_report import main
from nmt_serve.model.corpus import read_tsv


def test_quality_report_scores_every_system_on_every_set(tiny_checkpoint: Path, tiny_model_dir: Path, tiny_corpus: dict[str, Path],
                                                         tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "quality.md"
    assert main([str(tiny_checkpoint), "--model-dir", str(tiny_model_dir), "--test", str(tiny_corpus["test"]),
                 "--test", str(tiny_corpus["valid"]), "--limit", "8", "--out", str(out)]) == 0  # fmt: skip
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| test (8)", "| valid (8)"))]
    assert [row.split(" | ")[1] for row in rows] == ["greedy", "beam4", "greedy", "beam4"]
    # PyTorch and the fp32 dir decode the same tokens (export parity), so their cells agree.
    for row in rows:
        cells = row.strip("| ").split(" | ")[2:]
        assert len(cells) == 2 and cells[0] == cells[1]
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in report and "nc:6|nw:0" in report
    first_source = read_tsv(str(tiny_corpus["test"]))[0][0]
    assert f"| test | {first_source} |" in report
