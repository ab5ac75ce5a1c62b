"""Verbatim spans through a real server: detected and kept spans come back unchanged (unary, streaming, n-best, HTTP,
an imported model), the options are validated, and a text made only of spans never reaches the engine."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt_serve.bench.balancer import free_port
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, held_engines, server_settings

# Each text holds spans of several rules; the tiny model, trained on a toy lexicon, could never write any of them itself.
TEXTS = {
    "Ich sehe /etc/fstab heute.": ["/etc/fstab"],
    "Wir mag `make test` und https://example.org/hund?x=1 morgen.": ["`make test`", "https://example.org/hund?x=1"],
    "Du hast %1$d Hund in {name} mit Strg+Alt+T.": ["%1$d", "{name}", "Strg+Alt+T"],
    "Ich sehe den Hund. Schreiben Sie an users@de.libreoffice.org oder C:\\Temp\\bericht.odt heute.": ["users@de.libreoffice.org",
                                                                                                        "C:\\Temp\\bericht.odt"],
}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir, http_port=free_port())) as server:
        yield server


def translate(server: RunningServer, texts: list[str], **options: object) -> list[pb.Translation]:
    channel, stub = server.stub()
    with channel:
        return list(stub.Translate(pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(**options)), timeout=30).translations)


@pytest.mark.parametrize("beam", [1, 3])
def test_detected_spans_come_back_unchanged_in_every_hypothesis(served: RunningServer, beam: int) -> None:
    translations = translate(served, list(TEXTS), beam_size=beam, num_hypotheses=beam)
    for spans, translation in zip(TEXTS.values(), translations, strict=True):
        for hypothesis in translation.hypotheses:
            assert all(span in hypothesis.text for span in spans), (spans, hypothesis.text)


def test_without_detection_the_model_translates_the_spans_too(served: RunningServer) -> None:
    translations = translate(served, list(TEXTS), detect_verbatim=False)
    for spans, translation in zip(TEXTS.values(), translations, strict=True):
        assert not any(span in translation.hypotheses[0].text for span in spans)


def test_stream_sends_spans_in_place_and_deltas_add_up(served: RunningServer) -> None:
    channel, stub = served.stub()
    with channel:
        for text, spans in TEXTS.items():
            messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=text), timeout=30))
            final = messages[-1].hypotheses[0].text
            assert "".join(message.text_delta for message in messages) == final
            assert all(span in final for span in spans)
            assert final == translate(served, [text])[0].hypotheses[0].text


def test_keep_strings_and_ranges_come_back_unchanged(served: RunningServer) -> None:
    text = "Ich sehe Bello und Hasso heute."
    keep = [pb.KeepSpan(text="Bello"), pb.KeepSpan(range=pb.CharRange(start=19, end=24))]
    (translation,) = translate(served, [text], keep=keep)
    assert "Bello" in translation.hypotheses[0].text and "Hasso" in translation.hypotheses[0].text
    assert "Bello" not in translate(served, [text])[0].hypotheses[0].text


def test_a_text_of_spans_only_comes_back_unchanged_without_the_engine(served: RunningServer) -> None:
    text = "  /etc/fstab, ~/.bashrc und $HOME  "
    with held_engines(served) as gate:  # no step passes: an answer proves no engine job was made
        gate.allow(0)
        (translation,) = translate(served, [text.replace(" und ", ", ")])
        channel, stub = served.stub()
        with channel:
            messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=text.replace(" und ", ", ")), timeout=30))
    assert translation.hypotheses[0].text == text.replace(" und ", ", ")
    assert messages[-1].final and messages[-1].text_delta == messages[-1].hypotheses[0].text == text.replace(" und ", ", ")
    assert translate(served, ["   "])[0].hypotheses[0].text == ""  # a blank text is still an empty translation


@pytest.mark.parametrize(("keep", "named"), [
    ([pb.KeepSpan()], "options.keep[0] must set text or range"),
    ([pb.KeepSpan(text="")], "options.keep[0].text must not be empty"),
    ([pb.KeepSpan(text="x" * 401)], "options.keep[0].text has 401 characters; the limit is 400"),
    ([pb.KeepSpan(range=pb.CharRange(start=3, end=3))], "options.keep[0].range must have 0 <= start < end, got start 3, end 3"),
    ([pb.KeepSpan(text="a"), pb.KeepSpan(range=pb.CharRange(start=-1, end=2))], "options.keep[1].range must have 0 <= start < end"),
    ([pb.KeepSpan(range=pb.CharRange(start=0, end=12))], "options.keep[0].range ends at 12, past the end of texts[1] (4 characters)"),
    ([pb.KeepSpan(text="a")] * 65, "options.keep holds 65 entries; the limit is 64"),
])  # fmt: skip
def test_bad_keep_entries_are_invalid_argument_naming_the_entry(served: RunningServer, keep: list[pb.KeepSpan], named: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        translate(served, ["Ich sehe den Hund.", "Hund"], keep=keep)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and named in caught.value.details(), caught.value.details()


def test_http_api_takes_keep_and_detect_verbatim(served: RunningServer) -> None:
    body = {"texts": ["Ich sehe Bello in /etc/fstab."], "options": {"keep": [{"text": "Bello"}], "detect_verbatim": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{served.server.http.port}/v1/translate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        text = json.loads(response.read())["translations"][0]["hypotheses"][0]["text"]
    assert "Bello" in text and "/etc/fstab" in text


def test_model_info_reports_the_keep_limit(served: RunningServer) -> None:
    channel, stub = served.stub()
    with channel:
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).limits.max_keep_spans == 64


def test_spans_survive_on_an_imported_model(imported_marian: Path) -> None:
    """The same mechanism on a model imported with nmt-import (a tiny random Marian model): no model learns to copy anything."""
    out = imported_marian
    with RunningServer(server_settings(out / "onnx-fp32")) as server:
        translations = translate(server, list(TEXTS))
    for spans, translation in zip(TEXTS.values(), translations, strict=True):
        assert all(span in translation.hypotheses[0].text for span in spans), (spans, translation.hypotheses[0].text)
