"""Tests for nmt-corpus-public on small Multi30k and Tatoeba files written in the test session's own formats."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from nmt_serve.model import public_corpus
from nmt_serve.model.corpus import read_tsv, write_tsv
from nmt_serve.model.public_corpus import MULTI30K_TESTS, main, overlap_key

TRAIN = [
    ("Ein Hund läuft über die Wiese.", "A dog runs across the meadow."),
    ("Zwei Männer spielen Fußball.", "Two men play football."),  # its English is a test sentence (other spelling)
    ("Eine Frau liest ein Buch.", "A woman reads a book."),
    ("Eine Frau liest ein Buch.", "A woman reads a book."),  # an exact repeat
    ("Kinder  spielen im Schnee!", "Children play in the snow."),  # its German is the validation sentence's
]
VALID = [("kinder spielen im schnee", "Kids are playing in snow.")]
TEST = [("Zwei Männer kicken.", "two men play  FOOTBALL")]


def write_split(directory: Path, split: str, pairs: list[tuple[str, str]]) -> None:
    for index, language in enumerate(("de", "en")):
        with gzip.open(directory / f"{split}.{language}.gz", "wt", encoding="utf-8") as stream:
            stream.write("".join(pair[index] + "\n" for pair in pairs))


@pytest.fixture()
def multi30k_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "multi30k"
    directory.mkdir()
    write_split(directory, "train", TRAIN)
    write_split(directory, "val", VALID)
    for index, split in enumerate(MULTI30K_TESTS):
        write_split(directory, split, TEST if index == 0 else [(f"Satz {index}.", f"Sentence {index}.")])
    return directory


@pytest.fixture()
def tatoeba_file(tmp_path: Path) -> Path:
    path = tmp_path / "deu-eng.tsv"
    # The export's layout: a "1<TAB>2" header, English first, CRLF line ends.
    rows = ["1\t2", "Hi.\tHallo!", "Go.\tGeh.", "Two men play football.\tZwei Männer spielen Fußball.", "Hi.\tHallo!"]
    path.write_bytes("".join(row + "\r\n" for row in rows).encode("utf-8"))
    return path


def test_overlap_key_ignores_case_punctuation_and_spacing() -> None:
    assert overlap_key("Two men play  FOOTBALL") == overlap_key("two men play football.")
    assert overlap_key("Kinder  spielen im Schnee!") == "kinder spielen im schnee"


def test_training_pairs_sharing_a_side_with_a_held_out_set_are_dropped_and_counted(multi30k_dir: Path, tatoeba_file: Path,
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "out"
    assert main(["--out", str(out), "--multi30k", str(multi30k_dir), "--tatoeba", str(tatoeba_file)]) == 0
    assert read_tsv(str(out / "multi30k-train.tsv")) == [TRAIN[0], TRAIN[2]]
    assert read_tsv(str(out / "tatoeba-train.tsv")) == [("Hallo!", "Hi."), ("Geh.", "Go.")]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"]["multi30k"] == {"read": 5, "held_out_overlap": 2, "repeats": 1, "empty": 0, "kept": 2}
    assert manifest["sources"]["tatoeba"] == {"read": 4, "held_out_overlap": 1, "repeats": 1, "empty": 0, "kept": 2}
    assert read_tsv(str(out / "multi30k-test_2016_flickr.tsv")) == [("Zwei Männer kicken.", "two men play FOOTBALL")]
    assert read_tsv(str(out / "multi30k-valid.tsv")) == VALID
    assert set(manifest["credits"]) == {"multi30k", "tatoeba"}


def test_every_file_read_is_in_the_manifest_with_its_sha256(multi30k_dir: Path, tatoeba_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ding_test = tmp_path / "test.tsv"
    write_tsv(str(ding_test), [("Hallo!", "Hello!")])
    assert main(["--out", str(out), "--multi30k", str(multi30k_dir), "--tatoeba", str(tatoeba_file), "--held-out", str(ding_test)]) == 0
    files = json.loads((out / "manifest.json").read_text())["files_read"]
    expected = [tatoeba_file, ding_test, *sorted(multi30k_dir.glob("*.gz"))]
    assert sorted(files) == sorted(str(path) for path in expected)
    for path in expected:
        assert files[str(path)] == hashlib.sha256(path.read_bytes()).hexdigest()
    # "Hallo!" is the German side of a held-out pair now, so Tatoeba loses both "Hi." rows.
    assert read_tsv(str(out / "tatoeba-train.tsv")) == [("Geh.", "Go.")]


def test_misaligned_multi30k_files_are_refused_by_name(multi30k_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with gzip.open(multi30k_dir / "train.en.gz", "wt", encoding="utf-8") as stream:
        stream.write("only one line\n")
    assert main(["--out", str(tmp_path / "out"), "--multi30k", str(multi30k_dir)]) == 1
    assert "train: 5 German lines but 1 English ones" in capsys.readouterr().err


def test_nothing_is_downloaded_without_the_explicit_flag(multi30k_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(public_corpus.urllib.request, "urlretrieve", refuse)
    (multi30k_dir / "val.de.gz").unlink()
    assert main(["--out", str(tmp_path / "out"), "--multi30k", str(multi30k_dir)]) == 1


def test_download_fetches_only_the_missing_files(multi30k_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = []

    def fetch_from_a_local_copy(url: str, target: Path) -> None:
        name = url.rsplit("/", 1)[1]
        fetched.append(name)
        Path(target).write_bytes((tmp_path / "copies" / name).read_bytes())

    (tmp_path / "copies").mkdir()
    for name in ("val.de.gz", "val.en.gz"):
        (multi30k_dir / name).rename(tmp_path / "copies" / name)
    monkeypatch.setattr(public_corpus.urllib.request, "urlretrieve", fetch_from_a_local_copy)
    assert main(["--out", str(tmp_path / "out"), "--multi30k", str(multi30k_dir), "--download-multi30k"]) == 0
    assert sorted(fetched) == ["val.de.gz", "val.en.gz"]
    assert read_tsv(str(tmp_path / "out" / "multi30k-valid.tsv")) == VALID


def test_a_source_is_required(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
