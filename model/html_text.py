"""HTML for translation: the markup kept byte for byte, the text nodes and alt/title values handed out to translate.

The stdlib parser (html.parser) finds every tag, comment, declaration and text run; each keeps its
exact source text, so a page rendered back with its text nodes replaced has the same elements,
attributes, order, comments and whitespace-only runs as before. A text node is handed out whole (its
entities decoded) and its translation written back escaped (&, <, >); the text inside <code>, <pre>,
<script>, <style>, <kbd>, <samp>, <textarea> and any element with translate="no" is never handed
out, and neither are its attributes.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html.parser import HTMLParser

UNTRANSLATED_ELEMENTS = frozenset({"code", "pre", "script", "style", "kbd", "samp", "textarea"})
TRANSLATED_ATTRIBUTES = ("alt", "title")
HTML_SPACE = " \t\n\r\f"
VOID_ELEMENTS = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"})
# An attribute's value inside the exact text of a start tag the parser found: name, =, then a quoted or bare value.
_ATTRIBUTE_VALUE = re.compile(r"""\s(?P<name>[^\s"'>/=]+)\s*=\s*(?:"(?P<double>[^"]*)"|'(?P<single>[^']*)'|(?P<bare>[^\s"'=<>`]+))""")


@dataclass(frozen=True)
class Slot:
    """A place in the page for one translation: the text handed out, and whether it sits in an attribute value."""

    index: int
    in_attribute: bool


@dataclass(frozen=True)
class HtmlDocument:
    parts: tuple[str | Slot, ...]  # the page: source text kept as it is, and slots
    texts: tuple[str, ...]  # what each slot hands out to translate, in page order

    def render(self, translations: Sequence[str]) -> str:
        """The page with each slot's translation in its place, escaped for where it stands."""
        if len(translations) != len(self.texts):
            raise ValueError(f"{len(self.texts)} texts but {len(translations)} translations")
        return "".join(part if isinstance(part, str) else html.escape(translations[part.index], quote=part.in_attribute)
                       for part in self.parts)  # fmt: skip


def parse_html(page: str) -> HtmlDocument:
    """The page as kept parts and slots; text made only of whitespace is kept, not handed out."""
    parser = _Splitter(page)
    parser.feed(page)
    parser.close()
    return parser.document()


class _Splitter(HTMLParser):
    """Cuts the source at each construct the parser reports; every construct's exact text is source[start:next start]."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page
        self._line_starts = [0] + [index + 1 for index, character in enumerate(page) if character == "\n"]
        self._events: list[tuple[int, str, object]] = []  # (offset, kind, what) in source order
        self._open: list[tuple[str, bool]] = []  # open elements: (tag, whether its content is left untranslated)

    def _offset(self) -> int:
        line, column = self.getpos()
        return self._line_starts[line - 1] + column

    @property
    def _untranslated(self) -> bool:
        return bool(self._open) and self._open[-1][1]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        untranslated = self._untranslated or tag in UNTRANSLATED_ELEMENTS or dict(attrs).get("translate", "").lower() == "no"
        self._events.append((self._offset(), "tag", untranslated))
        if tag not in VOID_ELEMENTS:
            self._open.append((tag, untranslated))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        untranslated = self._untranslated or tag in UNTRANSLATED_ELEMENTS or dict(attrs).get("translate", "").lower() == "no"
        self._events.append((self._offset(), "tag", untranslated))

    def handle_endtag(self, tag: str) -> None:
        self._events.append((self._offset(), "end", True))
        for depth in range(len(self._open) - 1, -1, -1):  # close up to the matching element (unclosed inline ones too)
            if self._open[depth][0] == tag:
                del self._open[depth:]
                break

    def handle_data(self, data: str) -> None:
        self._events.append((self._offset(), "data", None if self._untranslated else data))

    def handle_comment(self, data: str) -> None:
        self._events.append((self._offset(), "other", None))

    handle_decl = handle_pi = unknown_decl = handle_comment

    def document(self) -> HtmlDocument:
        parts: list[str | Slot] = []
        texts: list[str] = []
        ends = [offset for offset, _, _ in self._events[1:]] + [len(self.page)]
        if self._events and self._events[0][0] > 0:
            parts.append(self.page[: self._events[0][0]])
        for (start, kind, what), end in zip(self._events, ends, strict=True):
            source = self.page[start:end]
            if kind == "data" and isinstance(what, str) and what.strip(HTML_SPACE):
                _add_text(parts, texts, source, what)
            elif kind == "tag" and what is False:
                _add_tag(parts, texts, source)
            else:
                parts.append(source)
        return HtmlDocument(tuple(parts), tuple(texts))


def _add_text(parts: list[str | Slot], texts: list[str], source: str, text: str) -> None:
    """A text node: its leading and trailing whitespace (HTML's: space, tab, line breaks) kept as written, the rest handed out."""
    lead = len(source) - len(source.lstrip(HTML_SPACE))
    trail = len(source) - len(source.rstrip(HTML_SPACE))
    parts += [source[:lead], Slot(len(texts), in_attribute=False), source[len(source) - trail :]]
    texts.append(text.strip(HTML_SPACE))


def _add_tag(parts: list[str | Slot], texts: list[str], source: str) -> None:
    """A start tag whose alt and title values (when not blank) are handed out; the rest of it is kept as written."""
    cut = 0
    for match in _ATTRIBUTE_VALUE.finditer(source):
        group = next(name for name in ("double", "single", "bare") if match.group(name) is not None)
        value = html.unescape(match.group(group))
        if match.group("name").lower() not in TRANSLATED_ATTRIBUTES or not value.strip():
            continue
        quote = '"' if group == "bare" else ""  # a translation may hold spaces: a bare value gets quotes
        parts += [source[cut : match.start(group)] + quote, Slot(len(texts), in_attribute=True), quote]
        texts.append(value)
        cut = match.end(group)
    parts.append(source[cut:])
