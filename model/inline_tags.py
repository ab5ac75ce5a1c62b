"""Where an inline element's tags go in a sentence translated without them: a pure function of the texts.

A block's inline flow (`Klicken Sie auf <b>Datei</b>, um …`) is translated as one text with its tags
removed, so the model sees whole sentences and may move words across the tags. Each inline element's
own text is translated alone as well, and its tags are put around that translation where it occurs in
the sentence's translation. The models here neither copy placeholder tokens nor expose attention, so
the place is found in the output text, in this order (the first that finds one wins):

1. `whole`: the element holds all of its parent's text (all of the block's, at the top), so it holds
   all of the parent's translation; nothing was translated alone for it.
2. `exact`: the element's translation, as it is.
3. `case`: the same, ignoring case.
4. `trimmed`: the element's translation without the punctuation and spaces at its edges (a lone word
   often comes back with a period or a capital), ignoring case.
5. `stem`: the trimmed translation with each word of four letters or more cut to its first two thirds
   (at least four letters) and any word ending allowed, ignoring case: `saved` finds `save`, `licence`
   finds `license`.
6. `source`: the element's own source text, ignoring case (names, numbers and English words the model
   copied into the sentence).
7. `empty`: an element without text (an anchor `<a name=…></a>`) goes to the word start nearest its
   relative place in the parent.
8. `relative`: nothing was found; the element wraps the words at its relative place: its source text's
   start and end as fractions of the parent's source text, mapped onto the parent's translation and
   widened to whole words. The tags are there, with their attributes; the words they wrap may be the
   wrong ones.

A match must start and end at word edges (`file` is not found in `profile`). Children are placed inside
their parent's place, and siblings left to right, each after the one before it, so the tags nest and
come in the same order as in the source: the page's element tree is unchanged whatever was found.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MATCHED = ("whole", "exact", "case", "trimmed", "stem", "source")  # the methods that found the element's words
_EDGE_PUNCTUATION = " \t\n\r\f\xa0.,;:!?\"'()[]{}«»„“”‚‘’-–—…"


@dataclass(frozen=True)
class TagSpan:
    """One inline element of a text: its content is source[start:end]; `parent` indexes the enclosing element in the same
    sequence (which lists parents before their children, in source order), -1 for none; `translated` is the content
    translated alone (None when nothing was: blank content, or content that is all of its parent's)."""

    start: int
    end: int
    parent: int
    translated: str | None


@dataclass(frozen=True)
class Placement:
    """Where the element's content lies in the translation, and which method found it (see the module docstring)."""

    start: int
    end: int
    method: str


def place_tags(source: str, translation: str, spans: Sequence[TagSpan], fixed: Sequence[tuple[int, int]] = ()) -> list[Placement]:
    """One Placement per span, nested and ordered as the spans are in the source.

    `fixed`: (source position, translation position) of characters that stand where they stood, in the same order in
    both (an inline element kept as written): each span is placed to hold exactly the fixed characters it held."""
    placements: list[Placement] = []
    # Per parent (-1: the text itself): where the next child may start. Children come after their parent.
    cursors: dict[int, int] = {-1: 0}
    for index, span in enumerate(spans):
        if span.parent >= index:
            raise ValueError(f"span {index} names parent {span.parent}, which does not come before it")
        region = (0, len(translation)) if span.parent < 0 else (placements[span.parent].start, placements[span.parent].end)
        parent_source = (0, len(source)) if span.parent < 0 else (spans[span.parent].start, spans[span.parent].end)
        low = max([cursors.get(span.parent, region[0]), region[0], *(at + 1 for held, at in fixed if held < span.start)])
        high = min([region[1], *(at for held, at in fixed if held >= span.end)])
        inner = [at for held, at in fixed if span.start <= held < span.end]
        placement = _place(source, translation, span, parent_source, (low, max(low, high)), region, inner)
        placements.append(placement)
        cursors[span.parent] = placement.end
        cursors[index] = placement.start
    return placements


def _place(source: str, translation: str, span: TagSpan, parent_source: tuple[int, int], window: tuple[int, int],
           region: tuple[int, int], inner: list[int]) -> Placement:  # fmt: skip
    low, high = window
    content = _stripped(source, span.start, span.end)
    if content[0] == content[1]:
        at = _word_start(translation, _relative(span.start, parent_source, region), low, high)
        return Placement(at, at, "empty")
    if content == _stripped(source, *parent_source):
        start, end = _stripped(translation, low, high)
        return Placement(start, end, "whole")
    candidates: list[tuple[str, re.Pattern[str]]] = []
    if span.translated is not None and span.translated.strip():
        trimmed = span.translated.strip(_EDGE_PUNCTUATION)
        candidates += [("exact", _pattern(re.escape(span.translated), span.translated, 0)),
                       ("case", _pattern(re.escape(span.translated), span.translated, re.IGNORECASE)),
                       ("trimmed", _pattern(re.escape(trimmed), trimmed, re.IGNORECASE)),
                       ("stem", _pattern(r"\s+".join(_stem(word) for word in trimmed.split()), trimmed, re.IGNORECASE))]  # fmt: skip
    copied = source[content[0] : content[1]].strip(_EDGE_PUNCTUATION)
    candidates.append(("source", _pattern(re.escape(copied), copied, re.IGNORECASE)))
    for method, pattern in candidates:
        found = _find(translation, pattern, window, inner)
        if found is not None:
            return Placement(*found, method)
    start = _word_start(translation, _relative(content[0], parent_source, region), low, high)
    end = _word_end(translation, _relative(content[1], parent_source, region), start, high)
    start, end = _stripped(translation, start, max(start, end))
    if inner:  # the fixed characters it held stay inside it
        start, end = min(start, inner[0]), max(end, inner[-1] + 1)
    return Placement(start, end, "relative")


def _pattern(body: str, wanted: str, flags: int) -> re.Pattern[str] | None:
    """`body` (a regular expression for `wanted`) held to word edges where `wanted` starts or ends with a word character."""
    if not wanted:
        return None
    before = "(?<!\\w)" if wanted[0].isalnum() or wanted[0] == "_" else ""
    after = "(?!\\w)" if wanted[-1].isalnum() or wanted[-1] == "_" else ""
    return re.compile(before + body + after, flags)


def _stem(word: str) -> str:
    """A word of four letters or more as its first two thirds (four letters at least) and any word ending."""
    if len(word) < 4 or not word.isalpha():
        return re.escape(word)
    return re.escape(word[: max(4, -(-2 * len(word) // 3))]) + r"\w*"


def _find(text: str, pattern: re.Pattern[str] | None, window: tuple[int, int], inner: list[int]) -> tuple[int, int] | None:
    """The first match within text[low:high] that holds `inner`."""
    if pattern is None:
        return None
    for match in pattern.finditer(text, *window):
        if all(match.start() <= at < match.end() for at in inner):
            return match.start(), match.end()
    return None


def _relative(position: int, parent_source: tuple[int, int], region: tuple[int, int]) -> int:
    """`position` of the parent's source mapped by its fraction onto the parent's translation."""
    length = parent_source[1] - parent_source[0]
    fraction = (position - parent_source[0]) / length if length else 0.0
    return region[0] + round(min(max(fraction, 0.0), 1.0) * (region[1] - region[0]))


def _word_start(text: str, position: int, floor: int, ceiling: int) -> int:
    """The start of the word `position` falls in; from whitespace, the start of the next word."""
    position = min(max(position, floor), ceiling)
    if position < ceiling and text[position].isspace():
        while position < ceiling and text[position].isspace():
            position += 1
        return position
    while position > floor and not text[position - 1].isspace():
        position -= 1
    return position


def _word_end(text: str, position: int, floor: int, ceiling: int) -> int:
    """The end of the word `position` falls in; a position at a word's start stays (that word is not taken) unless it is
    `floor`, the wrapped words' start: the element wraps one word at least."""
    position = min(max(position, floor), ceiling)
    while position < ceiling and not text[position].isspace() and (position == floor or not text[position - 1].isspace()):
        position += 1
    return position


def _stripped(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
