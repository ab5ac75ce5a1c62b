"""Verbatim span detection, rule by rule on a table of cases, and cutting sentences around the spans."""

from __future__ import annotations

import pytest

from nmt_serve.model.verbatim import RULE_NAMES, RULES, cut, detect, merge, occurrences

# (rule, text, the spans it must find as strings); an empty tuple: the rule finds nothing in the text.
CASES = [
    ("inline_code", "Führen Sie `make test` aus.", ("`make test`",)),
    ("inline_code", "Zwei: `a` und `b`.", ("`a`", "`b`")),
    ("inline_code", "Ein einzelnes ` bleibt Text.", ()),
    ("url", "Siehe https://example.org/pfad?x=1&y=2.", ("https://example.org/pfad?x=1&y=2",)),
    ("url", "Öffnen Sie file:///home/me/Test, dann weiter.", ("file:///home/me/Test",)),
    ("url", "(siehe https://de.wikipedia.org/wiki/Foo_(Bar))", ("https://de.wikipedia.org/wiki/Foo_(Bar)",)),
    ("url", "Besuchen Sie www.libreoffice.org!", ("www.libreoffice.org",)),
    ("url", "Das ist kein Link: http:/ kaputt", ()),
    ("email", "Schreiben Sie an users@de.libreoffice.org.", ("users@de.libreoffice.org",)),
    ("email", "Kontakt: mein.name+tag@mein-provider.de", ("mein.name+tag@mein-provider.de",)),
    ("email", "Das @-Zeichen allein ist keine Adresse.", ()),
    ("unix_path", "Bearbeiten Sie /etc/fstab als root.", ("/etc/fstab",)),
    ("unix_path", "Die Datei liegt in ~/.config/libreoffice/4/user.", ("~/.config/libreoffice/4/user",)),
    ("unix_path", "Starten Sie ./configure oder ../bin/soffice.", ("./configure", "../bin/soffice")),
    ("unix_path", "Verzeichnis /usr/lib/, dann", ("/usr/lib/",)),
    ("unix_path", "und/oder 50 km/h sind keine Pfade; 1/2 auch nicht.", ()),
    ("windows_path", r"Installiert unter C:\Program Files\LibreOffice\program\soffice.exe.", (r"C:\Program Files\LibreOffice\program\soffice.exe",)),
    ("windows_path", r"Die Freigabe \\server\daten\berichte ist offen.", (r"\\server\daten\berichte",)),
    ("windows_path", r"Ein Backslash \ allein, oder ein Doppelpunkt: kein Pfad.", ()),
    ("file_name", "Speichern Sie als bericht.odt oder daten.csv.", ("bericht.odt", "daten.csv")),
    ("file_name", "Die Datei msgbox.py enthält das Makro.", ("msgbox.py",)),
    ("file_name", "Das ist z.B. ein Satz.", ()),
    ("printf", "%s Dateien in %d Ordnern", ("%s", "%d")),
    ("printf", "Seite %1$d von %2$d, %-10.2f %ld 100%%", ("%1$d", "%2$d", "%-10.2f", "%ld", "%%")),
    ("printf", "Wert %(count)d von %(name)s", ("%(count)d", "%(name)s")),
    ("printf", "Mehr als 50 % der Nutzer", ()),
    ("brace_placeholder", "Hallo {name}, du hast {0} neue und {count:d} alte {} Nachrichten.", ("{name}", "{0}", "{count:d}", "{}")),
    ("brace_placeholder", "Pfad ${HOME}/bin und ${XDG_CONFIG_HOME}", ("${HOME}", "${XDG_CONFIG_HOME}")),
    ("brace_placeholder", "Eine {geschweifte Klammer} mit Leerzeichen", ()),
    ("shell_variable", "Setzen Sie $PATH und $LANG.", ("$PATH", "$LANG")),
    ("shell_variable", "Das kostet $5 oder $Preis.", ()),
    ("key_combination", "Drücken Sie Strg+Alt+T.", ("Strg+Alt+T",)),
    ("key_combination", "Mit Umschalt+F5 oder Ctrl + Shift + Enter", ("Umschalt+F5", "Ctrl + Shift + Enter")),
    ("key_combination", "Umschalt+Eingabetaste und Strg+Pfeil nach oben", ("Umschalt+Eingabetaste", "Strg+Pfeil nach oben")),
    ("key_combination", "Befehl+Q beendet, Alt-F4 auch.", ("Befehl+Q", "Alt-F4")),
    ("key_combination", "Strg+Alt+Entf startet neu", ("Strg+Alt+Entf",)),
    ("key_combination", "Die Alternative ist Shift-Arbeit.", ()),
]


@pytest.mark.parametrize(("rule_name", "text", "expected"), CASES)
def test_rule_finds_exactly_its_spans(rule_name: str, text: str, expected: tuple[str, ...]) -> None:
    (rule,) = [rule for rule in RULES if rule.name == rule_name]
    assert tuple(text[start:end] for start, end in detect(text, [rule])) == expected


def test_every_rule_has_cases_that_find_something_and_cases_that_find_nothing() -> None:
    for name in RULE_NAMES:
        assert {bool(expected) for rule, _, expected in CASES if rule == name} == {True, False}, name


@pytest.mark.parametrize(("text", "expected"), [
    ("Öffnen Sie `cat /etc/fstab` im Terminal.", ("`cat /etc/fstab`",)),  # a path inside code: one span
    ("Siehe {Installation}/share/Scripts/python.", ("{Installation}/share/Scripts/python",)),  # touching spans join
    ("Mit Strg+Alt+T öffnen Sie ein Terminal und rufen gsettings auf.", ("Strg+Alt+T",)),
])  # fmt: skip
def test_detect_merges_overlapping_and_touching_spans_of_different_rules(text: str, expected: tuple[str, ...]) -> None:
    assert tuple(text[start:end] for start, end in detect(text)) == expected


def test_occurrences_finds_every_occurrence_of_each_string() -> None:
    assert occurrences("LibreOffice und LibreOffice Calc", ["LibreOffice", "Calc", ""]) == [(0, 11), (16, 27), (28, 32)]


def test_merge_joins_overlapping_and_touching_spans() -> None:
    assert merge([(5, 8), (0, 2), (1, 3), (8, 9), (11, 12)]) == [(0, 3), (5, 9), (11, 12)]


def test_cut_translates_the_pieces_between_spans_and_keeps_punctuation_between_them() -> None:
    text = "Bearbeiten Sie /etc/fstab und /etc/hosts. Dann neu starten."
    sentences = [(0, 41), (42, 59)]
    pieces = cut(sentences, detect(text), text)
    assert [text[start:end] for start, end in pieces] == ["Bearbeiten Sie", "und", "Dann neu starten."]


def test_cut_keeps_the_separator_after_a_span_as_written() -> None:
    text = "Drücken Sie Strg+S, um das Dokument zu speichern; oder /etc/fstab: dort."
    pieces = cut([(0, len(text))], detect(text), text)
    assert [text[start:end] for start, end in pieces] == ["Drücken Sie", "um das Dokument zu speichern; oder", "dort."]


def test_cut_keeps_a_sentence_that_is_only_spans_whole() -> None:
    text = "/etc/fstab, /etc/hosts."
    assert cut([(0, len(text))], detect(text), text) == []


def test_cut_leaves_sentences_without_spans_alone() -> None:
    text = "Guten Morgen. 123."
    assert cut([(0, 13), (14, 18)], [], text) == [(0, 13), (14, 18)]
    assert cut([(0, 13), (14, 18)], [(20, 21)], text) == [(0, 13), (14, 18)]
