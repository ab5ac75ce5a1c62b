"""The session options the runtime gives CUDA, checked on any machine: ONNX Runtime's constructor is replaced by one
that records its arguments (CUDA cannot run here; tests/test_gpu.py runs the real thing where it can)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from nmt_serve.runtime import ort_step


class Recorded(Exception):
    """Raised by the recording constructor once it has the arguments: no session is built."""


def session_arguments(monkeypatch: pytest.MonkeyPatch, providers: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def record(path: str, options: ort.SessionOptions, providers: list[Any], disabled_optimizers: list[str]) -> None:
        seen.update(path=path, providers=providers, disabled_optimizers=disabled_optimizers)
        raise Recorded

    monkeypatch.setattr(ort_step.ort, "InferenceSession", record)
    with pytest.raises(ValueError, match="cannot load it"):
        ort_step.make_session(Path("decoder.onnx"), providers)
    return seen


def test_cuda_sessions_compute_fp32_without_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 moved the default model's log-probs by up to 4.2e-3 on an H200, past the fp32 self-check bound of 1e-3."""
    seen = session_arguments(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert seen["providers"] == [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert seen["disabled_optimizers"] == []


def test_cpu_sessions_keep_their_plain_provider_and_skip_the_slow_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = session_arguments(monkeypatch, ["CPUExecutionProvider"])
    assert seen["providers"] == ["CPUExecutionProvider"] and seen["disabled_optimizers"] == ["SkipLayerNormFusion"]
