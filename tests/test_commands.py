"""Every console command of pyproject.toml: --version prints the installed package's version; docs/operations.md names those that need an extra."""

from __future__ import annotations

import importlib
import importlib.util
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_command_version_prints_the_package_version(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    module_name, _, attribute = SCRIPTS[command].partition(":")
    main = getattr(importlib.import_module(module_name), attribute)
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"{command} {version('nmt-serve')}\n"


def test_operations_doc_names_every_command_that_needs_an_extra() -> None:
    """docs/operations.md's list of the commands that exit 2 on a serving install is the set whose module calls require_extra."""
    needing = set()
    for command, entry in SCRIPTS.items():
        module = importlib.util.find_spec(entry.partition(":")[0])
        assert module is not None and module.origin is not None, command
        if "require_extra(" in Path(module.origin).read_text(encoding="utf-8"):
            needing.add(command)
    operations = " ".join((ROOT / "docs" / "operations.md").read_text(encoding="utf-8").split())
    listed = operations.split("On such an install the commands of other extras exit 2 with a line naming the extra to install: ", 1)[1]
    listed = listed.split(".", 1)[0]
    assert set(re.findall(r"`(nmt-[a-z0-9-]+)`", listed)) == needing
