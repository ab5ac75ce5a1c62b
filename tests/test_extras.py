"""Commands that need an optional extra name it when it is missing."""

from __future__ import annotations

import sys

import pytest

from nmt_serve.model.extras import require_extra


def test_require_extra_passes_when_the_modules_are_there() -> None:
    require_extra("nmt-x", "train", ("json", "numpy"))


def test_require_extra_run_as_the_command_exits_2_naming_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/nmt-x", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        require_extra("nmt-x", "export", ("json", "no_such_module_here", "torch_is_not_this"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("nmt-x needs no_such_module_here, torch_is_not_this, which this install lacks: "
                                       "pip install 'nmt-serve[export]'\n")  # fmt: skip


def test_require_extra_imported_elsewhere_raises_module_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["pytest"])
    with pytest.raises(ModuleNotFoundError, match=r"nmt-x needs no_such_module_here, which this install lacks: pip install 'nmt-serve\[train\]'$"):
        require_extra("nmt-x", "train", ("no_such_module_here",))
