"""HTML for translation (model/html_text.py): on hand-written and real pages, the markup comes back unchanged, every
text node and alt/title value is handed out once, and code, pre, script, style and translate="no" are left alone."""

from __future__ import annotations

import glob
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from nmt_serve.model.html_text import HTML_SPACE, TRANSLATED_ATTRIBUTES, parse_html

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
    document = parse_html(page)
    marks = [f"«{index}»" for index in range(len(document.texts))]
    return document.render(marks), list(document.texts)


def test_text_nodes_and_alt_title_values_are_handed_out_in_page_order() -> None:
    assert parse_html(PAGE).texts == ("Hilfe & Tipps", "Klicken Sie auf", "Datei", ", um\xa0zu öffnen.", "Neue Zeile", "Ein Bild", "Titel",
                                      'Link "da"', "Hier")  # fmt: skip


def test_untranslated_elements_and_markup_come_back_as_written() -> None:
    page, _ = translated(PAGE)
    for kept in ("<style>p { color: red; }</style>", '<script>var x = "<b>";</script>', "<pre>Code   bleibt</pre>", "<code>x &lt; y</code>",
                 '<p translate="no">Nicht <i>übersetzen</i> <img alt="auch nicht"></p>', "<!-- Kommentar -->", "<!DOCTYPE html>",
                 '<p class="x">«1» <b>«2»</b>«3»<br>«4»</p>', '<img src="a.png" alt="«5»" title="«6»">'):  # fmt: skip
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
    rendered, texts = translated(page)
    assert tree(rendered) == tree(page)
    assert all(f"«{index}»" in rendered for index in range(len(texts)))
    assert all(text.strip(HTML_SPACE) == text != "" for text in texts)
