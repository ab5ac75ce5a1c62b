"""Variants of a Hugging Face source dir for the importers' refusal tests, and a refused nmt-import run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def config_variant(source: Path, copy: Path, **config_changes: object) -> Path:
    """A copy of `source` whose config.json has `config_changes` applied."""
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
    config.update(config_changes)
    (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy


def refused_import(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """nmt-import's stderr for `argv` (which writes `out`), after checking it exited 1 and left nothing behind."""
    from nmt_serve.importers.import_command import main as import_main

    assert import_main([*argv, "--out", str(out)]) == 1
    assert not out.exists() and not [path for path in out.parent.iterdir() if ".importing-" in path.name]
    return capsys.readouterr().err
