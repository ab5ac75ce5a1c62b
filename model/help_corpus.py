"""German/English pairs from translated HTML documentation whose elements carry the same ids in both languages.

LibreOffice's help (Debian: libreoffice-help-de, libreoffice-help-en-us, MPL-2.0) is one HTML page per
topic and language, generated from one source: each paragraph and heading keeps its id
(`<p id="par_id3149398">`) in every translation, so ids align the two languages exactly. A paragraph
whose two sides have the same number of sentences gives one pair per sentence (shorter, closer to the
held-out sentences); otherwise the paragraph is one pair.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from html.parser import HTMLParser

from nmt_serve.model.verbatim import detect

DEFAULT_HELP_ROOT = "/usr/share/libreoffice/help"
GERMAN, ENGLISH = "de", "en-US"
# Elements whose text is one unit of the translation.
_UNIT_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6"}
# Code samples are not translated (and the identical-pair rule would drop them anyway).
_SKIPPED_CLASSES = {"bascode", "code", "pycode", "example"}
# A sentence ends at . ! ? followed by a space and an upper-case letter or a digit.
_SENTENCE_BREAK_RE = re.compile(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ0-9])")
_SPACE_RE = re.compile(r"\s+")

Pair = tuple[str, str]  # (German, English)


class _UnitTexts(HTMLParser):
    """Text of each id-carrying paragraph or heading, without what a reader does not see (`hidden` elements)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.units: dict[str, str] = {}
        self._stack: list[tuple[str, bool]] = []  # open elements: (tag, hides its content)
        self._unit: tuple[str, int] | None = None  # (id, depth of its element) while inside a unit
        self._parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("br", "img", "meta", "link", "input", "hr"):  # void elements never close
            return
        attributes = dict(attrs)
        hidden = "hidden" in attributes or bool(_SKIPPED_CLASSES & set((attributes.get("class") or "").split()))
        self._stack.append((tag, hidden))
        if self._unit is None and tag in _UNIT_TAGS and attributes.get("id") and not hidden:
            self._unit, self._parts = (attributes["id"] or "", len(self._stack)), []

    def handle_endtag(self, tag: str) -> None:
        # Pop to the matching open element (tolerates unclosed inline elements).
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] == tag:
                if self._unit is not None and depth + 1 <= self._unit[1]:
                    unit_id, _ = self._unit
                    self.units.setdefault(unit_id, _SPACE_RE.sub(" ", "".join(self._parts)).strip())
                    self._unit = None
                del self._stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        if self._unit is not None and not any(hidden for _, hidden in self._stack):
            self._parts.append(data)


def unit_texts(html: str) -> dict[str, str]:
    """{element id: visible text} of the paragraphs and headings of one page."""
    parser = _UnitTexts()
    parser.feed(html)
    parser.close()
    return parser.units


def split_sentences(text: str) -> list[str]:
    return [part for part in _SENTENCE_BREAK_RE.split(text) if part]


def aligned_pairs(german: dict[str, str], english: dict[str, str]) -> list[Pair]:
    """Pairs of the ids both pages have; sentence by sentence when both sides have as many sentences."""
    pairs: list[Pair] = []
    for unit_id, de in german.items():
        en = english.get(unit_id)
        if not de or not en:
            continue
        de_sentences, en_sentences = split_sentences(de), split_sentences(en)
        if len(de_sentences) == len(en_sentences) > 1:
            pairs.extend(zip(de_sentences, en_sentences, strict=True))
        else:
            pairs.append((de, en))
    return pairs


def is_held_out(german: str) -> bool:
    """Whether a paragraph is held out of the corpus: one holding a verbatim span (a path, URL, placeholder, key
    combination; model/verbatim.py) belongs to the evaluation of how such spans survive (bench/verbatim_report.py)."""
    return bool(detect(german))


def page_pairs(root: str, counts: Counter) -> Iterator[tuple[str, dict[str, str], dict[str, str]]]:
    """(path under ROOT/de, German units, English units) of every page present under both ROOT/de and ROOT/en-US."""
    german_root, english_root = os.path.join(root, GERMAN), os.path.join(root, ENGLISH)
    for directory, _, files in sorted(os.walk(german_root)):
        for name in sorted(files):
            if not name.endswith(".html"):
                continue
            german_path = os.path.join(directory, name)
            relative = os.path.relpath(german_path, german_root)
            english_path = os.path.join(english_root, relative)
            if not os.path.isfile(english_path):
                counts["pages_without_english"] += 1
                continue
            with open(german_path, encoding="utf-8", errors="replace") as de_file, open(english_path, encoding="utf-8", errors="replace") as en_file:
                yield relative, unit_texts(de_file.read()), unit_texts(en_file.read())


def read_help(root: str, counts: Counter) -> tuple[list[Pair], int]:
    """Pairs from every page present under both ROOT/de and ROOT/en-US, less the held-out paragraphs; (pairs, pages read)."""
    pairs: list[Pair] = []
    pages = 0
    for _, german, english in page_pairs(root, counts):
        pages += 1
        kept = {unit_id: text for unit_id, text in german.items() if not is_held_out(text)}
        counts["paragraphs_held_out"] += len(german) - len(kept)
        pairs.extend(aligned_pairs(kept, english))
    counts["pages"] = pages
    counts["pairs"] = len(pairs)
    return pairs, pages


def held_out_paragraphs(root: str) -> list[Pair]:
    """(German, English) of every held-out paragraph or heading that has an English twin, whole (not split into sentences)."""
    return [(text, english[unit_id]) for _, german, english in page_pairs(root, Counter())
            for unit_id, text in german.items() if is_held_out(text) and english.get(unit_id)]  # fmt: skip
