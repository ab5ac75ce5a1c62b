"""Placing inline tags in a translation (model/inline_tags.py), on given translations: each method in its order, word
edges, nesting, sibling order, fixed characters, and the deterministic fallbacks."""

from __future__ import annotations

import pytest

from nmt_serve.model.inline_tags import Placement, TagSpan, place_tags


def span(source: str, words: str, translated: str | None, parent: int = -1, after: int = 0) -> TagSpan:
    start = source.index(words, after)
    return TagSpan(start, start + len(words), parent, translated)


def placed(translation: str, placements: list[Placement]) -> list[tuple[str, str]]:
    return [(translation[placement.start : placement.end], placement.method) for placement in placements]


SOURCE = "Klicken Sie auf Datei, um die Datei zu speichern."


@pytest.mark.parametrize(("translation", "probe", "expected"), [
    ("Click File to save the file.", "File", ("File", "exact")),
    ("Click file to save it.", "File", ("file", "case")),
    ("Click File to save it.", "File.", ("File", "trimmed")),
    ("Click file to save it.", "„File“", ("file", "trimmed")),
    ("Click the files to save them.", "File", ("files", "stem")),
    ("Click Datei to save it.", "Folder", ("Datei", "source")),
])  # fmt: skip
def test_each_method_finds_the_element_in_its_order(translation: str, probe: str, expected: tuple[str, str]) -> None:
    assert placed(translation, place_tags(SOURCE, translation, [span(SOURCE, "Datei", probe)])) == [expected]


def test_a_word_moved_across_the_tag_keeps_its_tag() -> None:
    source = "Sie haben die Datei gespeichert."
    translation = "You have saved the file."
    assert placed(translation, place_tags(source, translation, [span(source, "gespeichert", "saved")])) == [("saved", "exact")]


def test_a_match_must_start_and_end_at_word_edges() -> None:
    translation = "Open the profile menu and the file."
    assert placed(translation, place_tags(SOURCE, translation, [span(SOURCE, "Datei", "file")])) == [("file", "exact")]
    assert place_tags(SOURCE, "Open the profile menu.", [span(SOURCE, "Datei", "file")])[0].method == "relative"


def test_the_fallback_wraps_whole_words_at_the_relative_place() -> None:
    # "Datei" spans 16..21 of 49 source characters: 0.33..0.43 of the 30 translated ones, 10..13, widened to "save".
    translation = "Click to save the thing safely"
    assert placed(translation, place_tags(SOURCE, translation, [span(SOURCE, "Datei", "Folder")])) == [("save", "relative")]


def test_an_element_holding_all_of_its_parent_takes_all_of_its_place() -> None:
    source = "Klicken Sie hier"
    translation = "Click here"
    spans = [TagSpan(0, len(source), -1, None), TagSpan(0, len(source), 0, None)]
    assert placed(translation, place_tags(source, translation, spans)) == [("Click here", "whole"), ("Click here", "whole")]


def test_an_empty_element_goes_to_the_word_start_at_its_relative_place() -> None:
    source = "Einleitung und Anfang"
    placements = place_tags(source, "Introduction and start", [TagSpan(0, 0, -1, None), TagSpan(15, 15, -1, None)])
    assert [(placement.start, placement.end, placement.method) for placement in placements] == [(0, 0, "empty"), (17, 17, "empty")]


def test_children_are_placed_inside_their_parent() -> None:
    source = "Lesen Sie die Hilfe: klicken Sie hier, um die Hilfe zu öffnen."
    translation = "Read the help: click here to open the help."
    parent = span(source, "klicken Sie hier", "click here")
    child = TagSpan(source.index("hier"), source.index("hier") + 4, 0, "here")
    assert placed(translation, place_tags(source, translation, [parent, child])) == [("click here", "exact"), ("here", "exact")]
    # The child's word is not inside the parent's place: it falls back inside the parent, never outside it.
    assert placed("click now here", place_tags(source, "click now here", [parent, child]))[1][0] in ("click", "now")


def test_siblings_keep_their_order() -> None:
    source = "Die Datei wird gespeichert."
    first, second = span(source, "Datei", "file"), span(source, "gespeichert", "saved")
    translation = "The file is saved."
    assert placed(translation, place_tags(source, translation, [first, second])) == [("file", "exact"), ("saved", "exact")]
    # The second one's words come before the first's: it is not looked for there, and lands after the first.
    swapped = "Saved is the file."
    placements = place_tags(source, swapped, [first, second])
    assert placed(swapped, placements)[0] == ("file", "exact") and placements[1].start >= placements[0].end


def test_an_element_holds_exactly_the_fixed_characters_it_held() -> None:
    source = "Drücken Sie \ue000 und dann \ue001 erneut."
    translation = "Press \ue000 and then press \ue001 again."
    inside = TagSpan(0, source.index("\ue000") + 1, -1, "Press \ue000")
    fixed = [(source.index("\ue000"), translation.index("\ue000")), (source.index("\ue001"), translation.index("\ue001"))]
    assert placed(translation, place_tags(source, translation, [inside], fixed)) == [("Press \ue000", "exact")]
    # "press" after the second fixed character may not be taken by an element that stood before it.
    before = span(source, "dann", "press")
    placements = place_tags(source, translation, [before], fixed)
    assert translation.index("\ue000") < placements[0].start and placements[0].end <= translation.index("\ue001")
    # A fallback widens to hold its fixed character.
    loose = TagSpan(0, source.index("\ue000") + 1, -1, "Push")
    placements = place_tags(source, translation, [loose], fixed)
    assert placements[0].method == "relative" and placements[0].start <= translation.index("\ue000") < placements[0].end


def test_a_parent_listed_after_its_child_is_refused() -> None:
    with pytest.raises(ValueError, match="does not come before it"):
        place_tags("a b", "a b", [TagSpan(0, 1, 1, "a"), TagSpan(0, 3, -1, None)])
