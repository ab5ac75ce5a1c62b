"""Import rules (docs/architecture.md): one-way data flow, and a serving path free of torch and onnx."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "export", "server", "client", "bench")
# package -> top-level packages it must never import
FORBIDDEN = {
    "model": {"export", "server", "client", "bench"},
    "export": {"server", "client", "bench"},
    "server": {"client", "bench", "torch", "onnx", "onnxscript"},
    "client": {"server", "bench", "torch", "onnx", "onnxscript"},
}
# Modules the torch-free server may share.
TORCH_FREE_MODULES = ["model.config", "model.tokenizer", "model.search", "model.padding", "export.manifest", "export.ort_step",
                      "server.main", "client.cli"]  # fmt: skip


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_follow_the_one_way_rules(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_shared_modules_load_without_torch_or_onnx(module: str) -> None:
    code = f"import sys, {module}; print(sorted({{'torch', 'onnx'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", f"{module} pulls in {result.stdout.strip()}"
