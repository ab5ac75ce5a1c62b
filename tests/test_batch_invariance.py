"""Batch invariance: an int8 (or fp32) request's tokens and scores are the same alone, batched with any others,
greedy or beam, in the engine and through the server with concurrent clients; the self-check checks it at start."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
from pathlib import Path

import pytest

from nmt_serve.bench.int8_schemes import build_scheme_dir
from nmt_serve.model.search import Hypothesis, SearchOptions
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import SELF_CHECK_FILE, check_model_dir
from nmt_serve.server.engine.engine import Engine
from nmt_serve.server.engine.jobs import Job, Outcome
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings
from nmt_serve.server.main import main as serve_main
from tests.serving import RunningServer, server_settings

# Sources of very different lengths and token mixes (so different activation ranges), arriving at different steps.
SOURCES = [[5, 6, 7, 8, 9], [10], [200] * 40, [11, 12, 13], list(range(14, 90)), [22, 23], [250, 3, 250, 3, 250, 3]]
GREEDY = SearchOptions(beam_size=1, min_output_tokens=6, max_output_tokens=14)
BEAM3 = SearchOptions(beam_size=3, num_hypotheses=2, min_output_tokens=4, max_output_tokens=12)
PLAN = [(0, 0, GREEDY), (0, 2, BEAM3), (1, 1, GREEDY), (2, 4, GREEDY), (2, 3, BEAM3), (4, 5, BEAM3), (5, 6, GREEDY)]
TEXTS = ["Guten Morgen.", "Wo ist der Bahnhof?", "Der Hund schläft im Garten und der Hund schläft im Haus.",
         "Ja", "Ich habe meinen Schlüssel verloren, und jetzt stehe ich vor der Tür.", "1234567890 !!! ???"]  # fmt: skip


@pytest.fixture(scope="module")
def per_tensor_dir(tiny_model_dir: Path, int8_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with one activation scale per call, and the per-row dir's self-check reference."""
    out = build_scheme_dir(tiny_model_dir, "u8s8-reduce-range", tmp_path_factory.mktemp("onnx-int8-tensor"))
    shutil.copyfile(int8_dir / SELF_CHECK_FILE, out / SELF_CHECK_FILE)
    return out


def run_plan(model_dir: Path, plan: list[tuple[int, int, SearchOptions]] = PLAN,
             native_kernels: str = "off") -> list[tuple[Job, list[int], SearchOptions]]:  # fmt: skip
    """The plan's requests through one engine, each submitted at its step; the finished jobs."""
    runtime = Runtime(model_dir, RuntimeSettings(warmup_rows=4, warmup_src_len=8, native_kernels=native_kernels))
    engine = Engine(runtime)
    jobs = []
    for step in range(8):
        for arrival, source, options in plan:
            if arrival == step:
                jobs.append((engine.submit(SOURCES[source], options), SOURCES[source], options))
        engine.step()
    for _ in range(200):
        if all(job.done.is_set() for job, _, _ in jobs):
            return jobs
        engine.step()
    raise AssertionError("engine did not finish")


def alone(model_dir: Path, source: list[int], options: SearchOptions, native_kernels: str = "off") -> list[Hypothesis]:
    """The request through the same engine with nothing beside it."""
    ((job, _, _),) = run_plan(model_dir, [(0, SOURCES.index(source), options)], native_kernels)
    return job.hypotheses


def outputs(hypotheses: list[Hypothesis]) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(hypothesis.token_ids), hypothesis.score) for hypothesis in hypotheses]


@pytest.mark.parametrize("precision", ["int8", "int8 with an int8 cache", "fp32"])
def test_engine_gives_each_request_its_alone_result_bit_for_bit(precision: str, int8_dir: Path, int8_cache_dir: Path, tiny_model_dir: Path) -> None:
    """Continuous batching joins and leaves rows at different positions, greedy beside beam: each request's
    token ids and scores equal its run alone exactly (scores compared with ==, not a tolerance)."""
    model_dir = {"int8": int8_dir, "int8 with an int8 cache": int8_cache_dir, "fp32": tiny_model_dir}[precision]
    for job, source, options in run_plan(model_dir):
        assert job.outcome is Outcome.OK
        assert outputs(job.hypotheses) == outputs(alone(model_dir, source, options))


@pytest.mark.parametrize("precision", ["int8 with an int8 cache", "fp32"])
def test_engine_on_native_kernels_gives_each_request_its_alone_result_bit_for_bit(
    precision: str, native_kernels_library: Path, int8_cache_dir: Path, tiny_model_dir: Path
) -> None:
    """The same plan with the decoder's attention on the native kernels (runtime/native_kernels.py): each request's
    token ids and scores equal its run alone exactly. (Against ONNX Runtime's kernels the log-probs differ by float
    rounding, which on a tiny model's near-ties may pick another token on some CPU: that comparison is the self-check's,
    with its bound, in tests/test_native_kernels.py.)"""
    model_dir = {"int8 with an int8 cache": int8_cache_dir, "fp32": tiny_model_dir}[precision]
    for job, source, options in run_plan(model_dir, native_kernels=str(native_kernels_library)):
        assert job.outcome is Outcome.OK
        assert outputs(job.hypotheses) == outputs(alone(model_dir, source, options, str(native_kernels_library)))


def test_engine_on_per_tensor_int8_scales_depends_on_the_batch(per_tensor_dir: Path) -> None:
    """The same plan on one activation scale per call: some request's scores move with its batch, which is
    what the test above would catch."""
    differing = [source for job, source, options in run_plan(per_tensor_dir) if outputs(job.hypotheses) != outputs(alone(per_tensor_dir, source, options))]
    assert differing


@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_self_check_confirms_batch_invariance_of_the_int8_dir(cache: str, int8_dir: Path, int8_cache_dir: Path) -> None:
    model_dir = int8_cache_dir if cache == "int8" else int8_dir
    step = OrtStep(model_dir)
    result = check_model_dir(model_dir, step.encode, step.cache, step.config)
    assert result is not None and result.batch_diff == 0.0 and result.passed
    assert "alone and packed: bit-identical" in result.describe()


def test_self_check_fails_a_batch_dependent_int8_dir(per_tensor_dir: Path) -> None:
    step = OrtStep(per_tensor_dir)
    result = check_model_dir(per_tensor_dir, step.encode, step.cache, step.config)
    assert result is not None and result.batch_diff is not None and result.batch_diff > 0 and not result.passed
    assert "alone and packed: DIFFER by up to" in result.describe()


def test_server_refuses_a_batch_dependent_int8_dir_unless_told_to_warn(per_tensor_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert serve_main([str(per_tensor_dir), "--port", "0", "--metrics-port", "-1", "--http-port", "0", "--threads", "1"]) == 1
    assert "alone and packed: DIFFER by up to" in caplog.text and "--self-check warn serves anyway" in caplog.text
    with RunningServer(server_settings(per_tensor_dir, self_check="warn")) as server:
        channel, stub = server.stub()
        with channel:
            assert stub.Translate(pb.TranslateRequest(texts=["Guten Morgen."]), timeout=20).translations


def test_parity_report_records_alone_against_packed(int8_dir: Path) -> None:
    batch = json.loads((int8_dir / "manifest.json").read_text())["parity"]["batch"]
    for search in ("greedy", "beam4"):
        assert batch[search]["identical_tokens"] == batch["sentences"] > 0
        assert batch[search]["max_score_diff"] == 0.0


@pytest.mark.parametrize("beam", [1, 4])
def test_server_answers_each_text_the_same_alone_and_among_concurrent_clients(int8_dir: Path, beam: int) -> None:
    """Two engines, 8 concurrent clients sending overlapping batches of the texts: every answer equals the
    text's answer when it was sent alone, text and score."""
    with RunningServer(server_settings(int8_dir, engines=2)) as server:
        channel, stub = server.stub()
        with channel:
            def translate(texts: list[str]) -> list[tuple[str, float]]:
                reply = stub.Translate(pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(beam_size=beam)), timeout=60)
                return [(item.hypotheses[0].text, item.hypotheses[0].score) for item in reply.translations]

            expected = {text: translate([text])[0] for text in TEXTS}
            batches = [TEXTS[start:] + TEXTS[:start] for start in range(len(TEXTS))] * 4
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                for texts, answers in zip(batches, pool.map(translate, batches), strict=True):
                    assert answers == [expected[text] for text in texts]
