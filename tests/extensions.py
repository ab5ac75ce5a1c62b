"""The engine's host-work extensions (runtime/build_extensions.py) built in the test session and loaded from there."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

from nmt_serve.runtime.build_extensions import EXTENSIONS, build_extension


def compiled_extension(name: str, directory: Path) -> object:
    """The host-work extension `name` (runtime/build_extensions.py EXTENSIONS: "beam_select", "cache_moves", "greedy_step",
    "beam_step", "float_mode")
    built in this session into `directory` and loaded from there; skipped, with the reason, where it cannot be compiled."""
    extension = next(extension for extension in EXTENSIONS if extension.module.name.startswith(f"_{name}"))
    built = build_extension(extension, out=directory / extension.module.name)
    if built is None:
        pytest.skip(f"{extension.what} not compilable here: no Python headers or no compiler (the build logged which)")
    loader = importlib.machinery.ExtensionFileLoader(f"_{name}", str(built))
    spec = importlib.util.spec_from_file_location(f"_{name}", str(built), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
