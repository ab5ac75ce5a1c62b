"""options.format "html" through a real server: the page's tree comes back unchanged and each text holds the translation
it gets as plain text; a sentence cut by an inline element is one engine input; streaming sends the page part by part; bad
values are INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt_serve.model.html_text import parse_html
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, scrape, server_settings, total
from tests.test_html_text import tree

PAGE = """<html><head><title>Ich sehe den Hund</title></head>
<body><p>Ich sehe <b>den Hund</b> heute. Wir mag Kaffee.</p>
<img src="hund.png" alt="Ein Hund"><pre>Ich sehe den Hund</pre>
<p translate="no">Ich sehe den Hund</p><p>Öffnen Sie <code>/etc/fstab</code> mit Strg+Alt+T.</p></body></html>"""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with RunningServer(server_settings(tiny_model_dir)) as server:
        yield server


def call(server: RunningServer, texts: list[str], **options: object) -> list[pb.Translation]:
    channel, stub = server.stub()
    with channel:
        return list(stub.Translate(pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(**options)), timeout=30).translations)


def test_html_page_keeps_its_tree_and_each_text_gets_its_own_translation(served: RunningServer) -> None:
    (page,) = call(served, [PAGE], format="html")
    document = parse_html(PAGE)
    # Each text alone, as plain text; the placeholders of kept inline elements kept as the server keeps them.
    nodes = call(served, list(document.texts), keep=[pb.KeepSpan(text=character) for character in document.placeholders])
    assert page.hypotheses[0].text == document.render([node.hypotheses[0].text for node in nodes])
    assert tree(page.hypotheses[0].text) == tree(PAGE)
    for kept in ("<pre>Ich sehe den Hund</pre>", '<p translate="no">Ich sehe den Hund</p>', "<code>/etc/fstab</code>", "Strg+Alt+T"):
        assert kept in page.hypotheses[0].text
    shown = [node for index, node in enumerate(nodes) if index not in document.probes]
    assert page.hypotheses[0].token_count == sum(node.hypotheses[0].token_count for node in shown)


def test_a_sentence_cut_by_an_inline_element_is_one_engine_input(tiny_model_dir: Path) -> None:
    with RunningServer(server_settings(tiny_model_dir, cache_mb=1)) as server:
        (page,) = call(server, ["<p>Ich sehe <b>den Hund</b> heute.</p>"], format="html")
        misses = total(scrape(server.server.metrics_port), "nmt_cache_misses_total")
        call(server, ["Ich sehe den Hund heute."])  # the whole sentence, as the engine saw it: in the cache
        samples = scrape(server.server.metrics_port)
    # Two engine inputs: the sentence and the element's own text (to place its tags); not three pieces.
    assert misses == 2 and total(samples, "nmt_cache_hits_total") == 1
    assert tree(page.hypotheses[0].text) == tree("<p>Ich sehe <b>den Hund</b> heute.</p>")


def test_html_stream_sends_the_page_part_by_part_and_the_deltas_join_to_the_page(served: RunningServer) -> None:
    channel, stub = served.stub()
    with channel:
        messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=PAGE, options=pb.DecodingOptions(format="html")), timeout=30))
    assert len(messages) > 1 and messages[-1].final and not any(message.final for message in messages[:-1])
    assert "".join(message.text_delta for message in messages) == messages[-1].hypotheses[0].text
    assert messages[-1].hypotheses[0].text == call(served, [PAGE], format="html")[0].hypotheses[0].text
    assert messages[0].text_delta.startswith("<html><head><title>")  # the title's block first, before the body is joined


def test_text_format_is_the_default_and_translates_markup_as_text(served: RunningServer) -> None:
    assert call(served, [PAGE], format="text") == call(served, [PAGE])
    assert call(served, [PAGE])[0].hypotheses[0].text != call(served, [PAGE], format="html")[0].hypotheses[0].text


@pytest.mark.parametrize(("options", "named"), [
    ({"format": "markdown"}, "options.format must be one of text, html, got 'markdown'"),
    ({"format": "html", "keep": [pb.KeepSpan(range=pb.CharRange(start=0, end=3))]}, "options.keep may hold no range when options.format is html"),
])  # fmt: skip
def test_bad_format_options_are_invalid_argument(served: RunningServer, options: dict[str, object], named: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call(served, [PAGE], **options)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and named in caught.value.details()
