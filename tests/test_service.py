"""The gRPC service against a real server on a loopback port: validation, limits, status codes, health, reflection, streaming, documents."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.service import SERVICE_NAME
from nmt_serve.server.api.status import MAX_DETAIL_CHARS, status_for
from nmt_serve.server.models.requests import ECHO_CHARS, InvalidRequest
from tests.raw_http2 import DATA, END_HEADERS, END_STREAM, HEADERS, frame, grpc_message, request_headers
from tests.raw_http2 import call as raw_call
from tests.serving import RunningServer, scrape, server_settings, wait_for

GERMAN = ["Ich sehe den Hund.", "Wir mag Kaffee heute.", "Du habe einen großen Zug nicht."]


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path) -> Iterator[RunningServer]:
    # Two engines whatever the machine's cores: every test here also checks that requests spread over engines keep their results.
    with RunningServer(server_settings(tiny_model_dir, engines=2)) as server:
        yield server


@pytest.fixture()
def stub(running: RunningServer):  # type: ignore[no-untyped-def]
    channel, stub = running.stub()
    yield stub
    channel.close()


def code_of(call, request, **kwargs) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        result = call(request, **kwargs)
        if not isinstance(result, pb.TranslateResponse | pb.ModelInfo):
            list(result)  # drain a stream
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""


def texts_request(*texts: str, **options: object) -> pb.TranslateRequest:
    return pb.TranslateRequest(texts=list(texts), options=pb.DecodingOptions(**options))


# ---------------------------------------------------------------- happy paths


def test_translate_returns_one_nbest_per_text_in_order(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    response = stub.Translate(texts_request(*GERMAN, beam_size=3, num_hypotheses=2), timeout=30)
    assert response.model == running.server.runtime.manifest.model_name
    assert len(response.translations) == len(GERMAN)
    for translation in response.translations:
        assert len(translation.hypotheses) == 2
        best, second = translation.hypotheses
        assert best.score >= second.score
        assert best.token_count > 0 and best.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
    # Each text's result is what it gets alone (continuous batching must not change outputs).
    alone = stub.Translate(texts_request(GERMAN[1], beam_size=3, num_hypotheses=2), timeout=30)
    assert alone.translations[0] == response.translations[1]


def test_concurrent_requests_over_two_engines_equal_each_alone(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    requests = [texts_request(text, beam_size=beam, num_hypotheses=1) for text in GERMAN for beam in (1, 3)] * 4
    alone = [stub.Translate(request, timeout=30) for request in requests[:6]]  # one at a time
    engines = running.server.scheduler.engines
    steps = [engine.profile.steps for engine in engines]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda request: stub.Translate(request, timeout=30), requests))
    assert len(engines) == 2 and all(engine.profile.steps > before for engine, before in zip(engines, steps, strict=True))
    assert_same_responses(together, alone * 4)


def assert_same_responses(actual: list[pb.TranslateResponse], expected: list[pb.TranslateResponse]) -> None:
    """Texts, token counts and finish reasons exactly; scores to 1e-4, as the engine's tests: a row's sums
    run through matrix kernels that some CPUs block by the call's row count, so its last bits can depend
    on the rows it shares a step with (seen on an AVX2-only core: -2.97112632 alone, -2.97112656 together)."""
    def fields(responses: list[pb.TranslateResponse]) -> list[list[tuple[str, int, int]]]:
        return [[(h.text, h.token_count, h.finish_reason) for t in r.translations for h in t.hypotheses] for r in responses]

    def scores(responses: list[pb.TranslateResponse]) -> list[float]:
        return [h.score for r in responses for t in r.translations for h in t.hypotheses]

    assert fields(actual) == fields(expected) and [r.model for r in actual] == [r.model for r in expected]
    assert scores(actual) == pytest.approx(scores(expected), abs=1e-4)


def test_stream_deltas_concatenate_to_the_unary_result(stub) -> None:  # type: ignore[no-untyped-def]
    for text in GERMAN:
        messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=text), timeout=30))
        assert messages[-1].final and all(not m.final for m in messages[:-1])
        unary = stub.Translate(texts_request(text), timeout=30).translations[0].hypotheses[0]
        assert "".join(m.text_delta for m in messages) == unary.text == messages[-1].hypotheses[0].text
        assert len(messages) > 2  # greedy text arrived in pieces, not only at the end
    options = pb.DecodingOptions(target_prefix="I see")
    messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=GERMAN[0], options=options), timeout=30))
    unary = stub.Translate(pb.TranslateRequest(texts=[GERMAN[0]], options=options), timeout=30).translations[0].hypotheses[0]
    assert "".join(m.text_delta for m in messages) == unary.text and unary.text.startswith("I see")


def test_beam_stream_sends_the_nbest_at_the_end(stub) -> None:  # type: ignore[no-untyped-def]
    messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=GERMAN[0], options=pb.DecodingOptions(beam_size=4, num_hypotheses=3)), timeout=30))
    assert len(messages) == 1 and messages[0].final and len(messages[0].hypotheses) == 3
    assert messages[0].text_delta == messages[0].hypotheses[0].text


def test_model_info_reports_model_provider_and_limits(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    settings = running.server.settings
    assert (info.source_language, info.target_language, info.precision) == ("de", "en", "fp32")
    assert info.execution_provider == "CPUExecutionProvider"
    assert info.limits.max_texts == settings.max_texts and info.limits.max_beam_size == settings.max_beam_size
    assert info.limits.max_output_tokens == running.server.runtime.config.max_positions
    assert info.limits.max_message_bytes == settings.max_message_bytes


def test_health_serving_and_reflection_lists_the_service(running: RunningServer) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(running.target) as channel:
        health_stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            assert health_stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {service.name for response in responses for service in response.list_services_response.service}
        # grpc.reflection.v1 (what current grpcurl and Postman ask first) has the v1alpha messages under another package name.
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)  # fmt: skip
        asked = [reflection_pb2.ServerReflectionRequest(list_services=""), reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)]
        listed, described = list(v1(iter(asked), timeout=10))
    assert SERVICE_NAME in names
    assert SERVICE_NAME in {service.name for service in listed.list_services_response.service}
    assert described.file_descriptor_response.file_descriptor_proto and not described.HasField("error_response")


# ---------------------------------------------------------------- hostile and edge inputs


def test_service_no_texts_is_invalid_argument(stub) -> None:  # type: ignore[no-untyped-def]
    code, details = code_of(stub.Translate, pb.TranslateRequest())
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "texts" in details


def test_service_blank_texts_translate_to_empty_without_the_engine(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    engines = running.server.scheduler.engines
    steps = [engine.profile.steps for engine in engines]
    response = stub.Translate(texts_request("", "   \t\n"), timeout=10)
    assert [t.hypotheses[0].text for t in response.translations] == ["", ""]
    assert [engine.profile.steps for engine in engines] == steps


def test_service_text_over_the_char_limit_names_it_before_tokenizing(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    limit = running.server.settings.max_chars_per_text
    code, details = code_of(stub.Translate, texts_request("ok", "x" * (limit + 1)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "texts[1]" in details and str(limit) in details and "max_chars_per_text" in details
    # Under the char limit but over the token limit: the token limit is named.
    many_tokens = " ".join(["hund"] * 150)[:limit]
    code, details = code_of(stub.Translate, texts_request(many_tokens))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "max_source_tokens" in details


def answered(running: RunningServer, method: str) -> dict[str, float]:
    """nmt_requests_total of `method` by code."""
    samples = scrape(running.server.metrics_port)
    return {dict(labels)["code"]: value for (name, labels), value in samples.items()
            if name == "nmt_requests_total" and dict(labels).get("method") == method}  # fmt: skip


def counted_once(running: RunningServer, before: dict[str, float], code: str) -> bool:
    after = answered(running, "Translate")
    return after.get(code, 0) == before.get(code, 0) + 1 and sum(after.values()) == sum(before.values()) + 1


@pytest.mark.parametrize(("times_the_limit", "compression"), [(1, None), (5, None), (2, grpc.Compression.Gzip), (40, grpc.Compression.Gzip)],
                         ids=["just over", "past grpc core's limit", "gzip to twice the limit", "gzip bomb"])  # fmt: skip
def test_service_message_over_max_message_bytes_is_resource_exhausted_and_counted_so(stub, running: RunningServer, times_the_limit: int,
                                                                                       compression: grpc.Compression | None) -> None:  # type: ignore[no-untyped-def]
    """Whether nmt-serve's handler answers it (up to grpc core's receive limit, 4x) or grpc core does (past it), the
    client gets RESOURCE_EXHAUSTED and nmt_requests_total counts RESOURCE_EXHAUSTED, once."""
    limit = running.server.settings.max_message_bytes
    before = answered(running, "Translate")
    code, details = code_of(stub.Translate, texts_request("a" * (times_the_limit * limit + 10)), compression=compression, timeout=30)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
    if times_the_limit < 4:  # ours: names the limit and the flag
        assert f"the limit is {limit} bytes" in details and "--max-message-bytes" in details
    assert wait_for(lambda: counted_once(running, before, "RESOURCE_EXHAUSTED"), 5), (before, answered(running, "Translate"))


def test_service_corrupt_compressed_message_is_internal_from_grpc_core_counted_once(running: RunningServer) -> None:
    """grpc core answers INTERNAL ("Decompression failed") and the handler cannot write its own status; it cannot tell
    this from core's size refusal either, and counts RESOURCE_EXHAUSTED (docs/api.md)."""
    before = answered(running, "Translate")
    ending = raw_call(running.server.port, frame(HEADERS, END_HEADERS, 1, request_headers(f"/{SERVICE_NAME}/Translate", ("grpc-encoding", "gzip"))),
                      frame(DATA, END_STREAM, 1, grpc_message(b"\x1f\x8b\x08\x00 not gzip", compressed=True)), wait_s=10)  # fmt: skip
    assert ending.how == "trailers" and ending.grpc_status == grpc.StatusCode.INTERNAL.value[0], ending
    assert wait_for(lambda: counted_once(running, before, "RESOURCE_EXHAUSTED"), 5), (before, answered(running, "Translate"))


def test_service_invalid_utf8_is_invalid_argument(running: RunningServer) -> None:
    # Field 1 (texts), wire type 2, three bytes that are not UTF-8.
    raw = b"\x0a\x03\xff\xfe\xfd"
    with grpc.insecure_channel(running.target) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as caught:
            call(raw, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in caught.value.details()


@pytest.mark.parametrize("text", ["Hund\x00Kaffee", "\x07\x1b[31m", "Kaffee ☕🙂", "مرحبا שלום", "e\u0301\u0301\u0301", "\ufeff\u200b"])
def test_service_odd_characters_translate_cleanly(stub, text: str) -> None:  # type: ignore[no-untyped-def]
    response = stub.Translate(texts_request(text, max_output_tokens=8), timeout=30)
    assert len(response.translations) == 1 and len(response.translations[0].hypotheses) == 1


def test_service_unknown_model_is_not_found(stub) -> None:  # type: ignore[no-untyped-def]
    code, details = code_of(stub.Translate, pb.TranslateRequest(texts=["Hund"], model="fr-en"))
    assert code is grpc.StatusCode.NOT_FOUND and "fr-en" in details


def test_service_unknown_model_echo_is_capped(stub) -> None:  # type: ignore[no-untyped-def]
    # 20,000 characters echoed whole would pass the client's 16 KiB metadata limit (RESOURCE_EXHAUSTED there).
    code, details = code_of(stub.Translate, pb.TranslateRequest(texts=["Hallo"], model="m" * 20_000), timeout=10)
    assert code is grpc.StatusCode.NOT_FOUND and "mmmm" in details and "20000 characters" in details
    assert len(details) <= 2 * ECHO_CHARS + 200


def test_status_for_caps_every_message() -> None:
    code, message = status_for(InvalidRequest("x" * 50_000))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.endswith("(50000 characters)") and len(message) <= MAX_DETAIL_CHARS + 40


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"beam_size": 0}, "beam_size"),
        ({"beam_size": 10**6}, "max_beam_size"),
        ({"beam_size": -3}, "beam_size"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"min_output_tokens": -5}, "min_output_tokens"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": float("inf")}, "length_penalty"),
        ({"repetition_penalty": float("-inf")}, "repetition_penalty"),
        ({"beam_size": 2, "num_hypotheses": 3}, "num_hypotheses"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ],
)
def test_service_bad_options_name_the_field_and_limit(stub, options: dict[str, object], named: str) -> None:  # type: ignore[no-untyped-def]
    code, details = code_of(stub.Translate, texts_request("Hund", **options))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and named in details and ("between" in details or "at least" in details or "at most" in details)


def test_service_max_output_tokens_beyond_positions_is_clamped(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    positions = running.server.runtime.config.max_positions
    response = stub.Translate(texts_request("Hund", max_output_tokens=10**6, min_output_tokens=positions - 1), timeout=60)
    assert response.translations[0].hypotheses[0].token_count <= positions


def test_service_min_output_tokens_above_the_default_max_is_refused(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    # "Hund" is a token or two: the default max (1.5 x source tokens + 10) is far below this minimum.
    minimum = running.server.runtime.config.max_positions - 2
    code, details = code_of(stub.Translate, texts_request("Ich sehe den Hund.", "Hund", min_output_tokens=minimum), timeout=30)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "texts[0]" in details and "options.min_output_tokens" in details and "max_output_tokens" in details
    code, details = code_of(stub.TranslateStream, pb.TranslateStreamRequest(text="Hund", options=pb.DecodingOptions(min_output_tokens=minimum)), timeout=30)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "options.min_output_tokens" in details
    # The same minimum with a max that holds it is honoured.
    response = stub.Translate(texts_request("Hund", min_output_tokens=minimum, max_output_tokens=minimum), timeout=60)
    assert response.translations[0].hypotheses[0].token_count == minimum


def test_service_too_many_texts_names_the_cap(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    code, details = code_of(stub.Translate, texts_request(*(["Hund"] * 10_000)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "max_texts" in details and str(running.server.settings.max_texts) in details


def test_service_unknown_method_is_unimplemented(running: RunningServer) -> None:
    with grpc.insecure_channel(running.target) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Summarize", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_service_tiny_deadline_never_reaches_the_engine(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    code, _ = code_of(stub.Translate, texts_request("Ich sehe den Hund.", min_output_tokens=60, max_output_tokens=60), timeout=0.001)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.2)
    assert running.server.scheduler.running == 0 and running.server.scheduler.queue_depth == 0


def test_service_server_default_deadline_applies_when_the_client_sets_none(tiny_model_dir: Path) -> None:
    # Four rows per step: sixteen beam-4 texts of 90 tokens take over a thousand steps, far past 50 ms.
    with RunningServer(server_settings(tiny_model_dir, default_deadline_s=0.05, max_rows=4)) as server:
        channel, stub = server.stub()
        with channel:
            code, _ = code_of(stub.Translate, texts_request(*(GERMAN * 6)[:16], beam_size=4, min_output_tokens=90, max_output_tokens=90))
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_service_cancelled_stream_leaves_the_batch(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    scheduler = running.server.scheduler
    call = stub.TranslateStream(pb.TranslateStreamRequest(text=GERMAN[0], options=pb.DecodingOptions(min_output_tokens=90, max_output_tokens=90)), timeout=30)
    next(call)  # decoding has started
    call.cancel()
    deadline = time.monotonic() + 5
    while (scheduler.running or scheduler.queue_depth) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0 and scheduler.queue_depth == 0


def test_service_a_burst_is_served_or_rejected_fast(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, max_queued_requests=8)) as server:
        channel, stub = server.stub()
        request = texts_request("Ich sehe den Hund.", min_output_tokens=30, max_output_tokens=30)
        with channel, concurrent.futures.ThreadPoolExecutor(64) as pool:
            codes = list(pool.map(lambda _: code_of(stub.Translate, request, timeout=60)[0], range(300)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.OK) >= 8 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 0


def test_service_warming_up_is_unavailable_and_not_serving(tiny_model_dir: Path) -> None:
    running = RunningServer(server_settings(tiny_model_dir), hold_warm_up=True)
    with running:
        channel, stub = running.stub()
        with channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            assert health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details = code_of(stub.Translate, texts_request("Hund"), timeout=5)
            assert code is grpc.StatusCode.UNAVAILABLE and "warming up" in details
            running.release_warm_up()
            assert running.server.serving.wait(30)
            assert health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            assert stub.Translate(texts_request("Hund"), timeout=30).translations


def test_service_runtime_failure_fails_only_that_batch(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        decoder = server.server.runtime.decoder
        run, armed = decoder.run_with_iobinding, threading.Event()

        def failing_run(*args, **kwargs):  # type: ignore[no-untyped-def]
            if armed.is_set():
                armed.clear()
                raise RuntimeError("injected ONNX Runtime failure")
            return run(*args, **kwargs)

        decoder.run_with_iobinding = failing_run  # type: ignore[method-assign]
        channel, stub = server.stub()
        with channel:
            armed.set()
            code, details = code_of(stub.Translate, texts_request("Hund"), timeout=30)
            assert code is grpc.StatusCode.INTERNAL and "injected" not in details
            assert stub.Translate(texts_request("Hund"), timeout=30).translations  # still serving


def test_service_out_of_memory_is_resource_exhausted_for_that_request(tiny_model_dir: Path) -> None:
    """No GPU here: the allocation failure is injected as ONNX Runtime's CUDA provider words it."""
    with RunningServer(server_settings(tiny_model_dir)) as server:
        decoder = server.server.runtime.decoder
        run, armed = decoder.run_with_iobinding, threading.Event()

        def failing_run(*args, **kwargs):  # type: ignore[no-untyped-def]
            if armed.is_set():
                armed.clear()
                raise RuntimeError("CUDA failure 2: out of memory ; GPU=0 ; expr=cudaMalloc((void**)&p, size);")
            return run(*args, **kwargs)

        decoder.run_with_iobinding = failing_run  # type: ignore[method-assign]
        channel, stub = server.stub()
        with channel:
            armed.set()
            code, details = code_of(stub.Translate, texts_request("Hund"), timeout=30)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in details and "cudaMalloc" not in details
            assert stub.Translate(texts_request("Hund"), timeout=30).translations  # still serving


def test_service_bearer_token_is_required_when_configured(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, auth_token="s3cret")) as server:
        channel, stub = server.stub()
        with channel:
            assert code_of(stub.Translate, texts_request("Hund"), timeout=10)[0] is grpc.StatusCode.UNAUTHENTICATED
            wrong = (("authorization", "Bearer nope"),)
            assert code_of(stub.Translate, texts_request("Hund"), timeout=10, metadata=wrong)[0] is grpc.StatusCode.UNAUTHENTICATED
            stream = pb.TranslateStreamRequest(text="Hund")
            assert code_of(stub.TranslateStream, stream, timeout=10)[0] is grpc.StatusCode.UNAUTHENTICATED
            right = (("authorization", "Bearer s3cret"),)
            assert stub.Translate(texts_request("Hund"), timeout=30, metadata=right).translations
            for twice in (right + wrong, wrong + right):  # two entries: refused whichever comes last
                assert code_of(stub.Translate, texts_request("Hund"), timeout=10, metadata=twice)[0] is grpc.StatusCode.UNAUTHENTICATED
            # Health stays open to probes that carry no token.
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_service_garbage_on_the_socket_leaves_the_server_answering(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    import random
    import socket

    rng = random.Random(13)
    host, port = running.target.rsplit(":", 1)
    for size in (1, 9, 24, 100, 5000):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            # Random bytes, then an HTTP/2 preface cut short mid-frame.
            raw.sendall(bytes(rng.randrange(256) for _ in range(size)))
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03")
    assert stub.Translate(texts_request("Hund"), timeout=30).translations


# ---------------------------------------------------------------- split_sentences


PARAGRAPH = "  Ich sehe den Hund.\n\nWir mag Kaffee heute.   Du habe einen großen Zug nicht.\n"
PARAGRAPH_GAPS = ("  ", "\n\n", "   ", "\n")  # the whitespace around and between its three sentences


def alone(stub, text: str, **options: object) -> list[pb.Hypothesis]:  # type: ignore[no-untyped-def]
    """The n-best of `text` sent whole, as one input."""
    return list(stub.Translate(texts_request(text, split_sentences=False, **options), timeout=30).translations[0].hypotheses)


def test_split_sentences_joins_each_sentence_alone_between_the_original_whitespace(stub) -> None:  # type: ignore[no-untyped-def]
    bests = [alone(stub, sentence)[0] for sentence in GERMAN]
    response = stub.Translate(texts_request(PARAGRAPH, GERMAN[0]), timeout=30)
    gaps = PARAGRAPH_GAPS
    expected = gaps[0] + bests[0].text + gaps[1] + bests[1].text + gaps[2] + bests[2].text + gaps[3]
    joined, single = response.translations[0].hypotheses[0], response.translations[1].hypotheses[0]
    assert joined.text == expected
    assert joined.token_count == sum(best.token_count for best in bests)
    weights = [best.token_count + (best.finish_reason == pb.FINISH_REASON_EOS) for best in bests]
    assert joined.score == pytest.approx(sum(b.score * w for b, w in zip(bests, weights, strict=True)) / sum(weights), abs=1e-4)
    # One sentence: its own hypothesis, unchanged (the score to 1e-4: see assert_same_responses)
    assert (single.text, single.token_count, single.finish_reason) == (bests[0].text, bests[0].token_count, bests[0].finish_reason)
    assert single.score == pytest.approx(bests[0].score, abs=1e-4)


def test_split_sentences_nbest_joins_the_kth_best_of_each_sentence(stub) -> None:  # type: ignore[no-untyped-def]
    options = {"beam_size": 3, "num_hypotheses": 3}
    nbests = [alone(stub, sentence, **options) for sentence in GERMAN]
    hypotheses = stub.Translate(texts_request(PARAGRAPH, **options), timeout=30).translations[0].hypotheses
    assert len(hypotheses) == max(len(nbest) for nbest in nbests)
    gaps = PARAGRAPH_GAPS
    for rank, hypothesis in enumerate(hypotheses):
        picks = [nbest[min(rank, len(nbest) - 1)] for nbest in nbests]
        assert hypothesis.text == gaps[0] + picks[0].text + gaps[1] + picks[1].text + gaps[2] + picks[2].text + gaps[3]
        assert hypothesis.token_count == sum(pick.token_count for pick in picks)


def test_split_sentences_finish_reason_is_length_when_any_sentence_is_cut(stub) -> None:  # type: ignore[no-untyped-def]
    # max_output_tokens applies to each sentence; sent whole, the text has it once.
    split = stub.Translate(texts_request(PARAGRAPH, max_output_tokens=2), timeout=30).translations[0].hypotheses[0]
    whole = alone(stub, PARAGRAPH, max_output_tokens=2)[0]
    assert split.finish_reason == whole.finish_reason == pb.FINISH_REASON_LENGTH
    assert split.token_count == 3 * 2 and whole.token_count == 2
    # Without a cap, LENGTH exactly when some sentence alone ends with LENGTH (the tiny model often runs to its limit).
    normal = stub.Translate(texts_request(PARAGRAPH), timeout=30).translations[0].hypotheses[0]
    cut = any(alone(stub, sentence)[0].finish_reason == pb.FINISH_REASON_LENGTH for sentence in GERMAN)
    assert normal.finish_reason == (pb.FINISH_REASON_LENGTH if cut else pb.FINISH_REASON_EOS)


def test_split_sentences_off_sends_the_text_whole(stub) -> None:  # type: ignore[no-untyped-def]
    whole = alone(stub, PARAGRAPH)[0]
    split = stub.Translate(texts_request(PARAGRAPH), timeout=30).translations[0].hypotheses[0]
    assert not whole.text.startswith(" ") and split.text.startswith("  ")  # only a split text keeps the source's whitespace
    # One input: one max_output_tokens for the whole text, where the split text has it per sentence.
    assert alone(stub, PARAGRAPH, max_output_tokens=3)[0].token_count <= 3


def test_split_sentences_blank_text_stays_empty(stub) -> None:  # type: ignore[no-untyped-def]
    response = stub.Translate(texts_request(" \n\n ", "", PARAGRAPH), timeout=30)
    assert [t.hypotheses[0].text for t in response.translations[:2]] == ["", ""]
    assert response.translations[2].hypotheses[0].text.startswith("  ")


def test_split_sentences_target_prefix_forces_the_first_sentence_only(stub) -> None:  # type: ignore[no-untyped-def]
    text = stub.Translate(texts_request(PARAGRAPH, target_prefix="I see"), timeout=30).translations[0].hypotheses[0].text
    rest = [alone(stub, sentence)[0].text for sentence in GERMAN[1:]]
    assert text.startswith("  I see") and text.endswith(f"\n\n{rest[0]}   {rest[1]}\n")


def test_split_sentences_over_the_sentence_limit_names_the_field_and_limit(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    limit = running.server.settings.max_sentences_per_text
    many = "Ja. " * (limit + 1)
    code, details = code_of(stub.Translate, texts_request("Hund.", many), timeout=30)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"texts[1] has more than {limit} sentences; the limit is {limit} (max_sentences_per_text, set by nmt-serve "
                              "--max-sentences-per-text); split the text into shorter texts, or set options.split_sentences to false")  # fmt: skip
    code, details = code_of(stub.TranslateStream, pb.TranslateStreamRequest(text=many), timeout=30)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"text has more than {limit} sentences")
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.limits.max_sentences_per_text == limit


def test_split_sentences_request_over_the_queue_is_invalid_not_exhausted(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    """Each sentence takes a place of the queue; a request with more sentences than it has places could never be
    admitted, on an idle server too, so it is refused as invalid (a client would retry RESOURCE_EXHAUSTED)."""
    places = running.server.settings.max_queued_requests
    half = "Ja. " * (places // 2 + 1)  # two texts, each under the sentence limit, together over the queue
    code, details = code_of(stub.Translate, texts_request(half, half), timeout=30)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == (f"texts hold {2 * (places // 2 + 1)} sentences; a request may hold at most {places}, the places of the server's queue "
                       "(set by nmt-serve --max-queued-requests); send fewer texts per request (nmt-translate --batch N sends N per request)")  # fmt: skip
    assert stub.Translate(texts_request(half), timeout=30).translations[0].hypotheses[0].text  # one of them is admitted


def test_split_sentences_long_sentence_names_text_sentence_and_token_limit(stub, running: RunningServer) -> None:  # type: ignore[no-untyped-def]
    first = "Ich sehe den Hund. "
    long_text = first + " ".join(["Hund"] * 150)[: running.server.settings.max_chars_per_text - len(first)]
    code, details = code_of(stub.Translate, texts_request("Hund.", long_text), timeout=30)
    limit = running.server.runtime.config.max_positions - 1
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("texts[1] sentence 1 has ") and details.endswith(f"tokens; the limit is {limit} (max_source_tokens, the model's positions less one); split it into shorter sentences")


def test_split_sentences_greedy_stream_sends_each_sentence_in_order(stub) -> None:  # type: ignore[no-untyped-def]
    messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=PARAGRAPH), timeout=30))
    unary = stub.Translate(texts_request(PARAGRAPH), timeout=30).translations[0]
    assert messages[-1].final and all(not m.final for m in messages[:-1])
    assert "".join(m.text_delta for m in messages) == unary.hypotheses[0].text == messages[-1].hypotheses[0].text
    # The first sentence's text (after the leading whitespace) comes before the second sentence's.
    first = alone(stub, GERMAN[0])[0].text
    sent_before_final = "".join(m.text_delta for m in messages[:-1])
    assert sent_before_final.startswith("  " + first + "\n\n") and len(messages) > 3


def test_split_sentences_beam_stream_sends_the_joined_nbest_at_the_end(stub) -> None:  # type: ignore[no-untyped-def]
    options = pb.DecodingOptions(beam_size=3, num_hypotheses=2)
    messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=PARAGRAPH, options=options), timeout=30))
    unary = stub.Translate(pb.TranslateRequest(texts=[PARAGRAPH], options=options), timeout=30).translations[0]
    assert len(messages) == 1 and messages[0].final and messages[0].text_delta == unary.hypotheses[0].text
    assert [h.text for h in messages[0].hypotheses] == [h.text for h in unary.hypotheses]
