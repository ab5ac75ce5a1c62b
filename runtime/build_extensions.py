"""Compile the engine's host work in C (runtime/kernels/*.c) into the CPython extensions the engine imports.

Five: beam search's per-step choice (beam_select.c -> model/_beam_select, imported by model/search.py), the step
cache's row and source copies (cache_moves.c -> runtime/_cache_moves, imported by runtime/step_cache.py and
runtime/source_group.py), a steady greedy step and a steady beam step (greedy_step.c -> runtime/_greedy_step and
beam_step.c -> runtime/_beam_step, imported by runtime/step_cache.py for server/engine/engine.py) and the thread's float
mode (float_mode.c -> runtime/_float_mode, imported by
runtime/float_mode.py: the engine flushes denormals around its calls). They need only a C compiler and this Python's
headers (Debian: python3-dev), no ONNX Runtime headers, so nmt-build-kernels builds them even where the attention kernels
cannot be. Without the first four the same work runs in numpy and Python, with the same results; without the fourth
the engine's calls keep the thread's mode, also with the same results, slower where a log-softmax meets denormal floats.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from nmt_serve.runtime.native_kernels import KERNELS_DIR

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"  # the module file's name carries this Python's ABI
COMPILE_FLAGS = ("-x", "c", "-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra")


@dataclass(frozen=True)
class Extension:
    what: str  # for the log
    source: Path
    module: Path  # where the importing package finds it


BEAM_SELECT = Extension("beam search's choice", KERNELS_DIR / "beam_select.c", PACKAGE_DIR / "model" / f"_beam_select{SUFFIX}")
CACHE_MOVES = Extension("the step cache's row moves", KERNELS_DIR / "cache_moves.c", PACKAGE_DIR / "runtime" / f"_cache_moves{SUFFIX}")
GREEDY_STEP = Extension("a steady greedy step", KERNELS_DIR / "greedy_step.c", PACKAGE_DIR / "runtime" / f"_greedy_step{SUFFIX}")
BEAM_STEP = Extension("a steady beam step", KERNELS_DIR / "beam_step.c", PACKAGE_DIR / "runtime" / f"_beam_step{SUFFIX}")
FLOAT_MODE = Extension("denormals flushed in the engine's calls", KERNELS_DIR / "float_mode.c",
                       PACKAGE_DIR / "runtime" / f"_float_mode{SUFFIX}")
EXTENSIONS = (BEAM_SELECT, CACHE_MOVES, GREEDY_STEP, BEAM_STEP, FLOAT_MODE)


class ExtensionBuildError(RuntimeError):
    """The compiler failed on an extension; the message holds its command and output."""


def python_headers() -> Path | None:
    """This Python's include directory, where it holds Python.h; else None."""
    include = Path(sysconfig.get_paths()["include"])
    return include if (include / "Python.h").is_file() else None


def compile_into(command: list[str], out: Path) -> str | None:
    """Run a compiler `command` (without its output option) writing `out` whole, then moved into place; None when it
    succeeded, else the command and the end of its error output. Shared with the kernels library (build_kernels.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    command = [*command, "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    partial.replace(out)
    return None


def missing_for(extension: Extension, compiler: str) -> str | None:
    """What keeps `extension` from being compiled here (no Python headers, compiler or source), or None."""
    if python_headers() is None:
        return f"no Python.h in {sysconfig.get_paths()['include']} (Debian: python3-dev)"
    if shutil.which(compiler) is None:
        return f"no compiler {compiler!r}"
    return None if extension.source.is_file() else f"no source {extension.source}"


def build_extension(extension: Extension, compiler: str = "g++", out: Path | None = None) -> Path | None:
    """Compile `extension` into `out` (default: its module path); None, with a warning, where this Python has no headers,
    there is no compiler or no source (numpy then does its work). ExtensionBuildError when the compiler fails."""
    missing, out = missing_for(extension, compiler), out or extension.module
    if missing is not None:
        logger.warning("%s not compiled (%s): it runs in numpy", extension.what, missing)
        return None
    failure = compile_into([compiler, *COMPILE_FLAGS, f"-I{python_headers()}", str(extension.source)], out)
    if failure is not None:
        raise ExtensionBuildError(failure)
    logger.info("built %s (%s)", out, extension.what)
    return out


def build_extensions(compiler: str = "g++", out_dir: Path | None = None) -> bool:
    """Every extension (into `out_dir` where given, else where it is imported from); False when the compiler failed on
    any (each failure logged), True otherwise, a skipped one included."""
    built = True
    for extension in EXTENSIONS:
        try:
            build_extension(extension, compiler, out_dir / extension.module.name if out_dir else None)
        except ExtensionBuildError as error:
            logger.error("nmt-build-kernels: %s", error)
            built = False
    return built
