"""A session with its inputs and outputs bound once to memory it keeps (IO binding), as the engine binds the decoder,
and timed without copies: the base of the bench tools that time single ONNX Runtime calls."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

TIMING_SECONDS = 0.02  # one timing of one variant: long enough to hold many calls, short enough to interleave often


class BoundCall:
    """A session with its inputs and outputs bound to memory it keeps; `calls_per_timing` and `time_calls` time it."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session, self.binding = session, session.io_binding()
        self.inputs: dict[str, np.ndarray] = {}  # the bound memory (inputs here, outputs below): it must outlive the binding
        self.outputs: list[np.ndarray] = []  # in the order bound

    def _bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        if output:
            self.outputs.append(array)
        else:
            self.inputs[name] = array
        bind_to = self.binding.bind_output if output else self.binding.bind_input
        bind_to(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)

    def calls_per_timing(self, seconds: float = TIMING_SECONDS) -> int:
        """How many calls take about `seconds` (at least 3), from one untimed and one timed call."""
        self.session.run_with_iobinding(self.binding)
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        return max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))

    def time_calls(self, calls: int) -> float:
        """Seconds per call over `calls` calls, after two untimed ones."""
        for _ in range(2):
            self.session.run_with_iobinding(self.binding)
        start = time.perf_counter()
        for _ in range(calls):
            self.session.run_with_iobinding(self.binding)
        return (time.perf_counter() - start) / calls
