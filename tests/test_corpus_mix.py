"""Tests for nmt-corpus-mix: copies per source, held-out overlap removed, validation sets interleaved, every file hashed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nmt_serve.model.corpus import read_tsv, write_tsv
from nmt_serve.model.corpus_mix import interleave, main, parse_part

DING = [("Guten Morgen!", "Good morning!"), ("Guten Morgen!", "Good morning!"), ("Das Haus ist alt.", "The house is old.")]
IMAGES = [("Ein Hund läuft.", "A dog runs."), ("Zwei Männer spielen.", "Two men PLAY!")]  # its English is a test sentence
EVERYDAY = [("Ich bin müde.", "I am tired.")]
TEST = [("Männer spielen.", "two men play")]
VALID_A = [("a1", "A1"), ("a2", "A2"), ("a3", "A3")]
VALID_B = [("b1", "B1"), ("b2", "B2")]


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, pairs in {"ding": DING, "images": IMAGES, "everyday": EVERYDAY, "test": TEST, "valid_a": VALID_A, "valid_b": VALID_B}.items():
        paths[name] = tmp_path / f"{name}.tsv"
        write_tsv(str(paths[name]), pairs)
    return paths


def test_mix_writes_each_source_its_copies_without_held_out_overlap(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "mix"
    assert main(["--out", str(out), "--source", str(files["ding"]), "--source", f"{files['images']}:3",
                 "--source", f"{files['everyday']}:2", "--held-out", str(files["test"]),
                 "--valid", f"{files['valid_a']}:2", "--valid", str(files["valid_b"])]) == 0  # fmt: skip
    train = read_tsv(str(out / "train.tsv"))
    # A source's own repeats stay (in-domain pairs written several times on purpose); the overlapping pair goes.
    assert train == DING + [IMAGES[0]] * 3 + EVERYDAY * 2
    assert read_tsv(str(out / "valid.tsv")) == [VALID_A[0], VALID_B[0], VALID_A[1], VALID_B[1]]
    manifest = json.loads((out / "mix.json").read_text())
    assert manifest["sources"][str(files["images"])] == {"read": 2, "held_out_overlap": 1, "copies": 3, "written": 3}
    assert manifest["train_pairs"] == len(train) and manifest["valid_pairs"] == 4
    assert manifest["files_read"][str(files["test"])] == hashlib.sha256(files["test"].read_bytes()).hexdigest()


def test_part_count_follows_the_last_colon_only_when_it_is_a_number() -> None:
    assert parse_part("data/a.tsv:3", 1).count == 3
    assert parse_part("data/a.tsv", 1).count == 1
    assert str(parse_part("c:/data/a.tsv", 7).path) == "c:/data/a.tsv"


def test_zero_copies_is_refused_by_name(files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "mix"), "--source", f"{files['ding']}:0", "--valid", str(files["valid_a"])])
    assert "the count after ':' must be 1 or more" in capsys.readouterr().err


def test_interleave_keeps_every_pair_in_round_robin_order() -> None:
    assert interleave([[("1", "1"), ("2", "2"), ("3", "3")], [("x", "x")]]) == [("1", "1"), ("x", "x"), ("2", "2"), ("3", "3")]
