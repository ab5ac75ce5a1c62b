"""Compile beam search's per-step choice (runtime/kernels/beam_select.c) into the CPython extension model/search.py imports.

It needs only a C compiler and this Python's headers (Debian: python3-dev), no ONNX Runtime headers, so nmt-build-kernels
builds it even where the attention kernels cannot be. Without it model/search.py runs the same choice in numpy.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sysconfig
from pathlib import Path

from nmt_serve.runtime.native_kernels import KERNELS_DIR

logger = logging.getLogger(__name__)

SOURCE = KERNELS_DIR / "beam_select.c"
# In the model package, so that `from nmt_serve.model import _beam_select` finds it; the name carries this Python's ABI.
MODULE = Path(__file__).resolve().parent.parent / "model" / f"_beam_select{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
COMPILE_FLAGS = ("-x", "c", "-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra")


class BeamSelectBuildError(RuntimeError):
    """The compiler failed on the extension; the message holds its command and output."""


def python_headers() -> Path | None:
    """This Python's include directory, where it holds Python.h; else None."""
    include = Path(sysconfig.get_paths()["include"])
    return include if (include / "Python.h").is_file() else None


def build_beam_select(compiler: str = "g++", out: Path = MODULE) -> Path | None:
    """Compile the extension into `out` (written whole, then moved into place); None, with a warning, where this Python has
    no headers, there is no compiler or no source (the numpy form then runs). BeamSelectBuildError when the compiler fails."""
    include = python_headers()
    if include is None or shutil.which(compiler) is None or not SOURCE.is_file():
        headers = sysconfig.get_paths()["include"]
        missing = (f"no Python.h in {headers} (Debian: python3-dev)" if include is None else f"no compiler {compiler!r}"
                   if shutil.which(compiler) is None else f"no source {SOURCE}")  # fmt: skip
        logger.warning("beam search's choice not compiled (%s): it runs in numpy", missing)
        return None
    partial = out.with_name(out.name + ".partial")
    command = [compiler, *COMPILE_FLAGS, f"-I{include}", str(SOURCE), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BeamSelectBuildError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    partial.replace(out)
    logger.info("built %s (beam search's choice)", out)
    return out
