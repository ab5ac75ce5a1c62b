"""Tokenizer: special ids, round trips (umlauts, ß, emoji, empty text), save/load."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from nmt_serve.model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from nmt_serve.model.tokenizer import SPECIAL_TOKENS, Tokenizer

TEXTS = ["Grüße aus München, sagte der Bär.", "Die Straße ist groß und schön.", "Good morning, how are you?"] * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=300)


def test_tokenizer_special_ids_are_fixed(tokenizer: Tokenizer) -> None:
    assert [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]



def test_tokenizer_treats_special_tokens_in_text_as_text(tokenizer: Tokenizer) -> None:
    text = "".join(SPECIAL_TOKENS)
    ids = tokenizer.encode(text)
    assert not {PAD_ID, BOS_ID, EOS_ID, UNK_ID} & set(ids)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    ["Grüße aus München", "Straße, Fuß, weiß", "ÄÖÜ äöü ß ẞ", "Guten Morgen 🌞👍🏽", "Ünïcödé — “quotes” …", "שלום", "e\u0301", "", "  two  spaces  "],
)
def test_tokenizer_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert UNK_ID not in ids
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_tokenizer_empty_text_has_no_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("") == []
    assert tokenizer.decode([]) == ""


def test_tokenizer_decode_drops_special_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("schön")
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, PAD_ID]) == "schön"


def test_tokenizer_learns_merges_for_frequent_words(tokenizer: Tokenizer) -> None:
    assert len(tokenizer.encode("München")) < len("München".encode())


def test_tokenizer_save_load_gives_same_ids(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.encode_batch(TEXTS[:3]) == tokenizer.encode_batch(TEXTS[:3])
    assert loaded.vocab_size == tokenizer.vocab_size


def test_tokenizer_load_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.load(tmp_path / "nope.json")
