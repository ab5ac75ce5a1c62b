"""nmt-corpus-mix: one training TSV from several corpora, each written a chosen number of times, with no pair that
shares a side with any held-out set, and one validation TSV that interleaves several validation sets."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.corpus import Pair, read_tsv, write_tsv
from nmt_serve.model.file_hash import sha256_file
from nmt_serve.model.public_corpus import overlap_key

logger = logging.getLogger(__name__)

MANIFEST_FILE = "mix.json"


@dataclass(frozen=True)
class Part:
    """A TSV and a count: how many times a training source is written, or how many validation pairs are taken."""

    path: Path
    count: int


def parse_part(text: str, default: int) -> Part:
    """`PATH` or `PATH:N`; the count is whatever follows the last colon when it is a number."""
    head, colon, tail = text.rpartition(":")
    if colon and tail.isdigit():
        if int(tail) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: the count after ':' must be 1 or more")
        return Part(Path(head), int(tail))
    return Part(Path(text), default)


def interleave(sets: Sequence[list[Pair]]) -> list[Pair]:
    """Round-robin over the sets, so any prefix (the trainer scores the first N) holds each in equal share."""
    mixed: list[Pair] = []
    for index in range(max((len(pairs) for pairs in sets), default=0)):
        mixed.extend(pairs[index] for pairs in sets if index < len(pairs))
    return mixed


def build_mix(sources: Sequence[Part], held_out: Sequence[Path], valid: Sequence[Part], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    files = {str(path): sha256_file(path) for path in [*(part.path for part in sources), *held_out, *(part.path for part in valid)]}
    keys = {overlap_key(text) for path in held_out for pair in read_tsv(str(path)) for text in pair}
    report: dict = {"sources": {}, "held_out": [str(path) for path in held_out], "files_read": files}
    train: list[Pair] = []
    for part in sources:
        pairs = read_tsv(str(part.path))
        # Repeats inside a source stay: a corpus may write its in-domain pairs several times on purpose.
        kept = [pair for pair in pairs if overlap_key(pair[0]) not in keys and overlap_key(pair[1]) not in keys]
        train.extend(kept * part.count)
        report["sources"][str(part.path)] = {"read": len(pairs), "held_out_overlap": len(pairs) - len(kept), "copies": part.count,
                                             "written": len(kept) * part.count}  # fmt: skip
    validation = interleave([read_tsv(str(part.path))[: part.count] for part in valid])
    write_tsv(str(out / "train.tsv"), train)
    write_tsv(str(out / "valid.tsv"), validation)
    report.update(train_pairs=len(train), valid={str(part.path): part.count for part in valid}, valid_pairs=len(validation))
    (out / MANIFEST_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nmt-corpus-mix", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--out", type=Path, required=True, help=f"output dir: train.tsv, valid.tsv and {MANIFEST_FILE}")
    parser.add_argument("--source", action="append", required=True, type=lambda text: parse_part(text, 1),
                        help="a German<TAB>English training TSV, PATH or PATH:COPIES (default 1); repeatable")  # fmt: skip
    parser.add_argument("--held-out", action="append", type=Path, default=[],
                        help="a test or validation TSV no training pair may share a side with (normalised); repeatable")  # fmt: skip
    parser.add_argument("--valid", action="append", required=True, type=lambda text: parse_part(text, sys.maxsize),
                        help="a validation TSV, PATH or PATH:N for its first N pairs; several are interleaved; repeatable")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        report = build_mix(args.source, args.held_out, args.valid, args.out)
    except OSError as error:
        print(f"nmt-corpus-mix: {error}", file=sys.stderr)
        return 1
    for path, counts in report["sources"].items():
        logger.info("%s: read %d, lost %d to held-out overlap, written %d times: %d",
                    path, counts["read"], counts["held_out_overlap"], counts["copies"], counts["written"])  # fmt: skip
    logger.info("train.tsv: %d pairs; valid.tsv: %d pairs", report["train_pairs"], report["valid_pairs"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
