"""The compiled switch for the calling thread's float mode (runtime/kernels/float_mode.c -> runtime/_float_mode, built
by `make kernels`), imported once for its three users: the engine flushes denormal floats to zero around each step on
the CPU (server/engine/engine.py), a CPU session's maker puts its thread's mode back after ONNX Runtime's
set_denormal_as_zero option changed it (runtime/ort_step.py), and the start-up log and benchmark reports say whether
the switch is there (server/engine/sessions.py). `native_float_mode` is None where it is not built: then nothing
flushes and the results are the same.

Why flush: a log-softmax over widely spread logits computes exponentials below float's normal range, each a microcode
assist on x86; flushed, the log-probs are the same bits (docs/benchmarks.md#denormal-floats-flushed-in-the-engines-calls).
"""

from __future__ import annotations

try:
    from nmt_serve.runtime import _float_mode as native_float_mode
except ImportError:
    native_float_mode = None
