"""Denormal floats flushed to zero around the engine's ONNX Runtime calls (runtime/kernels/float_mode.c, built by
runtime/build_extensions.py): the switch and its restore, a log-softmax's bits unchanged by it, and an engine step that
runs its calls flushed and leaves the thread's mode as it found it."""

from __future__ import annotations

import platform
from pathlib import Path
from types import ModuleType

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nmt_serve.model.search import SearchOptions
from nmt_serve.runtime import float_mode as float_mode_module
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.server.engine import engine as engine_module
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from tests.extensions import compiled_extension

FLUSH_BITS = 0x8040  # MXCSR flush-to-zero and denormals-are-zero
CONTROL = 0xFFC0  # MXCSR without its six sticky exception flags, which any arithmetic may raise


def control(mode: int) -> int:
    return mode & CONTROL


pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the switch sets x86's SSE control register")


@pytest.fixture(scope="module")
def float_mode(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compiled_extension("float_mode", tmp_path_factory.mktemp("float_mode"))  # type: ignore[return-value]


def test_flushing_sets_both_bits_and_restore_puts_the_mode_back(float_mode: ModuleType) -> None:
    tiny = np.array([1e-38], dtype=np.float32)
    assert (tiny / np.float32(10))[0] > 0  # a denormal result
    before = float_mode.mode()
    assert before & FLUSH_BITS == 0  # Python starts with denormals kept
    returned = float_mode.flush_denormals()
    try:
        assert control(returned) == control(before) and control(float_mode.mode()) == control(before) | FLUSH_BITS
        assert (tiny / np.float32(10))[0] == 0  # flushed to zero on this thread
    finally:
        float_mode.restore(returned)
    assert control(float_mode.mode()) == control(before)
    with pytest.raises(ValueError, match="restore takes the mode flush_denormals returned"):
        float_mode.restore(1 << 20)


def test_a_log_softmax_over_widely_spread_logits_gives_the_same_bits_flushed(float_mode: ModuleType) -> None:
    """Most of the row's exponentials fall below float's normal range: flushed they are 0, which changes no sum that
    holds the row's largest term (1), so every output is the same."""
    vocabulary = 6000
    node = helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1)
    graph = helper.make_graph([node], "log_softmax", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", vocabulary])],
                              [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["R", vocabulary])])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    logits = (np.random.default_rng(0).standard_normal((6, vocabulary)) * 40).astype(np.float32)
    kept = session.run(None, {"logits": logits})[0]
    mode = float_mode.flush_denormals()
    try:
        flushed = session.run(None, {"logits": logits})[0]
    finally:
        float_mode.restore(mode)
    assert np.array_equal(kept, flushed)


def test_an_engine_step_runs_its_calls_flushed_and_restores_the_mode(float_mode: ModuleType, tiny_model_dir: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each decoder call of a request sees the flushing mode, whether the engine's Python or the compiled steady beam
    step makes it (both call the session's bound run); after the steps the thread's mode is what it was."""
    monkeypatch.setattr(float_mode_module, "native_float_mode", float_mode)
    beam_step = compiled_extension("beam_step", tmp_path_factory.mktemp("beam_step"))
    compiled_steps: list[int] = []

    class CountingBeamStep:
        @staticmethod
        def step(*args: object) -> object:
            compiled_steps.append(1)
            return beam_step.step(*args)  # type: ignore[attr-defined]

    monkeypatch.setattr(engine_module, "native_beam_step", CountingBeamStep)
    modes: list[int] = []
    runtime = Runtime(tiny_model_dir, RuntimeSettings(warmup_rows=2, warmup_src_len=4))
    engine = Engine(runtime)
    session = engine._cache.session
    real_run = session.run_with_iobinding

    def run(binding: object) -> None:
        modes.append(float_mode.mode())
        real_run(binding)

    monkeypatch.setattr(session, "run_with_iobinding", run)
    before = float_mode.mode()
    job = engine.submit([5, 6, 7], SearchOptions(beam_size=2, min_output_tokens=6, max_output_tokens=6))
    engine.run_until_idle()
    assert job.hypotheses and len(modes) == 6 and len(compiled_steps) == 4  # steps 3-6: steady, compiled
    assert all(mode & FLUSH_BITS == FLUSH_BITS for mode in modes)
    assert control(float_mode.mode()) == control(before)


def test_making_a_cpu_session_leaves_the_thread_s_mode_as_it_was(float_mode: ModuleType, tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """ONNX Runtime's session.set_denormal_as_zero flushes on the thread that makes the session too, for good; the
    session's maker puts that thread's mode back, so only the pool threads and the engine's steps flush."""
    monkeypatch.setattr(float_mode_module, "native_float_mode", float_mode)
    before = float_mode.mode()
    assert before & FLUSH_BITS == 0
    make_session(tiny_model_dir / "decoder.onnx", ["CPUExecutionProvider"], threads=1)
    assert control(float_mode.mode()) == control(before)
