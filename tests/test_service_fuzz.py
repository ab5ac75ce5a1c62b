"""Fuzzing a real server (control characters, out-of-range options, random bytes): no call ends in UNKNOWN and the server keeps answering."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.server.api.service import SERVICE_NAME
from tests.serving import RunningServer, server_settings

EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
ints = st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1), st.integers(-2, 12))
floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 3, width=32))
texts = st.text(st.characters(codec="utf-8"), max_size=40)


@st.composite
def requests(draw: st.DrawFn) -> pb.TranslateRequest:
    options = {
        "beam_size": draw(ints), "num_hypotheses": draw(ints), "length_penalty": draw(floats),
        # Kept short so that valid requests stay cheap: the point is the edges, not long decodes.
        "max_output_tokens": draw(st.one_of(st.none(), st.integers(-(2**31), 12))), "min_output_tokens": draw(ints),
        "repetition_penalty": draw(floats), "no_repeat_ngram_size": draw(ints), "target_prefix": draw(st.one_of(st.none(), texts)),
    }  # fmt: skip
    model = draw(st.sampled_from(["", "", "", "de-en-tiny", "x" * 300]))
    return pb.TranslateRequest(texts=draw(st.lists(texts, max_size=20)), model=model,
                               options=pb.DecodingOptions(**{k: v for k, v in options.items() if v is not None}))  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[tuple[RunningServer, grpc.Channel]]:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        with grpc.insecure_channel(server.target) as channel:
            yield server, channel


def call_code(call, payload, seen: collections.Counter) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call(payload, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    seen[code] += 1
    return code


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_fuzzed_requests_never_end_unknown(fuzz_server: tuple[RunningServer, grpc.Channel]) -> None:
    server, channel = fuzz_server
    translate = channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=pb.TranslateRequest.SerializeToString,
                                    response_deserializer=pb.TranslateResponse.FromString)  # fmt: skip
    raw = channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(request=requests())
    def structured(request: pb.TranslateRequest) -> None:
        assert call_code(translate, request, seen) in EXPECTED

    @settings(max_examples=1000, deadline=None, database=None)
    @given(payload=st.binary(max_size=300))
    def random_bytes(payload: bytes) -> None:
        # Random bytes either parse as some TranslateRequest or are refused as unparsable.
        assert call_code(raw, payload, seen) in EXPECTED

    structured()
    random_bytes()
    assert sum(seen.values()) >= 2000 and seen[grpc.StatusCode.UNKNOWN] == 0
    assert seen[grpc.StatusCode.OK] > 0 and seen[grpc.StatusCode.INVALID_ARGUMENT] > 0  # both sides were reached
    response = translate(pb.TranslateRequest(texts=["Ich sehe den Hund."]), timeout=30)  # still answering
    assert response.translations[0].hypotheses


def test_scores_are_finite_for_valid_fuzzed_options(fuzz_server: tuple[RunningServer, grpc.Channel]) -> None:
    _, channel = fuzz_server
    translate = channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=pb.TranslateRequest.SerializeToString,
                                    response_deserializer=pb.TranslateResponse.FromString)  # fmt: skip
    request = pb.TranslateRequest(texts=["Hund", "☕"], options=pb.DecodingOptions(beam_size=4, num_hypotheses=4, length_penalty=0.0,
                                                                                    repetition_penalty=3.0, no_repeat_ngram_size=1))  # fmt: skip
    for translation in translate(request, timeout=30).translations:
        assert all(math.isfinite(h.score) for h in translation.hypotheses)
