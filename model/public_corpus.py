"""nmt-corpus-public: Multi30k and Tatoeba pairs as TSVs, deduplicated against every reported test and validation set."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import sys
import unicodedata
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from importlib.metadata import version

from nmt_serve.model.corpus import Pair, normalize_text, read_tsv, write_tsv
from nmt_serve.model.file_hash import sha256_file

logger = logging.getLogger(__name__)

# Multi30k task 1, raw and untokenised: one gzip file per split and language, aligned line by line.
MULTI30K_TRAIN = "train"
MULTI30K_VALID = "val"
MULTI30K_TESTS = ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco")
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}.gz"
MULTI30K_CITATION = (
    "Elliott, Frank, Sima'an, Specia. Multi30K: Multilingual English-German Image Descriptions. "
    "Proceedings of the 5th Workshop on Vision and Language, 2016."
)
TATOEBA_CREDIT = "Tatoeba, tatoeba.org (CC-BY 2.0 FR), German-English pairs as exported by manythings.org/anki"

_NON_WORD_RE = re.compile(r"[\W_]+")


def overlap_key(text: str) -> str:
    """The form two texts are compared in for deduplication: NFKC, case-folded, punctuation and spacing removed."""
    return _NON_WORD_RE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


class FileLedger:
    """Every file read, with its SHA-256: what the corpus manifest records."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def open_lines(self, path: Path) -> list[str]:
        self.files[str(path)] = sha256_file(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", newline="") as stream:
            return [line.rstrip("\r\n") for line in stream]


def read_multi30k_split(directory: Path, split: str, ledger: FileLedger) -> list[Pair]:
    """One Multi30k split as (German, English) pairs; the two files must have as many lines."""
    german = ledger.open_lines(directory / f"{split}.de.gz")
    english = ledger.open_lines(directory / f"{split}.en.gz")
    if len(german) != len(english):
        raise ValueError(f"{directory}/{split}: {len(german)} German lines but {len(english)} English ones; the files must be aligned")
    return [(normalize_text(de), normalize_text(en)) for de, en in zip(german, english)]


def read_tatoeba(path: Path, ledger: FileLedger) -> list[Pair]:
    """Tatoeba's English<TAB>German export (a `1<TAB>2` header line, CRLF line ends) as (German, English) pairs."""
    pairs = []
    for number, line in enumerate(ledger.open_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{path}:{number}: expected English<TAB>German, got {line[:60]!r}")
        english, german = normalize_text(fields[0]), normalize_text(fields[1])
        if (english, german) == ("1", "2") and number == 1:
            continue  # the export's header
        if english and german:
            pairs.append((german, english))
    return pairs


def download_multi30k(directory: Path, splits: Iterable[str]) -> None:
    """Fetch the raw Multi30k files into `directory`; only ever called on the user's explicit flag."""
    directory.mkdir(parents=True, exist_ok=True)
    for split in splits:
        for language in ("de", "en"):
            name = f"{split}.{language}"
            target = directory / f"{name}.gz"
            if target.is_file():
                continue
            logger.info("downloading %s", MULTI30K_URL.format(name=name))
            partial = target.with_suffix(".gz.part")
            urllib.request.urlretrieve(MULTI30K_URL.format(name=name), partial)
            partial.rename(target)


def held_out_keys(held_out: dict[str, list[Pair]]) -> set[str]:
    return {overlap_key(text) for pairs in held_out.values() for pair in pairs for text in pair}


def deduplicate(pairs: Sequence[Pair], held_out: set[str]) -> tuple[list[Pair], dict[str, int]]:
    """Drop pairs whose German or English side occurs in a held-out set, then exact repeats; count both."""
    kept, seen, counts = [], set(), {"read": len(pairs), "held_out_overlap": 0, "repeats": 0, "empty": 0}
    for de, en in pairs:
        if not de or not en:
            counts["empty"] += 1
        elif overlap_key(de) in held_out or overlap_key(en) in held_out:
            counts["held_out_overlap"] += 1
        elif (de, en) in seen:
            counts["repeats"] += 1
        else:
            seen.add((de, en))
            kept.append((de, en))
    counts["kept"] = len(kept)
    return kept, counts


def build_public_corpus(args: argparse.Namespace) -> dict:
    ledger = FileLedger()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    held_out: dict[str, list[Pair]] = {}
    sources: dict[str, list[Pair]] = {}
    if args.multi30k:
        directory = Path(args.multi30k)
        if args.download_multi30k:
            download_multi30k(directory, (MULTI30K_TRAIN, MULTI30K_VALID, *MULTI30K_TESTS))
        held_out["multi30k-valid"] = read_multi30k_split(directory, MULTI30K_VALID, ledger)
        for split in MULTI30K_TESTS:
            held_out[f"multi30k-{split}"] = read_multi30k_split(directory, split, ledger)
        sources["multi30k"] = read_multi30k_split(directory, MULTI30K_TRAIN, ledger)
    for path in args.held_out or ():
        held_out[Path(path).stem] = read_tsv(path)
        ledger.files[str(path)] = sha256_file(Path(path))
    if args.tatoeba:
        sources["tatoeba"] = read_tatoeba(Path(args.tatoeba), ledger)
    keys = held_out_keys(held_out)
    report: dict = {"sources": {}, "held_out": {name: len(pairs) for name, pairs in held_out.items()}}
    for name, pairs in held_out.items():
        write_tsv(str(out / f"{name}.tsv"), pairs)
    for name, pairs in sources.items():
        kept, counts = deduplicate(pairs, keys)
        write_tsv(str(out / f"{name}-train.tsv"), kept)
        report["sources"][name] = counts
    report["files_read"] = ledger.files
    report["credits"] = {name: credit for name, credit in (("multi30k", MULTI30K_CITATION), ("tatoeba", TATOEBA_CREDIT)) if name in sources}
    (out / "manifest.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nmt-corpus-public", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--out", required=True, help="output dir: SOURCE-train.tsv per source, one TSV per held-out set, manifest.json")
    parser.add_argument("--multi30k", help="dir of Multi30k task 1 raw files (train.de.gz, val.en.gz, test_2016_flickr.de.gz, ...)")
    parser.add_argument("--download-multi30k", action="store_true",
                        help="fetch the Multi30k files missing from --multi30k from the dataset's public repository first")  # fmt: skip
    parser.add_argument("--tatoeba", help="Tatoeba English<TAB>German TSV export (deu.txt / deu-eng TSV)")
    parser.add_argument("--held-out", action="append",
                        help="another German<TAB>English TSV no training pair may share a side with (e.g. nmt-corpus's test.tsv and valid.tsv); repeatable")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.multi30k and not args.tatoeba:
        parser.error("give --multi30k DIR and/or --tatoeba FILE")
    if args.download_multi30k and not args.multi30k:
        parser.error("--download-multi30k needs --multi30k DIR (where the files go)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        report = build_public_corpus(args)
    except (OSError, ValueError) as error:
        print(f"nmt-corpus-public: {error}", file=sys.stderr)
        return 1
    for name, counts in report["sources"].items():
        logger.info("%s: read %d, lost %d to held-out overlap, %d repeats; kept %d",
                    name, counts["read"], counts["held_out_overlap"], counts["repeats"], counts["kept"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
