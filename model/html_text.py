"""HTML for translation: the markup kept byte for byte, the text of each block and alt/title values handed out to translate.

The stdlib parser (html.parser) finds every tag, comment, declaration and text run; each keeps its
exact source text, so a page rendered back has the same elements, attributes, order, comments and
whitespace-only runs as before. The text inside <code>, <pre>, <script>, <style>, <kbd>, <samp>,
<textarea> and any element with translate="no" is never handed out, and neither are its attributes.

A block's inline flow is handed out as one text: its text nodes joined across inline elements
(INLINE_ELEMENTS: <b>, <i>, <a>, <span>, ...), so a sentence cut by a tag is translated whole. An
inline element kept as written (<code>, <kbd>, <samp>, translate="no") stands in that text as one
private-use character that the server keeps verbatim, and comes back as its markup. Each inline
element's own text is handed out as well (a probe: translated, never shown), and model/inline_tags.py
places the element's tags around that translation in the block's. Anything else (a block element,
<br>, <img>, a comment, an element left unclosed inside the flow) ends the flow; a flow whose inline
elements do not close within it hands out each of its text nodes on its own, as every text node was
before flows existed.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser

from nmt_serve.model.inline_tags import Placement, TagSpan, place_tags

UNTRANSLATED_ELEMENTS = frozenset({"code", "pre", "script", "style", "kbd", "samp", "textarea"})
# Elements a sentence flows through: their tags are placed around the translation of the words they wrapped.
INLINE_ELEMENTS = frozenset({"a", "abbr", "acronym", "b", "bdi", "bdo", "big", "cite", "data", "del", "dfn", "em", "font", "i", "ins",
                             "label", "mark", "q", "s", "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u", "var"})  # fmt: skip
# Inline elements whose content is kept as written: they stay in the sentence as a verbatim span.
VERBATIM_INLINE_ELEMENTS = frozenset({"code", "kbd", "samp"}) | INLINE_ELEMENTS
TRANSLATED_ATTRIBUTES = ("alt", "title")
HTML_SPACE = " \t\n\r\f"
VOID_ELEMENTS = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"})
# An attribute's value inside the exact text of a start tag the parser found: name, =, then a quoted or bare value.
_ATTRIBUTE_VALUE = re.compile(r"""\s(?P<name>[^\s"'>/=]+)\s*=\s*(?:"(?P<double>[^"]*)"|'(?P<single>[^']*)'|(?P<bare>[^\s"'=<>`]+))""")
# Stand-ins for inline elements kept as written: private-use characters, skipping any the page itself holds.
_PLACEHOLDERS = range(0xE000, 0xF900)


@dataclass(frozen=True)
class Slot:
    """A place in the page for one translation: the text handed out, and whether it sits in an attribute value."""

    index: int
    in_attribute: bool


@dataclass(frozen=True)
class InlineTag:
    """An inline element of a flow: its start tag (alt/title values as slots), end tag, and its content's place in the
    flow's text; `probe` is the text holding its content to translate alone (None: blank, or all of its parent's)."""

    start_tag: tuple[str | Slot, ...]
    end_tag: str
    span: TagSpan  # its translation (span.translated) is filled in at render time
    probe: int | None


@dataclass(frozen=True)
class Flow:
    """A block's inline flow: one text to translate (slot `index`, its whitespace edges stripped), the inline elements
    in it (parents before children, in source order) and the markup each placeholder character stands for."""

    index: int
    text: str
    tags: tuple[InlineTag, ...]
    markup: tuple[tuple[str, str], ...]

    def translation(self, translations: Sequence[str]) -> str:
        """The flow's translation, every placeholder in it once and in source order. The server keeps them so; any other
        text (one that lost or repeated one) has them all taken out and put back at its end, so the tree holds anyway."""
        translation = translations[self.index]
        characters = [character for character, _ in self.markup]
        if [character for character in translation if character in characters] == characters:
            return translation
        kept = "".join(character for character in translation if character not in characters)
        return " ".join([kept, *characters]) if kept else " ".join(characters)

    def placements(self, translations: Sequence[str]) -> list[Placement]:
        spans = [TagSpan(tag.span.start, tag.span.end, tag.span.parent, None if tag.probe is None else translations[tag.probe])
                 for tag in self.tags]  # fmt: skip
        translation = self.translation(translations)
        fixed = [(self.text.index(character), translation.index(character)) for character, _ in self.markup]
        return place_tags(self.text, translation, spans, fixed)

    def render(self, translations: Sequence[str]) -> str:
        translation = self.translation(translations)
        placements = self.placements(translations)
        out: list[str] = []
        self._write(out, translation, placements, translations, -1, 0, len(translation))
        rendered = "".join(out)
        for character, markup in self.markup:
            rendered = rendered.replace(character, markup, 1)
        return rendered

    def _write(self, out: list[str], translation: str, placements: list[Placement], translations: Sequence[str], parent: int, start: int,
               end: int) -> None:  # fmt: skip
        """translation[start:end], escaped, with the tags of `parent`'s children around their places (theirs nested inside)."""
        cursor = start
        for index, tag in enumerate(self.tags):
            if tag.span.parent != parent:
                continue
            place = placements[index]
            out.append(html.escape(translation[cursor : place.start], quote=False))
            out.append(_filled(tag.start_tag, translations))
            self._write(out, translation, placements, translations, index, place.start, place.end)
            out.append(tag.end_tag)
            cursor = place.end
        out.append(html.escape(translation[cursor:end], quote=False))


@dataclass(frozen=True)
class HtmlDocument:
    parts: tuple[str | Slot | Flow, ...]  # the page: source text kept as it is, slots and flows
    texts: tuple[str, ...]  # what each slot, flow and probe hands out to translate, in page order
    probes: frozenset[int] = frozenset()  # texts translated only to place inline tags: not part of the page
    placeholders: frozenset[str] = frozenset()  # characters that stand for inline elements kept as written

    def render(self, translations: Sequence[str]) -> str:
        """The page with each slot's translation in its place, escaped for where it stands."""
        if len(translations) != len(self.texts):
            raise ValueError(f"{len(self.texts)} texts but {len(translations)} translations")
        return "".join(_rendered_part(part, translations) for part in self.parts)

    def rendered_parts(self, translations: Sequence[str | None], start: int = 0) -> Iterator[str]:
        """The page part by part from part `start`, in order, as far as the translations go: a part waits for every text
        it shows or places its tags by (None: not translated yet); all parts join to `render`'s page."""
        for part in self.parts[start:]:
            if any(translations[index] is None for index in _needed(part)):
                return
            yield _rendered_part(part, translations)  # type: ignore[arg-type]  # the texts it needs are all there

    def placements(self, translations: Sequence[str]) -> list[Placement]:
        """Every inline element's placement, page order: how each was found (model/inline_tags.py's methods)."""
        return [placement for part in self.parts if isinstance(part, Flow) for placement in part.placements(translations)]

    def kept_spans(self, text: str) -> list[tuple[int, int]]:
        """The placeholder characters of one of this page's texts: spans the server must keep verbatim."""
        return [(index, index + 1) for index, character in enumerate(text) if character in self.placeholders]


def _rendered_part(part: str | Slot | Flow, translations: Sequence[str]) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Slot):
        return html.escape(translations[part.index], quote=part.in_attribute)
    return part.render(translations)


def _needed(part: str | Slot | Flow) -> list[int]:
    """The texts a part shows or places its tags by."""
    if isinstance(part, str):
        return []
    if isinstance(part, Slot):
        return [part.index]
    slots = [piece.index for tag in part.tags for piece in tag.start_tag if isinstance(piece, Slot)]
    return [part.index, *slots, *(tag.probe for tag in part.tags if tag.probe is not None)]


def _filled(parts: Sequence[str | Slot], translations: Sequence[str]) -> str:
    return "".join(_rendered_part(part, translations) for part in parts)


def parse_html(page: str) -> HtmlDocument:
    """The page as kept parts, slots and flows; text made only of whitespace is kept, not handed out."""
    parser = _Splitter(page)
    parser.feed(page)
    parser.close()
    return parser.document()


@dataclass
class _Event:
    offset: int
    kind: str  # "start", "end", "data", "other"
    tag: str = ""
    untranslated: bool = True  # inside (or being) an element left as written
    begins_untranslated: bool = False  # a start tag that makes its content untranslated, its parent's being translated
    data: str = ""
    partner: int | None = None  # a start tag's end event, an end tag's start event, when they match


class _Splitter(HTMLParser):
    """Cuts the source at each construct the parser reports; every construct's exact text is source[start:next start]."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page
        self._line_starts = [0] + [index + 1 for index, character in enumerate(page) if character == "\n"]
        self._events: list[_Event] = []  # in source order
        self._open: list[tuple[str, bool, int]] = []  # open elements: (tag, whether its content is left untranslated, start event)

    def _offset(self) -> int:
        line, column = self.getpos()
        return self._line_starts[line - 1] + column

    @property
    def _untranslated(self) -> bool:
        return bool(self._open) and self._open[-1][1]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        own = tag in UNTRANSLATED_ELEMENTS or (dict(attrs).get("translate") or "").lower() == "no"
        untranslated = self._untranslated or own
        self._events.append(_Event(self._offset(), "start", tag, untranslated, begins_untranslated=own and not self._untranslated))
        if tag not in VOID_ELEMENTS:
            self._open.append((tag, untranslated, len(self._events) - 1))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        untranslated = self._untranslated or tag in UNTRANSLATED_ELEMENTS or (dict(attrs).get("translate") or "").lower() == "no"
        self._events.append(_Event(self._offset(), "start", "", untranslated))  # no content: never part of a flow

    def handle_endtag(self, tag: str) -> None:
        event = _Event(self._offset(), "end", tag)
        self._events.append(event)
        for depth in range(len(self._open) - 1, -1, -1):  # close up to the matching element (unclosed inline ones too)
            if self._open[depth][0] == tag:
                start = self._open[depth][2]
                event.partner, self._events[start].partner = start, len(self._events) - 1
                del self._open[depth:]
                break

    def handle_data(self, data: str) -> None:
        self._events.append(_Event(self._offset(), "data", untranslated=self._untranslated, data=data))

    def handle_comment(self, data: str) -> None:
        self._events.append(_Event(self._offset(), "other"))

    handle_decl = handle_pi = unknown_decl = handle_comment

    def document(self) -> HtmlDocument:
        ends = [event.offset for event in self._events[1:]] + [len(self.page)]
        sources = [self.page[event.offset : end] for event, end in zip(self._events, ends, strict=True)]
        builder = _Builder(self._events, sources, _free_placeholders(self.page))
        if self._events and self._events[0].offset > 0:
            builder.parts.append(self.page[: self._events[0].offset])
        builder.build()
        return HtmlDocument(tuple(builder.parts), tuple(builder.texts), frozenset(builder.probes), frozenset(builder.used_placeholders))


def _free_placeholders(page: str) -> Iterator[str]:
    return (chr(code) for code in _PLACEHOLDERS if chr(code) not in page)


@dataclass
class _Element:
    """An inline element while its flow is joined: its start event, its content's place in the joined text, its parent."""

    event: int
    start: int
    end: int
    parent: int


@dataclass
class _Builder:
    """Walks the events: flows of inline content between the rest, which is kept as written (alt/title handed out)."""

    events: list[_Event]
    sources: list[str]
    placeholders: Iterator[str]
    parts: list[str | Slot | Flow] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)
    used_placeholders: list[str] = field(default_factory=list)

    def build(self) -> None:
        flow: list[int] = []  # event indexes of the flow being gathered
        index = 0
        while index < len(self.events):
            event = self.events[index]
            if self._opens_inline(index) or (event.kind == "end" and event.partner is not None and self._opens_inline(event.partner)) or (
                    event.kind == "data" and not event.untranslated):  # fmt: skip
                flow.append(index)
                index += 1
            elif event.begins_untranslated and event.tag in VERBATIM_INLINE_ELEMENTS and event.partner is not None:
                flow.extend(range(index, event.partner + 1))  # the whole element, kept as written, stands in the flow
                index = event.partner + 1
            else:
                self._flush(flow)
                flow = []
                self._add_kept(index)
                index += 1
        self._flush(flow)

    def _opens_inline(self, index: int) -> bool:
        event = self.events[index]
        return event.kind == "start" and not event.untranslated and event.tag in INLINE_ELEMENTS and event.partner is not None

    def _translated_tag(self, index: int) -> bool:
        """A start or end tag of an element whose content is translated (a kept element's tags are not: it is kept whole)."""
        event = self.events[index]
        if event.kind == "start":
            return not event.untranslated
        return event.kind == "end" and event.partner is not None and not self.events[event.partner].untranslated

    def _add_kept(self, index: int) -> None:
        """An event outside any flow: a translated start tag's alt/title handed out, a text node on its own, the rest as written."""
        event, source = self.events[index], self.sources[index]
        if event.kind == "start" and not event.untranslated:
            self.parts.extend(self._tag_parts(source))
        elif event.kind == "data" and not event.untranslated and event.data.strip(HTML_SPACE):
            self._add_text(source, event.data)
        else:
            self.parts.append(source)

    def _flush(self, flow: list[int]) -> None:
        """A gathered flow as one text when it holds markup and its inline elements close within it; else event by event."""
        if not flow:
            return
        inside = set(flow)
        balanced = all(self.events[index].partner in inside for index in flow if self._translated_tag(index))
        has_text = any(self.events[index].kind == "data" and not self.events[index].untranslated and self.events[index].data.strip(HTML_SPACE)
                       for index in flow)  # fmt: skip
        has_markup = any(self.events[index].kind != "data" for index in flow)
        if not (balanced and has_text and has_markup) or not self._add_flow(flow):
            for index in flow:
                self._add_kept(index)

    def _add_flow(self, flow: list[int]) -> bool:
        """The flow as a Flow part between its edge whitespace; False (nothing added) when placeholders ran out."""
        joined: list[str] = []
        length = 0  # characters joined so far
        markup: list[tuple[str, str]] = []
        opened: list[_Element] = []  # inline elements open at this point of the flow, innermost last
        elements: list[_Element] = []  # in source order: parents before children
        position = 0
        while position < len(flow):
            index = flow[position]
            event = self.events[index]
            if event.kind == "data" and not event.untranslated:
                joined.append(event.data)
                length += len(event.data)
            elif event.kind == "start" and event.begins_untranslated:  # a kept element: its placeholder, its whole source as markup
                character = next(self.placeholders, None)
                if character is None:
                    return False
                self.used_placeholders.append(character)
                last = flow.index(event.partner, position)  # type: ignore[arg-type]  # a kept element in a flow is closed in it
                markup.append((character, "".join(self.sources[flow[at]] for at in range(position, last + 1))))
                joined.append(character)
                length += 1
                position = last
            elif event.kind == "start":
                element = _Element(index, length, length, elements.index(opened[-1]) if opened else -1)
                opened.append(element)
                elements.append(element)
            else:  # the end tag of the innermost open element (the flow is balanced)
                opened.pop().end = length
            position += 1
        text = "".join(joined)
        lead = len(text) - len(text.lstrip(HTML_SPACE))
        stripped = text.strip(HTML_SPACE)
        tags: list[InlineTag] = []
        self.parts.append(text[:lead])
        # Texts in page order as far as they go: the elements' alt/title values, the flow's text, then the probes.
        start_tags = [tuple(self._tag_parts(self.sources[element.event])) for element in elements]
        flow_index = len(self.texts)
        self.texts.append(stripped)
        for element, start_tag in zip(elements, start_tags, strict=True):
            start = min(max(element.start - lead, 0), len(stripped))
            span = TagSpan(start, min(max(element.end - lead, start), len(stripped)), element.parent, None)
            end_tag = self.sources[self.events[element.event].partner]  # type: ignore[index]  # balanced: every element is closed
            tags.append(InlineTag(start_tag, end_tag, span, self._probe(stripped, span, [tag.span for tag in tags])))
        self.parts.append(Flow(flow_index, stripped, tuple(tags), tuple(markup)))
        self.parts.append(text[lead + len(stripped) :])
        return True

    def _probe(self, text: str, span: TagSpan, before: list[TagSpan]) -> int | None:
        """The text index of the element's content translated alone; none for blank content or all of its parent's."""
        content = text[span.start : span.end].strip(HTML_SPACE)
        parent = text if span.parent < 0 else text[before[span.parent].start : before[span.parent].end]
        if not content or content == parent.strip(HTML_SPACE):
            return None
        self.probes.append(len(self.texts))
        self.texts.append(content)
        return self.probes[-1]

    def _add_text(self, source: str, text: str) -> None:
        """A text node: its leading and trailing whitespace (HTML's: space, tab, line breaks) kept as written, the rest handed out."""
        lead = len(source) - len(source.lstrip(HTML_SPACE))
        trail = len(source) - len(source.rstrip(HTML_SPACE))
        self.parts.extend([source[:lead], Slot(len(self.texts), in_attribute=False), source[len(source) - trail :]])
        self.texts.append(text.strip(HTML_SPACE))

    def _tag_parts(self, source: str) -> list[str | Slot]:
        """A start tag whose alt and title values (when not blank) are handed out; the rest of it is kept as written."""
        parts: list[str | Slot] = []
        cut = 0
        for match in _ATTRIBUTE_VALUE.finditer(source):
            group = next(name for name in ("double", "single", "bare") if match.group(name) is not None)
            value = html.unescape(match.group(group))
            if match.group("name").lower() not in TRANSLATED_ATTRIBUTES or not value.strip():
                continue
            quote = '"' if group == "bare" else ""  # a translation may hold spaces: a bare value gets quotes
            parts += [source[cut : match.start(group)] + quote, Slot(len(self.texts), in_attribute=True), quote]
            self.texts.append(value)
            cut = match.end(group)
        parts.append(source[cut:])
        return parts
