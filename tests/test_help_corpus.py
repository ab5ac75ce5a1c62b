"""Pairs from translated HTML help aligned by element id (model/help_corpus.py), on a small page tree written here."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from nmt_serve.model.corpus import clean_gettext_string, main
from nmt_serve.model.help_corpus import aligned_pairs, held_out_paragraphs, read_help, split_sentences, unit_texts
from tests.test_corpus import write_ding, write_mo

GERMAN_PAGE = """<html><body><div id="DisplayArea">
<h1 id="hd_id1"><a name="open"></a>Öffnen von Dokumenten</h1>
<p id="par_id2" class="paragraph">Wählen Sie <span class="menuitem">Datei – Öffnen…</span> und klicken Sie auf <span class="emph">OK</span>.</p>
<p id="par_id3" class="paragraph">Der Cursor steht am Anfang. Drücken Sie <span class="keycode">Umschalt+F5</span>, um ihn zu versetzen.</p>
<p id="par_id4" class="paragraph">Unter <span hidden="true" class="MAC">LibreOffice – Einstellungen</span><span>Extras – Optionen</span> eintragen.</p>
<p id="par_id5" class="paragraph">Ein Satz. Noch einer. Und ein dritter.</p>
<p id="par_id6" class="bascode">Sub Main</p>
<p id="par_id7" class="paragraph">Nur auf Deutsch vorhanden.</p>
<p class="paragraph">Ohne Kennung.</p>
</div></body></html>"""

ENGLISH_PAGE = """<html><body><div id="DisplayArea">
<h1 id="hd_id1"><a name="open"></a>Opening Documents</h1>
<p id="par_id2" class="paragraph">Choose <span class="menuitem">File - Open</span> and click <span class="emph">OK</span>.</p>
<p id="par_id3" class="paragraph">The cursor is at the start. Press <span class="keycode">Shift+F5</span> to move it.</p>
<p id="par_id4" class="paragraph">Enter it under <span hidden="true" class="MAC">LibreOffice - Preferences</span><span>Tools - Options</span>.</p>
<p id="par_id5" class="paragraph">One sentence. And the others together.</p>
<p id="par_id6" class="bascode">Sub Main</p>
<p class="paragraph">Without an id.</p>
</div></body></html>"""


def write_help(root: Path) -> None:
    for language, page in (("de", GERMAN_PAGE), ("en-US", ENGLISH_PAGE)):
        path = root / language / "text" / "shared" / "doc_open.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    only_german = root / "de" / "text" / "shared" / "new.html"
    only_german.write_text(GERMAN_PAGE, encoding="utf-8")


def test_unit_texts_keep_visible_text_of_id_carrying_paragraphs_and_headings() -> None:
    units = unit_texts(GERMAN_PAGE)
    assert units["hd_id1"] == "Öffnen von Dokumenten"
    assert units["par_id2"] == "Wählen Sie Datei – Öffnen… und klicken Sie auf OK."
    assert units["par_id4"] == "Unter Extras – Optionen eintragen."  # the hidden macOS variant is not read
    assert "par_id6" not in units  # code is not a translation
    assert "Ohne Kennung." not in units.values()


def test_aligned_pairs_split_sentences_only_when_both_sides_have_as_many() -> None:
    pairs = aligned_pairs(unit_texts(GERMAN_PAGE), unit_texts(ENGLISH_PAGE))
    assert ("Der Cursor steht am Anfang.", "The cursor is at the start.") in pairs
    assert ("Drücken Sie Umschalt+F5, um ihn zu versetzen.", "Press Shift+F5 to move it.") in pairs
    assert ("Ein Satz. Noch einer. Und ein dritter.", "One sentence. And the others together.") in pairs  # 3 vs 2 sentences
    assert ("Öffnen von Dokumenten", "Opening Documents") in pairs
    assert not any("Nur auf Deutsch" in de for de, _ in pairs)  # no English twin
    assert len(pairs) == 6


def test_split_sentences_breaks_before_capitals_and_digits_only() -> None:
    assert split_sentences("Es kostet ca. 5 Euro. Das ist z.B. viel. 3 Stück.") == ["Es kostet ca.", "5 Euro.", "Das ist z.B. viel.", "3 Stück."]
    assert split_sentences("Wählen Sie Datei - Öffnen... und dann OK.") == ["Wählen Sie Datei - Öffnen... und dann OK."]


def test_read_help_reads_pages_present_in_both_languages(tmp_path: Path) -> None:
    write_help(tmp_path / "help")
    counts: Counter = Counter()
    pairs, pages = read_help(str(tmp_path / "help"), counts)
    assert pages == 1 and counts["pages_without_english"] == 1 and len(pairs) == counts["pairs"] == 4  # 2 held out (below)


def test_read_help_holds_paragraphs_with_verbatim_spans_out_and_held_out_paragraphs_reads_only_them(tmp_path: Path) -> None:
    write_help(tmp_path / "help")
    counts: Counter = Counter()
    pairs, _ = read_help(str(tmp_path / "help"), counts)
    assert not any("Umschalt+F5" in german or "Anfang" in german for german, _ in pairs) and counts["paragraphs_held_out"] == 1
    assert held_out_paragraphs(str(tmp_path / "help")) == [("Der Cursor steht am Anfang. Drücken Sie Umschalt+F5, um ihn zu versetzen.",
                                                            "The cursor is at the start. Press Shift+F5 to move it.")]


def test_libreoffice_tilde_accelerators_are_removed() -> None:
    assert clean_gettext_string("~Datei öffnen") == "Datei öffnen"


def test_nmt_corpus_puts_help_pairs_in_train_only(tmp_path: Path) -> None:
    ding, locale, help_root, out = tmp_path / "de-en", tmp_path / "locale", tmp_path / "help", tmp_path / "out"
    write_ding(ding)
    write_mo(locale / "de" / "LC_MESSAGES" / "app.mo", [("~Save", "~Speichern")])
    write_help(help_root)
    assert main(["--out", str(out), "--ding", str(ding), "--locale-dir", str(locale), "--help-root", str(help_root),
                 "--test-size", "5", "--valid-size", "5"]) == 0  # fmt: skip
    train = (out / "train.tsv").read_text(encoding="utf-8")
    assert "Öffnen von Dokumenten\tOpening Documents" in train and "Speichern\tSave" in train
    for held_out in ("valid.tsv", "test.tsv"):
        assert "Dokumenten" not in (out / held_out).read_text(encoding="utf-8")
    report = json.loads((out / "corpus.json").read_text(encoding="utf-8"))
    assert report["sources"]["help_pairs"] == 4 and report["help"]["pages"] == 1 and report["help"]["paragraphs_held_out"] == 1
    assert report["inputs"]["help_roots"] == [str(help_root)]
