"""nmt-cross-attention-forms: every form computes the reference's attention, a wrong one is refused, the report holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nmt_serve.bench import cross_attention_forms
from nmt_serve.bench.cross_attention_forms import (
    FORMS,
    NATIVE,
    SHIPPED,
    UNMASKED,
    BoundForm,
    Shape,
    available_forms,
    checked_forms,
    main,
    mha_key_padding,
    random_operands,
    reference,
)

SMALL = Shape(sources=3, queries=2, width=16, heads=2, head_dim=8)


@pytest.mark.parametrize("name", [name for name in FORMS if name != UNMASKED])
def test_each_usable_form_matches_the_reference(name: str) -> None:
    operands = random_operands(SMALL, seed=1)
    assert operands.lengths.min() < SMALL.width  # some padding, so the mask is exercised
    output = BoundForm(FORMS[name], SMALL, operands, threads=1).run()
    np.testing.assert_allclose(output, reference(SMALL, operands), rtol=0, atol=1e-5)


def test_the_unmasked_form_reads_padding() -> None:
    operands = random_operands(SMALL, seed=1)
    unmasked = BoundForm(FORMS[UNMASKED], SMALL, operands, threads=1).run()
    assert np.abs(unmasked - reference(SMALL, operands)).max() > 1e-2


def test_a_form_with_a_wrong_result_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def unscaled(shape: Shape, operands: cross_attention_forms.Operands) -> tuple:
        model, feeds = mha_key_padding(shape, operands)
        return model, {**feeds, "query": feeds["query"] * np.float32(3.0)}  # sharper softmax: other weights

    monkeypatch.setitem(FORMS, "unscaled", unscaled)
    with pytest.raises(RuntimeError, match="unscaled"):
        checked_forms(SMALL, threads=1)


def test_report_has_a_row_per_shape_and_a_ratio_per_form(tmp_path: Path) -> None:
    out = tmp_path / "forms.md"
    argv = ["--sources", "1,2", "--queries", "2", "--widths", "16", "--heads", "2", "--head-dim", "8", "--rounds", "1", "--calls", "2",
            "--evict-mb", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = out.read_text(encoding="utf-8")
    assert "nmt-cross-attention-forms --sources 1,2" in report and "1 MB of other memory" in report
    rows = [line for line in report.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = row.strip("|").split("|")
        assert len(cells) == 3 + len(available_forms())
        assert cells[3].strip().endswith(" us") and "x)" not in cells[3]  # the shipped form: the baseline
        assert all(cell.strip().endswith("x)") for cell in cells[4:])
    assert SHIPPED in report


def test_the_native_form_is_checked_and_runs_the_librarys_kernel(native_kernels_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native attention kernels are built, the shipped form runs on them too, checked against the reference
    (and against ONNX Runtime running its own kernel instead: the library's call count must grow)."""
    monkeypatch.setattr(cross_attention_forms, "DEFAULT_LIBRARY", native_kernels_library)
    forms = checked_forms(SMALL, threads=1)
    assert NATIVE in forms and forms[NATIVE].kernels_library == native_kernels_library


@pytest.mark.parametrize(("argv", "message"), [(["--sources", "0"], "--sources"), (["--widths", "a"], "--widths"),
                                               (["--calls", "0"], "--calls"), (["--evict-mb", "-1"], "--evict-mb")])  # fmt: skip
def test_bad_arguments_name_the_flag(argv: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path / "never.md")])
