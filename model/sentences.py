"""German sentence splitting as character spans over the original text; torch-free (the server uses it).

The model was trained on short sentence pairs, so a paragraph sent whole loses sentences; the server
translates each sentence as its own input and puts the translations back between the original
whitespace. Spans never cover whitespace at their edges, so `join` restores every space, newline and
paragraph break exactly.

Rules (a hand-written rule set rather than pysbd: pysbd's German rules merge or cut several of the
cases the tests hold, and its character spans include the following whitespace):
- A break needs `.`, `!`, `?` or an ellipsis, then optional closing quotes or brackets, then whitespace,
  then a word that does not start with a lowercase letter (German sentences start upper case, so
  „Komm!“ sagte er. stays whole).
- A dot after a known abbreviation (NON_BREAKING), a single letter ("z. B.", initials) or a dotted
  letter group ("z.B.", "u.a.") is not a break; ENDING_ABBREVIATIONS ("usw.", "etc.") may end one.
- A number's dot is an ordinal, not a break, before a month or after an article or preposition
  ("am 3. Oktober", "der 2. Platz"). Dots without whitespace after them (3.5, 12.30 Uhr, 1.1.2024,
  URLs, e-mail addresses, file names) never break.
- Lines: a blank line always ends a sentence; a single newline does when either line is a list item
  (a bullet or an enumerator at its start), or the line before ends with a sentence end; otherwise a
  wrapped line continues its sentence.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

# Lowercased, without the final dot. Kept as data so that a new abbreviation is a one-word change.
NON_BREAKING = frozenset("""
    abb abs abschn abt adr allg anh anm ausg bd bearb bes betr bsp bspw bzgl bzw ca chr co dgl dipl dr ebd ehem
    eig einschl entspr erg erw evtl exkl fa fam ff fr frl gebr gegr geb gem ggf ggü gr hbf hg hl hr hrsg inh inkl
    jh jr kap kfm kl lt max med mind min mio mod mrd nachf nr nrn o.ä od orig pkt pl prof prok rd reg rel
    s sen sog spez std str stud tel tsd u.a u.ä usf ust vgl vs wg zb zit zt zzgl
    jan feb febr mär apr jun jul aug sep sept okt nov dez
    mo di mi do
    """.split())
# Abbreviations that often end a sentence: they break before a capitalised word (German nouns are
# capitalised too, so a noun after "usw." reads as a new sentence: the rarer mistake).
ENDING_ABBREVIATIONS = frozenset({"usw", "etc", "u.s.w", "ff", "uvm", "u.v.m"})
MONTHS = frozenset("""januar jänner februar märz april mai juni juli august september oktober november dezember
    jan feb febr mär apr jun jul aug sep sept okt nov dez""".split())
# Words after which "<number>." is an ordinal: articles, prepositions fused with articles, and their kin.
ORDINAL_LEADS = frozenset("""der die das dem den des am im vom zum zur beim ab bis seit ein eine einem einen einer eines
    jeder jede jedes jeden jedem sein seine seinem seinen ihr ihre ihrem ihren unser unsere zu vor nach""".split())

TERMINATOR = re.compile(r"(?:\.{2,}|…|[.!?]+)")
CLOSERS = "\"'“”’‘»«›‹)]}"
BULLET = re.compile(r"[ \t]*(?:[-*•–—·▪◦‣]|\d{1,3}[.)]|[a-zA-Z][)])[ \t]+\S")
LETTER_GROUP = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]", re.UNICODE)  # "z.B" "u.a" before the final dot
NUMBER = re.compile(r"\d+")
BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
LINE_END = re.compile(r"[.!?…:][" + re.escape(CLOSERS) + r"]*\s*$")  # a line that ends its sentence


def split_spans(text: str, max_spans: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of each sentence, in order; no span starts or ends with whitespace; blank text has none.

    With `max_spans`, splitting stops once it has found one span more than that: a caller refusing such a
    text learns it without splitting the rest. The work is linear in the text's length either way."""
    spans: list[tuple[int, int]] = []
    for start, end in _blocks(text):
        cut = start
        for boundary in _boundaries(text, start, end):
            _add(spans, text, cut, boundary)
            cut = boundary
            if max_spans is not None and len(spans) > max_spans:
                return spans
        _add(spans, text, cut, end)
        if max_spans is not None and len(spans) > max_spans:
            return spans
    return spans


def split_sentences(text: str) -> list[str]:
    return [text[start:end] for start, end in split_spans(text)]


def join(text: str, spans: Sequence[tuple[int, int]], translations: Sequence[str]) -> str:
    """`text` with each span replaced by its translation; everything between spans is kept as it was."""
    if len(spans) != len(translations):
        raise ValueError(f"{len(spans)} spans but {len(translations)} translations")
    if not spans:
        return ""  # a blank text translates to nothing, as when it is sent unsplit
    parts, cut = [], 0
    for (start, end), translation in zip(spans, translations, strict=True):
        parts += [text[cut:start], translation]
        cut = end
    parts.append(text[cut:])
    return "".join(parts)


def _add(spans: list[tuple[int, int]], text: str, start: int, end: int) -> None:
    """The span trimmed of whitespace at both edges, when anything is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if start < end:
        spans.append((start, end))


def _blocks(text: str) -> Iterator[tuple[int, int]]:
    """Runs of lines that may hold one sentence across a line break (a wrapped line); see the module rules.

    Each line is looked at once, and compared with the line before it only, so the work is linear in the
    text: a block of wrapped lines is never reread as it grows."""
    block: tuple[int, int] | None = None
    start, stands_alone, ends_sentence = 0, True, True  # the line before: blank or a list item; ends a sentence
    for line in text.splitlines(keepends=True):
        end = start + len(line)
        blank = not line.strip()
        bullet = not blank and BULLET.match(line) is not None
        # A blank line or a list item, at or before this line, or a sentence end before it: a new block.
        if block is not None and not (blank or bullet or stands_alone or ends_sentence):
            block = (block[0], end)
        else:
            if block is not None:
                yield block
            block = (start, end)
        start, stands_alone = end, blank or bullet
        ends_sentence = not stands_alone and LINE_END.search(line) is not None
    if block is not None:
        yield block


def _boundaries(text: str, start: int, end: int) -> Iterator[int]:
    """Offsets inside [start, end) where a sentence ends (just after its terminator and closers)."""
    for match in TERMINATOR.finditer(text, start, end):
        stop = match.end()
        while stop < end and text[stop] in CLOSERS:
            stop += 1
        if stop >= end or not text[stop].isspace():
            continue  # 3.5, 1.1.2024, a URL, an e-mail address, "Ja!!" at the very end of the block
        after = stop
        while after < end and text[after].isspace():
            after += 1
        if after >= end:
            continue  # the block's own end
        if _breaks(text, start, match, stop, after):
            yield stop


def _breaks(text: str, block_start: int, terminator: re.Match[str], closed: int, next_start: int) -> bool:
    following = text[next_start]
    if following.islower():
        return False  # German sentences start upper case: „Komm!“ sagte er. / ... und dann
    if terminator.group() != "." or closed > terminator.end():
        return True  # ! ? ellipsis, or a dot before a closing quote or bracket
    word = _word_before(text, block_start, terminator.start())
    if not word:
        return True
    key = word.lower().lstrip("(\"'„“‚‘»«[")
    next_word = _word_at(text, next_start).lower().strip(".,;:!?")
    if key in ENDING_ABBREVIATIONS:
        return True
    if key in NON_BREAKING or LETTER_GROUP.fullmatch(key):
        return False
    if len(key) == 1 and key.isalpha():
        return False  # one letter and a dot: an initial or part of "z. B.", "d. h.", "u. a."
    if key.endswith("str") and len(key) > 3:
        return False  # a street: Hauptstr. 5
    if NUMBER.fullmatch(key):
        if next_word in MONTHS:
            return False  # am 3. Oktober
        lead = _word_before(text, block_start, terminator.start() - len(word)).lower()
        # der 2. Platz; and no word before it: an enumerator at the start of a line ("1. Aufstehen")
        return bool(lead) and lead not in ORDINAL_LEADS
    return True


def _word_before(text: str, floor: int, stop: int) -> str:
    """The non-space run that ends at `stop` (skipping whitespace just before it, but not a line break)."""
    end = stop
    while end > floor and text[end - 1] in " \t":
        end -= 1
    begin = end
    while begin > floor and not text[begin - 1].isspace():
        begin -= 1
    return text[begin:end]


def _word_at(text: str, start: int) -> str:
    end = start
    while end < len(text) and not text[end].isspace():
        end += 1
    return text[start:end]
