"""Verbatim spans: the parts of a text that must come back unchanged (URLs, paths, code, placeholders, key combinations).

The rules are data: each is a name and a regular expression, tried on the whole text; tests hold a
table of cases for every rule. Callers add their own spans (exact strings or character ranges).
Overlapping spans merge, so a URL inside backticks is one span.

How the spans survive is the translator's part (server/models/requests.py): the text is translated
in the pieces between them, and the spans are put back as they were, so it holds for any model,
trained here or imported, without the model having learned to copy anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # [start, end) in code points

_KEY_MODIFIERS = r"Strg|Ctrl|Control|Alt|AltGr|Alt\s?Gr|Umschalt|Shift|Hochstell|Cmd|Command|Befehl|Option|Opt|Wahl|Fn|Super|Meta|Win|Windows"
_KEY_NAMES = (r"F(?:[1-9]|1[0-9]|2[0-4])|Entf|Del|Delete|Einfg|Ins|Insert|Pos1|Home|Ende|End|Bild\s?auf|Bild\s?ab|Bild-?(?:Auf|Ab)|PgUp|PgDn|"
              r"Page\s?Up|Page\s?Down|Tab|Tabulator|Leertaste|Space|Eingabe(?:taste)?|Enter|Return|Esc|Escape|Rücktaste|Backspace|"
              r"Pfeil\s?(?:nach\s)?(?:oben|unten|links|rechts)|(?:Up|Down|Left|Right)(?:\s?Arrow)?|Druck|PrtSc|Print|Pause|Plus|Minus|Komma|Punkt")
# Trailing characters a URL or path does not keep when the sentence ends or a clause follows it.
_TRAILING = ".,;:!?)]}\"'»«“”’"
_FILE_EXTENSIONS = ("bak", "bat", "cfg", "conf", "csv", "db", "deb", "desktop", "doc", "docx", "exe", "gz", "html", "ini", "jar", "jpg", "js",
                    "json", "log", "md", "odb", "odg", "odp", "ods", "odt", "ott", "pdf", "png", "po", "ppt", "py", "rpm", "sh", "so", "sql",
                    "svg", "tar", "tgz", "toml", "ttf", "txt", "xcu", "xls", "xlsx", "xml", "yaml", "yml", "zip")  # fmt: skip


@dataclass(frozen=True)
class VerbatimRule:
    name: str
    pattern: re.Pattern[str]
    trim_trailing: bool = False  # drop sentence punctuation the match swallowed at its end


RULES: tuple[VerbatimRule, ...] = (
    # `code` with its backticks; the content may hold anything but a backtick or a line break.
    VerbatimRule("inline_code", re.compile(r"`[^`\n]+`")),
    VerbatimRule("url", re.compile(r"\b(?:https?|ftp|sftp|file|ssh|smb)://[^\s<>\"`]+|\bwww\.[^\s<>\"`]+\.[^\s<>\"`]+"), trim_trailing=True),
    VerbatimRule("email", re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b")),
    # /etc/fstab, ~/.config/x, ./configure, ../lib: a path starts at a slash, a tilde or dots, and has a letter in it.
    VerbatimRule("unix_path", re.compile(r"(?<![\w/.~-])(?:~[\w.-]*|\.{1,2})?/(?=[^\s/]*[A-Za-z])[\w.@%+~-]+(?:/[\w.@%+~-]*)*"),
                 trim_trailing=True),
    VerbatimRule("windows_path", re.compile(r"(?<!\w)(?:[A-Za-z]:|\\\\[\w.-]+)\\(?:[\w .$-]+\\)*[\w.$-]*"), trim_trailing=True),
    VerbatimRule("file_name", re.compile(r"(?<![\w/.-])[\w-]+(?:\.[\w-]+)*\.(?:" + "|".join(_FILE_EXTENSIONS) + r")\b(?![\w-])")),
    # printf: %s %d %1$s %-10.2f %ld %%; no space flag, so "50 % der" stays text.
    VerbatimRule("printf", re.compile(r"%(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGaAcspn%@]"
                                      r"|%\([\w.-]+\)[-+#0]*\d*(?:\.\d+)?[diouxXeEfFgGcrs]")),  # fmt: skip
    # {name} {0} {} {count:d} (Python, .NET, ICU arguments), ${VAR}, $VAR in capitals (a price such as $5 is text).
    VerbatimRule("brace_placeholder", re.compile(r"\$\{[A-Za-z_][\w.:-]*\}|\{[A-Za-z_\d][\w.:!#,-]*\}|\{\}")),
    VerbatimRule("shell_variable", re.compile(r"(?<![\w$])\$[A-Z_][A-Z0-9_]+\b")),
    # Strg+Alt+T, Ctrl+Shift+F5, Umschalt+Pfeil nach oben, Cmd-Q: modifiers joined by + (or -), then a key.
    VerbatimRule("key_combination", re.compile(rf"\b(?:(?:{_KEY_MODIFIERS})\s?[+-]\s?)+(?:{_KEY_NAMES}|{_KEY_MODIFIERS}|[A-Za-z0-9](?![\w])|[^\s\w])")),
)
RULE_NAMES = tuple(rule.name for rule in RULES)


def detect(text: str, rules: Sequence[VerbatimRule] = RULES) -> list[Span]:
    """Every rule's matches in `text`, merged where they overlap or touch, in order."""
    spans = []
    for rule in rules:
        for match in rule.pattern.finditer(text):
            start, end = match.span()
            if rule.trim_trailing:
                end = _trimmed_end(text, start, end)
            if start < end:
                spans.append((start, end))
    return merge(spans)


def occurrences(text: str, strings: Iterable[str]) -> list[Span]:
    """Every occurrence of each (non-empty) string in `text`."""
    spans = []
    for string in strings:
        start = text.find(string)
        while string and start >= 0:
            spans.append((start, start + len(string)))
            start = text.find(string, start + len(string))
    return spans


def merge(spans: Iterable[Span]) -> list[Span]:
    """Sorted, with overlapping or touching spans joined into one."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def cut(pieces: Sequence[Span], verbatim: Sequence[Span], text: str) -> list[Span]:
    """`pieces` (sentences to translate) less the verbatim spans; what is left of a piece that lost a span is kept
    only when it holds a letter (", " or "." between two paths is kept as written, not translated)."""
    if not verbatim:
        return list(pieces)
    out: list[Span] = []
    for start, end in pieces:
        inside = [(max(start, v_start), min(end, v_end)) for v_start, v_end in verbatim if v_start < end and v_end > start]
        if not inside:
            out.append((start, end))
            continue
        cursor = start
        for v_start, v_end in [*inside, (end, end)]:
            _add_piece(out, text, cursor, v_start, after_span=cursor > start)
            cursor = max(cursor, v_end)
    return out


# Separators a piece may start with right after a span ("Strg+S, um ..."): kept as written, since a model
# translating ", um das Dokument zu speichern." as a sentence of its own drops them.
_SEPARATORS_AFTER_SPAN = ",;:"


def _add_piece(out: list[Span], text: str, start: int, end: int, after_span: bool = False) -> None:
    """text[start:end] trimmed of whitespace (and, after a span, of leading separators), when a letter is left in it."""
    while start < end and (text[start].isspace() or (after_span and text[start] in _SEPARATORS_AFTER_SPAN)):
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if any(character.isalpha() for character in text[start:end]):
        out.append((start, end))


def _trimmed_end(text: str, start: int, end: int) -> int:
    """A URL's or path's end without the sentence punctuation after it; a closing bracket stays when the span opened it."""
    while end > start and text[end - 1] in _TRAILING:
        closer = text[end - 1]
        opener = {")": "(", "]": "[", "}": "{"}.get(closer)
        if opener is not None and text.count(opener, start, end) >= text.count(closer, start, end):
            break
        end -= 1
    return end
