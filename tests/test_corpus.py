"""Tests for model.corpus on tiny synthetic Ding and .mo files (no real dictionary needed)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import pytest

from nmt_serve.model.corpus import (
    Counts,
    clean_gettext_string,
    clean_pairs,
    extract_sub_entry,
    is_sentence,
    main,
    read_gettext,
    read_mo,
    read_tsv,
    split_ding_line,
    strip_annotations,
    write_tsv,
)

N_SENTENCES = 40


def write_mo(path: Path, entries: list[tuple[str, str]], endian: str = "<") -> None:
    """Write a minimal .mo file the way msgfmt lays it out (header, two tables, then strings)."""
    entries = sorted(entries)
    n = len(entries)
    orig_off, trans_off = 28, 28 + 8 * n
    blob = b""
    strings_off = trans_off + 8 * n
    orig_table, trans_table = b"", b""
    for i, table in ((0, "orig"), (1, "trans")):
        for entry in entries:
            data = entry[i].encode()
            pos = strings_off + len(blob)
            blob += data + b"\x00"
            if table == "orig":
                orig_table += struct.pack(endian + "2I", len(data), pos)
            else:
                trans_table += struct.pack(endian + "2I", len(data), pos)
    header = struct.pack(endian + "7I", 0x950412DE, 0, n, orig_off, trans_off, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + orig_table + trans_table + blob)


def write_ding(path: Path, n_sentences: int = N_SENTENCES) -> None:
    lines = [
        "# Version :: test 2024-01-01",
        "# comment line :: ignored",
        "Abbruch {m} [comp.] | den Vorgang abbrechen | Der Vorgang wurde abgebrochen. :: abort | to abort the operation | The operation was aborted.",
        "etw. aufgeben {vt} | eine Sache aufgeben :: to give up sth. | to give up a thing",
        "schlecht | nicht gut | zu viel :: bad | not good",  # misaligned: three vs two sub-entries
    ]
    # Many distinct sentences so the hash split has something to choose from.
    lines += [f"Haus {{n}} | Das Haus Nummer {i} ist rot. :: house | House number {i} is red." for i in range(n_sentences)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    ding = tmp_path / "de-en"
    write_ding(ding)
    locale = tmp_path / "locale"
    # The same English as each Ding sentence, with other German, so overlap removal has work to do.
    write_mo(locale / "de" / "LC_MESSAGES" / "app.mo",
             [("", "Content-Type: text/plain; charset=UTF-8\n"), ("_Open File", "Datei _öffnen")]
             + [(f"House number {i} is red.", f"Haus {i} ist rot.") for i in range(N_SENTENCES)])
    write_mo(locale / "de_CH" / "LC_MESSAGES" / "other.mo", [("Save", "Speichern")], endian=">")
    return ding, locale


def run_main(ding: Path, locale: Path, out: Path) -> int:
    return main(["--out", str(out), "--ding", str(ding), "--locale-dir", str(locale), "--help-root", "",
                 "--test-size", "5", "--valid-size", "5"])


@pytest.mark.parametrize("text, expected", [
    ("Der Vorgang wurde abgebrochen.", True),
    ("Keep a distance!", True),
    ("Is it?", False),  # fewer than three words
    ("den Vorgang abbrechen", False),
    ("in conclusion, …", False),  # lower-case start
])
def test_is_sentence_classifies(text: str, expected: bool) -> None:
    assert is_sentence(text) is expected


def test_strip_annotations_removes_all_kinds() -> None:
    text = "Abfallbehälter {m} [envir.] <Abfallbehaelter> /AB/; Müllbehälter {m} [Ös.]"
    assert strip_annotations(text) == "Abfallbehälter; Müllbehälter"


def test_split_ding_line_aligns_sub_entries() -> None:
    pairs = split_ding_line("Haus {n} | Häuser {pl} :: house | houses\n")
    assert pairs == [("Haus", "house"), ("Häuser", "houses")]


def test_split_ding_line_skips_misaligned() -> None:
    assert split_ding_line("schlecht | nicht gut | zu viel :: bad | not good") is None


def test_extract_sub_entry_sentence_vs_phrase() -> None:
    assert extract_sub_entry("Ich folgte ihm.; Ich ging ihm nach.", "I followed him.") == \
        ("sentence", ("Ich folgte ihm.", "I followed him."))
    assert extract_sub_entry("zu Abend essen; Abendbrot essen", "to have supper") == \
        ("phrase", ("zu Abend essen", "to have supper"))
    assert extract_sub_entry("Abendessen", "supper")[0] == "word"


def test_extract_sub_entry_skips_placeholders_and_glosses() -> None:
    # "etw. aufgeben" is dictionary notation; the clean synonym is taken instead.
    assert extract_sub_entry("etw. aufgeben; alles hinschmeißen", "to give up sth.; to chuck it all") == \
        ("phrase", ("alles hinschmeißen", "to chuck it all"))
    assert extract_sub_entry("mit der Bahn (Zug) fahren", "to go by rail") == \
        ("phrase", ("mit der Bahn fahren", "to go by rail"))
    assert extract_sub_entry("eine Region/ein Land", "a region/a country") == ("skipped", None)


@pytest.mark.parametrize("endian", ["<", ">"])
def test_read_mo_plural_and_context(tmp_path: Path, endian: str) -> None:
    path = tmp_path / "x.mo"
    write_mo(path, [("", "header"), ("file\x00files", "Datei\x00Dateien"), ("menu\x04Open", "Öffnen")], endian)
    assert sorted(read_mo(path)) == [("Open", "Öffnen"), ("file", "Datei")]


def test_read_mo_rejects_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.mo"
    path.write_bytes(b"\x00" * 28)
    with pytest.raises(ValueError, match="magic"):
        read_mo(path)


def test_read_gettext_filters_placeholders_and_accelerators(tmp_path: Path) -> None:
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "a.mo", [
        ("_Open File", "Datei _öffnen"),
        ("Deleted %d files", "%d Dateien gelöscht"),
        ("Hello {0}", "Hallo {0}"),
        ("Path ${HOME}", "Pfad ${HOME}"),
        ("Line one\nLine two", "Zeile eins\nZeile zwei"),
        ("<b>Bold</b> text", "<b>Fetter</b> Text"),
        ("12:30 / 45", "12:30 / 45"),
    ])
    counts = Counts()
    pairs, catalogs = read_gettext([str(tmp_path)], counts)
    assert pairs == [("Datei öffnen", "Open File")]
    assert len(catalogs) == 1 and counts.gettext["entries_filtered"] == 6


def test_clean_gettext_string_drops_inline_contexts() -> None:
    assert clean_gettext_string("addontype^Scenario") == "Scenario"
    assert clean_gettext_string("^Quit") == "Quit"
    assert clean_gettext_string("?plural:Werewolves") == "Werewolves"
    assert clean_gettext_string("Is it 3^2? Yes: nine.") == "Is it 3^2? Yes: nine."


def test_clean_pairs_rules_and_dedup() -> None:
    counts = Counts()
    seen: set[tuple[str, str]] = set()
    pairs = [("Haus  ist\tgroß", "house is big"), ("Haus ist groß", "house is big"), ("", "x"),
             ("OK", "ok"), ("a" * 251, "b"), ("Ja", "Yes, and a whole lot more words")]
    assert clean_pairs(pairs, counts, seen) == [("Haus ist groß", "house is big")]
    assert counts.cleaning == {"duplicate": 1, "empty": 1, "identical": 1, "too_long": 1, "length_ratio": 1}


def test_main_test_disjoint_from_train(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_main(*inputs, out) == 0
    train, valid, test = (read_tsv(out / f"{name}.tsv") for name in ("train", "valid", "test"))
    assert len(test) == 5 and len(valid) == 5
    test_sides = {s.casefold() for pair in test for s in pair}
    for de, en in train + valid:
        assert de.casefold() not in test_sides and en.casefold() not in test_sides
    report = json.loads((out / "corpus.json").read_text())
    # Each test sentence has one gettext twin sharing its English side.
    assert report["split"]["removed_overlap_test"] == 5
    assert report["inputs"]["ding_version"] == "test 2024-01-01"
    assert report["ding"]["lines_misaligned"] == 1
    assert report["sources"]["gettext_catalogs"] == 2
    assert ("Datei öffnen", "Open File") in train and ("Speichern", "Save") in train


def test_main_deterministic(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    assert run_main(*inputs, tmp_path / "a") == 0
    assert run_main(*inputs, tmp_path / "b") == 0
    for name in ("train.tsv", "valid.tsv", "test.tsv", "train-sentences.tsv", "train-others.tsv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_sentence_copies_repeat_only_the_training_sentences(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    ding, locale = inputs
    assert run_main(ding, locale, tmp_path / "once") == 0
    args = ["--ding", str(ding), "--locale-dir", str(locale), "--help-root", "", "--test-size", "5", "--valid-size", "5"]
    assert main(["--out", str(tmp_path / "thrice"), *args, "--sentence-copies", "3"]) == 0
    once, thrice = (Counter(read_tsv(tmp_path / name / "train.tsv")) for name in ("once", "thrice"))
    sentences = {pair for pair in once if pair[0].startswith(("Das Haus Nummer", "Der Vorgang"))}  # write_ding's sentences
    assert len(sentences) == N_SENTENCES + 1 - 10  # all but the held-out ones
    assert thrice == once + Counter({pair: 2 for pair in sentences})  # phrases and catalog pairs stay single
    for name in ("valid.tsv", "test.tsv"):
        assert (tmp_path / "once" / name).read_bytes() == (tmp_path / "thrice" / name).read_bytes()
    report = json.loads((tmp_path / "thrice" / "corpus.json").read_text())
    assert report["split"]["train_sentences"] == 3 * len(sentences) and report["inputs"]["sentence_copies"] == 3
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "none"), *args, "--sentence-copies", "0"])


def test_training_parts_split_train_by_source(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    ding, locale = inputs
    out = tmp_path / "corpus"
    args = ["--ding", str(ding), "--locale-dir", str(locale), "--help-root", "", "--test-size", "5", "--valid-size", "5"]
    assert main(["--out", str(out), *args, "--sentence-copies", "3"]) == 0
    train = read_tsv(out / "train.tsv")
    sentences, others = read_tsv(out / "train-sentences.tsv"), read_tsv(out / "train-others.tsv")
    assert sentences and others
    assert all(pair[0].startswith(("Das Haus Nummer", "Der Vorgang")) for pair in sentences)  # write_ding's sentences
    assert not any(pair[0].startswith(("Das Haus Nummer", "Der Vorgang")) for pair in others)
    assert len(set(sentences)) == len(sentences)
    # Together they are train.tsv: each sentence written --sentence-copies times, the others once, in train.tsv's order.
    assert Counter(train) == Counter({pair: 3 for pair in sentences}) + Counter(others)
    assert others == [pair for pair in train if pair not in set(sentences)]
    first_seen = list(dict.fromkeys(pair for pair in train if pair in set(sentences)))
    assert sentences == first_seen


def test_main_test_split_ignores_gettext(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    ding, _ = inputs
    assert run_main(*inputs, tmp_path / "a") == 0
    assert run_main(ding, tmp_path / "no-locale", tmp_path / "b") == 0
    assert (tmp_path / "a" / "test.tsv").read_bytes() == (tmp_path / "b" / "test.tsv").read_bytes()


def test_main_reads_every_locale_root_given(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    ding, locale = inputs
    game = tmp_path / "game-locale"
    write_mo(game / "de" / "LC_MESSAGES" / "story.mo", [("The dragon sleeps in the cave.", "Der Drache schläft in der Höhle.")])
    out = tmp_path / "out"
    assert main(["--out", str(out), "--ding", str(ding), "--locale-dir", str(locale), "--locale-dir", str(game), "--help-root", "",
                 "--test-size", "5", "--valid-size", "5"]) == 0
    report = json.loads((out / "corpus.json").read_text(encoding="utf-8"))
    assert report["inputs"]["locale_dirs"] == [str(locale), str(game)]
    assert report["sources"]["gettext_catalogs"] == 3
    assert "Der Drache schläft in der Höhle.\tThe dragon sleeps in the cave." in (out / "train.tsv").read_text(encoding="utf-8")


def test_main_missing_ding_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "out"), "--ding", str(tmp_path / "nope")]) == 2
    assert "apt-get install trans-de-en" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_write_tsv_read_tsv_roundtrip(tmp_path: Path) -> None:
    pairs = [("Grüß Gott", "hello"), ("Wie geht's?", "How are you?")]
    write_tsv(tmp_path / "x.tsv", pairs)
    assert read_tsv(tmp_path / "x.tsv") == pairs
