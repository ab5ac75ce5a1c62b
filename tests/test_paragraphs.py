"""The paragraph test set of nmt-paragraphs: consecutive pairs, 2 to 5 per paragraph, references joined with a space."""

from __future__ import annotations

import pytest

from nmt_serve.bench.paragraphs import Paragraph, boundaries_found, make_paragraphs


@pytest.mark.parametrize("count", [2, 3, 7, 100, 1001])
def test_make_paragraphs_groups_every_pair_in_order_two_to_five(count: int) -> None:
    pairs = [(f"Satz {index}.", f"Sentence {index}.") for index in range(count)]
    paragraphs = make_paragraphs(pairs, seed=3)
    assert all(2 <= len(paragraph.sentences) <= 5 for paragraph in paragraphs)
    assert [sentence for paragraph in paragraphs for sentence in paragraph.sentences] == [german for german, _ in pairs]
    assert paragraphs[0].reference == " ".join(english for _, english in pairs[: len(paragraphs[0].sentences)])
    assert make_paragraphs(pairs, seed=3) == paragraphs


def test_boundaries_found_counts_missed_and_extra_cuts() -> None:
    paragraphs = [Paragraph(("Er kam.", "Sie ging."), ""), Paragraph(("Halt! Ich komme.", "Gut."), ""),
                  Paragraph(("Er kam am 3.", "Oktober war es kalt."), "")]  # fmt: skip
    assert boundaries_found(paragraphs) == (2, 1)
