"""Import rules (docs/architecture.md): one namespace, one-way data flow, and a serving path free of torch, onnx and export."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "nmt_serve"
PACKAGES = ("model", "export", "runtime", "server", "client", "bench", "protos")
# package -> what it must never import: our packages by name, third-party ones by their top-level name
FORBIDDEN = {
    "model": {"export", "runtime", "server", "client", "bench"},
    "runtime": {"export", "server", "client", "bench", "torch", "onnx", "onnxscript"},
    "export": {"server", "client", "bench"},
    "server": {"export", "client", "bench", "torch", "onnx", "onnxscript"},
    "client": {"export", "server", "bench", "torch", "onnx", "onnxscript"},
}
# Inside server/, imports go down a request's path: api -> models -> engine (-> runtime, model). settings.py sits between
# models and engine: the ways in and the models read it, and it reads the engine's defaults. Nothing imports main.py.
# part of server/ -> what it must never import: modules under the namespace, each with everything under it
SERVER_LAYERS = {
    "server/api": {"server.main"},
    "server/models": {"server.main", "server.api"},
    "server/settings.py": {"server.main", "server.api", "server.models"},
    "server/engine": {"server.main", "server.api", "server.models", "server.settings"},
}
# Entry modules of the serving path: importing them must load neither torch nor onnx.
TORCH_FREE_MODULES = ["nmt_serve.model.config", "nmt_serve.model.tokenizer", "nmt_serve.model.search", "nmt_serve.model.padding",
                      "nmt_serve.runtime.manifest", "nmt_serve.runtime.ort_step", "nmt_serve.runtime.self_check", "nmt_serve.server.main",
                      "nmt_serve.client.cli", "nmt_serve.export.parity_command"]  # fmt: skip


def imported_names(path: Path) -> set[str]:
    """What a file imports: our packages as their name under the namespace, anything else by its top-level name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
    return {parts[1] if parts[0] == NAMESPACE and len(parts) > 1 else parts[0] for parts in (module.split(".") for module in modules)}


def our_modules(path: Path) -> set[str]:
    """The modules under the namespace a file imports, without the namespace (server.models.registry), relative imports resolved."""
    package = [NAMESPACE, *path.relative_to(ROOT).parent.parts]
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(part for part in (base, node.module or "") if part)
            modules |= {module, *(f"{module}.{alias.name}" for alias in node.names)}  # `from a import b` may import module a.b
    return {module.removeprefix(NAMESPACE + ".") for module in modules if module.startswith(NAMESPACE + ".")}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_follow_the_one_way_rules(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_names(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("part", sorted(SERVER_LAYERS))
def test_server_imports_go_down_its_layers(part: str) -> None:
    paths = [ROOT / part] if part.endswith(".py") else sorted((ROOT / part).rglob("*.py"))
    assert paths and all(path.is_file() for path in paths), f"{part} holds no module"
    offenders = []
    for path in paths:
        bad = {module for module in our_modules(path) for above in SERVER_LAYERS[part] if module == above or module.startswith(above + ".")}
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "\n".join(offenders)


def test_imports_go_through_the_namespace() -> None:
    """A bare `import server` would work from the repository root but not from an installed wheel."""
    offenders = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.relative_to(ROOT).parts[0] in {".venv", "build", "artifacts", "data"}:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in PACKAGES]
    assert not offenders, "\n".join(offenders)


def test_every_package_goes_into_the_wheel() -> None:
    """pyproject.toml lists the packages one by one: a folder of modules left off the list, or without an __init__.py,
    works from the repository but is missing from an installed wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = {".".join((name, *path.parent.relative_to(ROOT / folder).parts)): path.parent
             for name, folder in setuptools["package-dir"].items() for path in (ROOT / folder).rglob("*.py")}  # fmt: skip
    assert sorted(set(found) - set(setuptools["packages"])) == []
    assert sorted(name for name, folder in found.items() if not (folder / "__init__.py").is_file()) == []


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_serving_modules_load_without_torch_or_onnx(module: str) -> None:
    code = f"import sys, {module}; print(sorted({{'torch', 'onnx'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", f"{module} pulls in {result.stdout.strip()}"
