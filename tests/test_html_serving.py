"""options.format "html" through a real server: the page's tree comes back unchanged and each text node holds the
translation that node gets as plain text; streaming sends the page once; bad values are INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt_serve.model.html_text import parse_html
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, server_settings
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


def test_html_page_keeps_its_tree_and_each_text_node_gets_its_own_translation(served: RunningServer) -> None:
    (page,) = call(served, [PAGE], format="html")
    document = parse_html(PAGE)
    nodes = call(served, list(document.texts))  # each node alone, as plain text
    assert page.hypotheses[0].text == document.render([node.hypotheses[0].text for node in nodes])
    assert tree(page.hypotheses[0].text) == tree(PAGE)
    for kept in ("<pre>Ich sehe den Hund</pre>", '<p translate="no">Ich sehe den Hund</p>', "<code>/etc/fstab</code>", "Strg+Alt+T"):
        assert kept in page.hypotheses[0].text
    assert page.hypotheses[0].token_count == sum(node.hypotheses[0].token_count for node in nodes)


def test_html_stream_sends_the_page_once(served: RunningServer) -> None:
    channel, stub = served.stub()
    with channel:
        messages = list(stub.TranslateStream(pb.TranslateStreamRequest(text=PAGE, options=pb.DecodingOptions(format="html")), timeout=30))
    assert len(messages) == 1 and messages[0].final
    assert messages[0].text_delta == messages[0].hypotheses[0].text == call(served, [PAGE], format="html")[0].hypotheses[0].text


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
