"""HTML for translation (model/html_text.py): on hand-written and real pages, the markup comes back unchanged, every
block's inline flow and alt/title value is handed out once, a sentence flows through inline tags, and code, pre,
script, style and translate="no" are left alone."""

from __future__ import annotations

import glob
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from nmt_serve.model.html_text import HTML_SPACE, TRANSLATED_ATTRIBUTES, parse_html
from nmt_serve.model.inline_tags import MATCHED

PAGE = """<!DOCTYPE html>
<html><head><title>Hilfe &amp; Tipps</title><style>p { color: red; }</style><script>var x = "<b>";</script></head>
<body>
  <!-- Kommentar -->
  <p class="x">Klicken Sie auf <b>Datei</b>, um&nbsp;zu öffnen.<br>Neue Zeile</p>
  <img src="a.png" alt="Ein Bild" title=Titel>
  <pre>Code   bleibt</pre><code>x &lt; y</code>
  <p translate="no">Nicht <i>übersetzen</i> <img alt="auch nicht"></p>
  <a href="https://x.org" title='Link &quot;da&quot;'>Hier</a>
</body></html>"""
# Real pages from Debian packages' documentation, where installed.
# Some packages install a directory named *.html (libexpat1-dev's expat.html): pages are files only.
REAL_PAGES = sorted(path for path in glob.glob("/usr/share/doc/*/html/*.html") + glob.glob("/usr/share/doc/*/*.html") if os.path.isfile(path))[:40]


class Tree(HTMLParser):
    """What must not change: every tag with its attributes (alt/title values aside: the tests check the kept ones
    themselves), comments and declarations."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.events: list[tuple[object, ...]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.events.append(("start", tag, tuple((name, "*" if name in TRANSLATED_ATTRIBUTES else value) for name, value in attrs)))

    def handle_endtag(self, tag: str) -> None:
        self.events.append(("end", tag))

    def handle_comment(self, data: str) -> None:
        self.events.append(("comment", data))

    def handle_decl(self, decl: str) -> None:
        self.events.append(("decl", decl))


def tree(page: str) -> list[tuple[object, ...]]:
    parser = Tree()
    parser.feed(page)
    parser.close()
    return parser.events


def translated(page: str) -> tuple[str, list[str]]:
    """The page with every text replaced by a mark of its index; the probes' marks never occur in a flow's, so every inline
    tag takes the fallback place (inline_tags' "relative")."""
    document = parse_html(page)
    marks = [f"«{index}»" for index in range(len(document.texts))]
    return document.render(marks), [text for index, text in enumerate(document.texts) if index not in document.probes]


def test_flows_alt_title_values_and_probes_are_handed_out_in_page_order() -> None:
    document = parse_html(PAGE)
    assert document.texts == ("Hilfe & Tipps", "Klicken Sie auf Datei, um\xa0zu öffnen.", "Datei", "Neue Zeile", "Ein Bild", "Titel",
                              'Link "da"', "Hier")  # fmt: skip
    assert document.probes == {2}


def test_untranslated_elements_and_markup_come_back_as_written() -> None:
    page, _ = translated(PAGE)
    for kept in ("<style>p { color: red; }</style>", '<script>var x = "<b>";</script>', "<pre>Code   bleibt</pre>", "<code>x &lt; y</code>",
                 '<p translate="no">Nicht <i>übersetzen</i> <img alt="auch nicht"></p>', "<!-- Kommentar -->", "<!DOCTYPE html>",
                 '<p class="x"><b>«1»</b><br>«3»</p>', '<img src="a.png" alt="«4»" title="«5»">'):  # fmt: skip
        assert kept in page, kept
    assert tree(page) == tree(PAGE)


def test_translations_are_escaped_for_where_they_stand() -> None:
    document = parse_html('<p title="t">a</p>')
    assert document.render(['"x" & <y>', "1 < 2 & 3"]) == '<p title="&quot;x&quot; &amp; &lt;y&gt;">1 &lt; 2 &amp; 3</p>'


def test_whitespace_around_text_nodes_is_kept() -> None:
    document = parse_html("<li>\n   Eins  \n</li>")
    assert document.texts == ("Eins",) and document.render(["One"]) == "<li>\n   One  \n</li>"


def test_a_page_without_text_renders_as_it_came() -> None:
    document = parse_html("<div>\n  <br/>\n</div>")
    assert document.texts == () and document.render([]) == "<div>\n  <br/>\n</div>"


@pytest.mark.skipif(not REAL_PAGES, reason="no HTML documentation under /usr/share/doc")
@pytest.mark.parametrize("path", REAL_PAGES, ids=[Path(path).parent.name + "/" + Path(path).name for path in REAL_PAGES])
def test_real_pages_keep_their_tree_and_hand_out_every_text_node(path: str) -> None:
    page = Path(path).read_text(encoding="utf-8", errors="replace")
    document = parse_html(page)
    rendered, _ = translated(page)
    assert tree(rendered) == tree(page)
    shown = [index for index in range(len(document.texts)) if index not in document.probes]
    assert all(f"«{index}»" in rendered for index in shown)
    assert all(text.strip(HTML_SPACE) == text != "" for text in document.texts)
    # Each probe's translation found in its flow's: every inline tag placed by a match, the tree unchanged again.
    words = [text.upper() for text in document.texts]
    assert tree(document.render(words)) == tree(page)
    assert all(placement.method in MATCHED + ("empty",) for placement in document.placements(words))


def rendered_with(page: str, translations: dict[str, str]) -> str:
    """The page rendered with the given translation of each text handed out (a text not given comes back as it was)."""
    document = parse_html(page)
    return document.render([translations.get(text, text) for text in document.texts])


def test_a_sentence_flows_through_an_inline_element_and_the_tag_goes_around_its_translation() -> None:
    page = "<p>Klicken Sie auf <b>Datei</b>, um die Datei zu speichern.</p>"
    assert parse_html(page).texts == ("Klicken Sie auf Datei, um die Datei zu speichern.", "Datei")
    translations = {"Klicken Sie auf Datei, um die Datei zu speichern.": "Click File to save the file.", "Datei": "File"}
    assert rendered_with(page, translations) == "<p>Click <b>File</b> to save the file.</p>"


def test_nested_elements_with_attributes_and_several_in_a_block() -> None:
    page = ('<p>Lesen Sie <a href="hilfe.html" class="x" title="Die Hilfe">die <em>ganze</em> Hilfe</a> und '
            "<strong>speichern</strong> Sie &amp; schließen Sie.</p>")  # fmt: skip
    translations = {"Lesen Sie die ganze Hilfe und speichern Sie & schließen Sie.": "Read the whole help and save & close.",
                    "Die Hilfe": "The help", "die ganze Hilfe": "the whole help", "ganze": "whole", "speichern": "Save"}  # fmt: skip
    assert rendered_with(page, translations) == ('<p>Read <a href="hilfe.html" class="x" title="The help">the <em>whole</em> help</a> and '
                                                 "<strong>save</strong> &amp; close.</p>")  # fmt: skip


def test_an_element_kept_as_written_stays_a_verbatim_span_inside_the_sentence() -> None:
    page = '<p>Öffnen Sie <code>a &lt; b</code> mit <span translate="no">Kate</span> <i>jetzt</i>.</p>'
    document = parse_html(page)
    (flow,) = [text for index, text in enumerate(document.texts) if index not in document.probes]
    first, second = sorted(document.placeholders, key=flow.index)
    assert flow == f"Öffnen Sie {first} mit {second} jetzt." and document.kept_spans(flow) == [(11, 12), (17, 18)]
    translations = {flow: f"Open {first} with {second} now.", "jetzt": "now"}
    assert rendered_with(page, translations) == '<p>Open <code>a &lt; b</code> with <span translate="no">Kate</span> <i>now</i>.</p>'


def test_the_placeholders_are_characters_the_page_does_not_hold() -> None:
    page = "<p>Privat \ue000 <kbd>F1</kbd> drücken</p>"
    assert "\ue000" not in parse_html(page).placeholders and len(parse_html(page).placeholders) == 1


@pytest.mark.parametrize("page", [
    "<p>Ein <b>fetter <div>Block</div> Text</b> hier.</p>",  # an inline element cut by a block: each text node on its own
    "<p>Ein <b>offenes Element</p><p>und weiter</p>",  # never closed
    "<p>Zeile <b>eins<br>zwei</b> drei</p>",  # a line break ends the flow
])  # fmt: skip
def test_inline_elements_that_do_not_close_within_their_flow_leave_each_text_node_on_its_own(page: str) -> None:
    document = parse_html(page)
    assert not document.probes and all("<" not in text for text in document.texts)
    rendered, _ = translated(page)
    assert tree(rendered) == tree(page)


def test_a_translation_that_lost_a_placeholder_still_keeps_the_tree() -> None:
    page = "<p>Drücken Sie <b>jetzt <kbd>F1</kbd></b> oder <kbd>F2</kbd>.</p>"
    rendered, _ = translated(page)  # the marks hold no placeholder
    assert tree(rendered) == tree(page) and "<kbd>F1</kbd>" in rendered and "<kbd>F2</kbd>" in rendered
