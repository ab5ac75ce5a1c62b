"""StepCache where ONNX Runtime copies bound inputs to a device when they are bound (CUDA does; the CPU reads
the bound memory at every run): the decoder step must still match PyTorch.

Emulated on the CPU, so that it holds on every machine: a session wrapper whose IO binding binds a copy of each
input taken at bind time, as IOBinding::BindInput does for an input bound in CPU memory and read on a device.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from nmt_serve.export.parity import check_tensors
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import check_model_dir
from nmt_serve.runtime.step_cache import StepCache

SOURCES = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


class BindTimeCopies:
    """An IO binding that copies each input when it is bound; outputs are written to their memory at the run."""

    def __init__(self, binding: ort.IOBinding) -> None:
        self.binding = binding
        self.copies: dict[str, np.ndarray] = {}  # kept alive while bound

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: list[int], buffer_ptr: int) -> None:
        dtype = np.dtype(element_type)
        count = int(np.prod(shape))
        if count:
            raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(buffer_ptr)
            copy = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()
        else:
            copy = np.zeros(shape, dtype=dtype)
        self.copies[name] = copy
        self.binding.bind_input(name, device_type, device_id, element_type, list(copy.shape), copy.ctypes.data)

    def bind_output(self, *args: Any) -> None:
        self.binding.bind_output(*args)


class DeviceLikeSession:
    """The decoder session as StepCache uses it, on a provider that copies inputs at bind time."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session

    def get_providers(self) -> list[str]:
        return ["EmulatedDeviceExecutionProvider", "CPUExecutionProvider"]

    def get_inputs(self) -> list[Any]:
        return self.session.get_inputs()

    def get_outputs(self) -> list[Any]:
        return self.session.get_outputs()

    def io_binding(self) -> BindTimeCopies:
        return BindTimeCopies(self.session.io_binding())

    def run_with_iobinding(self, binding: BindTimeCopies) -> None:
        self.session.run_with_iobinding(binding.binding)


def device_like_step(model_dir: Path) -> OrtStep:
    step = OrtStep(model_dir)
    step.cache = StepCache(DeviceLikeSession(step.decoder), step.config, step.cross_names)  # type: ignore[arg-type]
    return step


def test_step_matches_torch_when_inputs_are_copied_at_bind_time(tiny_model_dir: Path, tiny_checkpoint: Path) -> None:
    step = device_like_step(tiny_model_dir)
    assert step.cache.binds_every_run
    report = check_tensors(TorchStep(load_checkpoint(tiny_checkpoint).model), step, SOURCES)
    assert report["max_abs_log_prob_diff"] < 1e-3
    assert report["max_abs_present_kv_diff"] < 1e-3


def test_a_kept_binding_would_feed_stale_inputs_there(tiny_model_dir: Path, tiny_checkpoint: Path) -> None:
    """Why the cache binds at every run on such a provider: with the CPU's kept bindings the emulation goes wrong,
    which also shows that it copies."""
    step = device_like_step(tiny_model_dir)
    step.cache.binds_every_run = False
    report = check_tensors(TorchStep(load_checkpoint(tiny_checkpoint).model), step, SOURCES)
    assert report["max_abs_log_prob_diff"] > 1e-2


def test_self_check_on_such_a_provider_allows_batch_differences_within_the_bound(tiny_model_dir: Path) -> None:
    """Bit-identical alone and packed is the CPU's contract; on a device the batch's shape picks the GEMM
    algorithm, so there the precision's bound applies (and the translation cache stays off unless bit-identical)."""
    step = device_like_step(tiny_model_dir)
    result = check_model_dir(tiny_model_dir, step.encode, step.cache, step.config)
    assert result is not None and result.passed
    assert result.provider == "EmulatedDeviceExecutionProvider" and result.batch_bound == result.bound
    on_cpu = check_model_dir(tiny_model_dir, step.encode, OrtStep(tiny_model_dir).cache, step.config)
    assert on_cpu is not None and on_cpu.batch_bound == 0.0 and on_cpu.provider == "CPUExecutionProvider"
