"""Running one native kernel's node alone: a session on the library, and the kernel's tiles of one instruction set."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from nmt_serve.runtime.host import cpu_facts

CPU = ["CPUExecutionProvider"]


def on_tiles(tile_paths: dict[str, str], path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels made from here on `path`'s tiles (NMT_KERNELS_ISA; `tile_paths`: each path's /proc/cpuinfo
    flag); skipped where the CPU has not that instruction set."""
    if tile_paths[path] not in cpu_facts()["features"]:
        pytest.skip(f"this CPU has no {tile_paths[path]}: its tiles cannot run here")
    monkeypatch.setenv("NMT_KERNELS_ISA", path)


def kernel_session(model, library: Path) -> ort.InferenceSession:
    """A CPU session of `model` (an onnx ModelProto) with the kernels library registered."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
