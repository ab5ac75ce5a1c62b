"""Several models in one server: routing by name, the default model, NOT_FOUND, ListModels, per-model health and
metrics, fair sharing of the workers, and the command-line flags; two tiny models on a real loopback server."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmt_serve.client import cli
from nmt_serve.client.loadtest import SAMPLE_TEXTS, model_turns
from nmt_serve.client.loadtest import main as loadtest_main
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.runtime.manifest import load_model_dir, write_manifest
from nmt_serve.server.api.service import SERVICE_NAME
from nmt_serve.server.main import Server
from nmt_serve.server.main import main as serve_main
from nmt_serve.server.models.registry import ModelSetError
from nmt_serve.server.settings import parse_settings
from tests.serving import RunningServer, held_engines, scrape_until, server_settings, total, wait_for

SECOND = "fr-en-tiny"
# Decodes 90 steps whatever the model says (the tiny model has 96 positions): keeps its engine busy.
LONG = pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90)
FLOOD = 12  # the flooded model's queue limit in the starvation test


def renamed_copy(model_dir: Path, out: Path, name: str, source_language: str) -> Path:
    """The same weights under another manifest name and language pair: a second model without a second export."""
    shutil.copytree(model_dir, out)
    manifest = load_model_dir(out)
    renamed = dataclasses.replace(manifest, model_name=name, source_language=source_language, files={})
    write_manifest(out, renamed, list(manifest.files))
    return out


@pytest.fixture(scope="module")
def second_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return renamed_copy(tiny_model_dir, tmp_path_factory.mktemp("models") / SECOND, SECOND, "fr")


@pytest.fixture(scope="module")
def two_models(tiny_model_dir: Path, second_model_dir: Path) -> Iterator[RunningServer]:
    settings = server_settings(tiny_model_dir, more_model_dirs=(second_model_dir,), max_queued_requests=FLOOD, max_rows=1, engines=2)
    with RunningServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def first(two_models: RunningServer) -> str:
    return two_models.server.runtime.manifest.model_name


def test_list_models_names_every_model_the_default_first(two_models: RunningServer, first: str) -> None:
    channel, stub = two_models.stub()
    with channel:
        listing = stub.ListModels(pb.ListModelsRequest(), timeout=10)
        second = stub.GetModelInfo(pb.GetModelInfoRequest(model=SECOND), timeout=10)
        default = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert listing.default_model == first and [info.name for info in listing.models] == [first, SECOND]
    assert (second.name, second.source_language, second.target_language) == (SECOND, "fr", "en")
    assert default == listing.models[0] and second == listing.models[1]
    assert second.limits.max_queued_requests == FLOOD


@pytest.mark.parametrize("model", ["", SECOND])
def test_translate_and_stream_go_to_the_named_model(two_models: RunningServer, first: str, model: str) -> None:
    channel, stub = two_models.stub()
    with channel:
        response = stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund."], model=model), timeout=30)
        messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text="Ich sehe den Hund.", model=model), timeout=30))
    assert response.model == (model or first)
    # The same weights under two names: the same translation either way.
    assert messages[-1].final and messages[-1].hypotheses[0].text == response.translations[0].hypotheses[0].text != ""


@pytest.mark.parametrize("method", ["Translate", "TranslateStream", "GetModelInfo"])
def test_unknown_model_is_not_found_with_a_short_message(two_models: RunningServer, first: str, method: str) -> None:
    name = "x" * 20_000  # quoted whole, the message would pass a client's 16 KiB metadata limit: RESOURCE_EXHAUSTED
    channel, stub = two_models.stub()
    with channel, pytest.raises(grpc.RpcError) as caught:
        if method == "Translate":
            stub.Translate(pb.TranslateRequest(texts=["Hund."], model=name), timeout=10)
        elif method == "TranslateStream":
            list(stub.TranslateStream(pb.TranslateStreamRequest(text="Hund.", model=name), timeout=10))
        else:
            stub.GetModelInfo(pb.GetModelInfoRequest(model=name), timeout=10)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    details = caught.value.details()
    assert len(details) < 1000 and "(20000 characters)" in details
    assert f"served models: {first!r}, {SECOND!r}" in details


def test_health_answers_for_each_model_by_name(two_models: RunningServer, first: str) -> None:
    channel = grpc.insecure_channel(two_models.target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME, f"{SERVICE_NAME}/{first}", f"{SERVICE_NAME}/{SECOND}"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(service=f"{SERVICE_NAME}/nope"), timeout=10)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_metrics_carry_the_model_of_each_call(two_models: RunningServer, first: str) -> None:
    channel, stub = two_models.stub()
    port = two_models.server.metrics_port
    before = scrape_until(port, lambda found: True)
    with channel:
        stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund.", "Wir mag Kaffee."], model=SECOND), timeout=30)
        stub.Translate(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=30)
        with pytest.raises(grpc.RpcError):
            stub.Translate(pb.TranslateRequest(texts=["Hund."], model="unknown-model"), timeout=10)

    def grew(samples: object, name: str, **labels: str) -> float:
        return total(samples, name, **labels) - total(before, name, **labels)  # type: ignore[arg-type]

    samples = scrape_until(port, lambda found: grew(found, "nmt_requests_total", code="NOT_FOUND") == 1 and
                           grew(found, "nmt_output_tokens_count", model=SECOND) == 2)  # fmt: skip
    assert grew(samples, "nmt_requests_total", method="Translate", code="OK", model=SECOND) == 1
    assert grew(samples, "nmt_requests_total", method="Translate", code="OK", model=first) == 1
    # A name no model has never becomes a label value.
    assert grew(samples, "nmt_requests_total", code="NOT_FOUND", model="") == 1
    assert not any(("model", "unknown-model") in labels for _, labels in samples)
    assert grew(samples, "nmt_input_tokens_count", model=SECOND) == 2 and grew(samples, "nmt_input_tokens_count", model=first) == 1
    assert grew(samples, "nmt_generated_tokens_total", model=SECOND) > 0 and grew(samples, "nmt_decode_step_duration_seconds_count", model=first) > 0
    for model in (first, SECOND):
        assert total(samples, "nmt_model_info", model=model, precision="fp32") == 1
        assert ("nmt_queue_depth", (("model", model),)) in samples


def test_a_flooded_model_does_not_starve_another(two_models: RunningServer, first: str) -> None:
    """The flooded model fills its queue with long requests; the other model's requests still finish first."""
    channel, stub = two_models.stub()
    flooded, other = (two_models.server.models.resolve(name).scheduler for name in (first, SECOND))
    # The flooded model's engines are held until every call is in, so both models start from the same point however
    # fast this CPU steps; from then on the workers take the models in turn (server/engine/engine_pool.py).
    with channel, held_engines(two_models, models=(first,)) as gate:
        backlog = [stub.Translate.future(pb.TranslateRequest(texts=["Ich sehe den Hund."], options=LONG), timeout=120) for _ in range(FLOOD)]
        assert wait_for(lambda: flooded.in_flight == FLOOD, 30)
        with pytest.raises(grpc.RpcError) as caught:  # its queue is full ...
            stub.Translate(pb.TranslateRequest(texts=["Hund."]), timeout=30)
        # ... while the other model admits and answers.
        others = [stub.Translate.future(pb.TranslateRequest(texts=["Ich sehe den Hund."], model=SECOND), timeout=60) for _ in range(3)]
        assert wait_for(lambda: other.in_flight + sum(future.done() for future in others) >= 3, 30)
        gate.open()
        answers = [future.result() for future in others]
        finished_before = sum(future.done() for future in backlog)
        assert all(future.result().translations for future in backlog)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(answer.model == SECOND for answer in answers)
    # One row per engine, two engines: the backlog is six requests of 90 steps after one another on each engine, and
    # the other model's three requests (at most 32 steps each) take turns with it at the same workers.
    assert finished_before <= FLOOD // 2, finished_before


def test_default_model_flag_picks_the_model_for_an_empty_field(tiny_model_dir: Path, second_model_dir: Path) -> None:
    settings = server_settings(tiny_model_dir, more_model_dirs=(second_model_dir,), default_model=SECOND, engines=1)
    with RunningServer(settings) as running:
        channel, stub = running.stub()
        with channel:
            listing = stub.ListModels(pb.ListModelsRequest(), timeout=10)
            response = stub.Translate(pb.TranslateRequest(texts=["Hund."]), timeout=30)
    assert listing.default_model == SECOND == listing.models[0].name == response.model


def test_unknown_default_model_and_a_name_served_twice_fail_at_start(tiny_model_dir: Path, second_model_dir: Path) -> None:
    with pytest.raises(ModelSetError, match=f"default_model 'nope' is not a served model; served: '.+', '{SECOND}'"):
        Server(server_settings(tiny_model_dir, more_model_dirs=(second_model_dir,), default_model="nope"))
    with pytest.raises(ModelSetError, match=f"model dirs {second_model_dir} and {second_model_dir} both hold the model '{SECOND}'"):
        Server(server_settings(second_model_dir, more_model_dirs=(second_model_dir,)))


def test_serve_exits_1_naming_both_dirs_of_one_name(tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    twin = shutil.copytree(tiny_model_dir, tmp_path / "twin")
    with caplog.at_level(logging.ERROR):
        assert serve_main([str(tiny_model_dir), str(twin), "--port", "0", "--metrics-port", "-1"]) == 1
    assert f"model dirs {tiny_model_dir} and {twin} both hold the model" in caplog.text


def test_serve_flags_name_dirs_and_a_model_repo(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("b-model", "a-model", "not-a-model"):
        (repo / name).mkdir(parents=True)
    for name in ("b-model", "a-model"):
        (repo / name / "manifest.json").write_text("{}")
    settings = parse_settings(["/x", "/y", "--model-repo", str(repo), "--default-model", "m"], environ={})
    assert settings.model_dirs == (Path("/x"), Path("/y"), repo / "a-model", repo / "b-model") and settings.default_model == "m"
    assert parse_settings(["--model-repo", str(repo)], environ={}).model_dirs == (repo / "a-model", repo / "b-model")
    assert parse_settings([], environ={"NMT_MODEL_DIR": "/x:/y"}).model_dirs == (Path("/x"), Path("/y"))
    with pytest.raises(ValueError, match="--model-repo '.*not-a-model' holds no model dir"):
        parse_settings(["--model-repo", str(repo / "not-a-model")], environ={})


def test_cli_model_flag_and_model_list(two_models: RunningServer, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert cli.main(["--target", two_models.target, "--model", SECOND, "--json", "Ich sehe den Hund."]) == 0
    assert json.loads(capsys.readouterr().out)["hypotheses"][0]["text"]
    assert cli.main(["--target", two_models.target, "--list-models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].split("\t")[0].endswith("(default)") and lines[1].startswith(f"{SECOND}\tfr->en\t")
    with caplog.at_level(logging.ERROR, logger="nmt-translate"):
        assert cli.main(["--target", two_models.target, "--model", "nope", "Hund."]) == 1
    assert "NOT_FOUND: model 'nope' is not served here" in caplog.text


@pytest.mark.parametrize(("spec", "counts"), [("{first},{second}", (3, 3)), ("{first}=2,{second}=1", (4, 2))])
def test_loadtest_sends_the_model_mix(two_models: RunningServer, first: str, tmp_path: Path, spec: str, counts: tuple[int, int]) -> None:
    out = tmp_path / "report.json"
    argv = ["--target", two_models.target, "--concurrency", "2", "--requests", "6", "--json", str(out), "--texts", str(SAMPLE_TEXTS),
            "--model", spec.format(first=first, second=SECOND)]  # fmt: skip
    assert loadtest_main(argv) == 0
    models = json.loads(out.read_text())["models"]
    assert (models[first]["OK"], models[SECOND]["OK"]) == counts


@pytest.mark.parametrize("spec", ["a=0", "a,=2", "a=x"])
def test_loadtest_model_mix_is_validated(spec: str) -> None:
    with pytest.raises(ValueError, match="--model takes NAME\\[=WEIGHT\\]"):
        model_turns(spec)
    assert model_turns("a=2,b") == ["a", "a", "b"]
