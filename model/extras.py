"""Console commands that need an optional extra say which one, instead of dying with ModuleNotFoundError."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version


def require_extra(command: str, extra: str, modules: Sequence[str]) -> None:
    """Called at the top of a command's module, before it imports `modules` (a serving install has no torch,
    onnx or sacrebleu). When any is missing: run as `command`, exit 2 with a line naming the extra to
    install; imported from other code, raise ModuleNotFoundError with the same words."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not missing:
        return
    if os.path.basename(sys.argv[0]) == command and "--version" in sys.argv[1:]:  # the version needs no extra
        sys.stdout.write(f"{command} {version('nmt-serve')}\n")
        raise SystemExit(0)
    first = " (torch==2.13.0 first, as make install does)" if "torch" in missing else ""
    message = f"{command} needs {', '.join(missing)}, which this install lacks: pip install 'nmt-serve[{extra}]'{first}"
    if os.path.basename(sys.argv[0]) == command:
        sys.stderr.write(message + "\n")
        raise SystemExit(2)
    raise ModuleNotFoundError(message, name=missing[0])
