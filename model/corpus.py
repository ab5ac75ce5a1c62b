"""Build the German->English train/valid/test TSVs from the Ding dictionary, gettext catalogs and translated HTML help."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version

from nmt_serve.model.help_corpus import DEFAULT_HELP_ROOT, read_help

DEFAULT_DING = "/usr/share/trans/de-en"
DEFAULT_LOCALE_DIR = "/usr/share/locale"
# Games keep their catalogs under their own data directory (wesnoth, widelands); their story and
# help texts are whole sentences, closer to the held-out Ding sentences than UI labels are.
GAME_LOCALE_GLOBS = ("/usr/share/games/*/locale", "/usr/share/games/*/*/locale", "/usr/share/games/*/*/*/locale")
# LibreOffice keeps its UI catalogs (libreoffice-l10n-de) outside /usr/share/locale.
LIBREOFFICE_LOCALE_DIR = "/usr/lib/libreoffice/program/resource"
MAX_CHARS = 250
MAX_RATIO = 3.0
RATIO_MIN_CHARS = 10  # short strings ("OK" -> "Okay") vary too much in length to judge by ratio
MAX_GETTEXT_CHARS = 200

Pair = tuple[str, str]  # (German, English)

# Ding annotations that are metadata, not text: {n} [ugs.] <Alternativschreibung> /Abk./
_ANNOTATION_RE = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>|(?<!\S)/[^/\s][^/]*/(?=[\s;]|$)")
# Valency placeholders ("etw. aufgeben" / "to abdicate sth.") are dictionary notation, not text.
_PLACEHOLDER_RE = re.compile(
    r"(?<![\w-])(jd|jds|jdm|jdn|jmd|jmdm|jmdn|etw|sb|sth|so|s\.o|o\.s)\.|\bone['’]s\b|\boneself\b|\bsich/",
    re.IGNORECASE,
)
_PARENS_RE = re.compile(r"\s*\([^()]*\)")
_SENTENCE_ALT_RE = re.compile(r"(?<=[.!?…]);\s+")
_SENTENCE_END = (".", "!", "?", "…")

_MO_MAGIC = 0x950412DE
_PRINTF_RE = re.compile(r"%(\d+\$)?[-+ #0']*(\d+|\*)?(\.\d+)?[hlLqjzt]*[a-zA-Z%@]|%\([^)]*\)")
_BRACE_RE = re.compile(r"\{[\w.:!-]*\}|\$\{?[A-Za-z_]\w*\}?")
_MARKUP_RE = re.compile(r"<[^>]*>|&\w+;")
_ACCEL_RE = re.compile(r"[_&~](?=\w)")  # GTK _, Qt &, LibreOffice ~
# Disambiguation written into the string itself: wesnoth's "context^Text", freeciv's "?qualifier:Text".
_INLINE_CONTEXT_RE = re.compile(r"^(\?[\w ]+:|[A-Za-z_]*\^)")
_SPACE_RE = re.compile(r"\s+")


@dataclass
class Counts:
    """Named counters the report and corpus.json are built from."""

    ding: Counter = field(default_factory=Counter)
    gettext: Counter = field(default_factory=Counter)
    help: Counter = field(default_factory=Counter)
    cleaning: Counter = field(default_factory=Counter)
    split: Counter = field(default_factory=Counter)


def normalize_text(text: str) -> str:
    """NFC plus collapsed whitespace; also removes tabs/newlines that would break the TSV."""
    return _SPACE_RE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def strip_annotations(text: str) -> str:
    """Remove Ding's {gender}, [register], <spelling> and /abbreviation/ annotations."""
    return re.sub(r" ([,;])", r"\1", normalize_text(_ANNOTATION_RE.sub(" ", text)))


def is_sentence(text: str) -> bool:
    """A Ding example sentence: capitalised, at least 3 words, ends like a sentence."""
    return bool(text) and text[0].isupper() and text.endswith(_SENTENCE_END) and len(text.split()) >= 3


def has_placeholder(text: str) -> bool:
    return bool(_PLACEHOLDER_RE.search(text))


def _resolve_slashes(text: str) -> str | None:
    """None for "a/b" alternatives: "eine Region/ein Transportmittel" has no safe single reading."""
    return None if "/" in text else text


def _drop_grammar_parens(text: str) -> str:
    """Remove parentheses that only hold valency notation, like "(etw.)" or "(to sb.)"."""
    return normalize_text(_PARENS_RE.sub(lambda m: "" if has_placeholder(m.group()) else m.group(), text))


def clean_sentence_pair(de: str, en: str) -> Pair | None:
    """Tidy one example-sentence pair, or None when it cannot be made natural text."""
    de, en = _drop_grammar_parens(de), _drop_grammar_parens(en)
    # A parenthesis on one side only is a gloss with no counterpart; drop glosses on both sides.
    if de.count("(") != en.count("("):
        de, en = normalize_text(_PARENS_RE.sub("", de)), normalize_text(_PARENS_RE.sub("", en))
    de, en = _resolve_slashes(de), _resolve_slashes(en)
    if de is None or en is None or has_placeholder(de) or has_placeholder(en):
        return None
    if "..." in de + en or "…" in (de[:-1] + en[:-1]):  # a gap to fill, not a sentence
        return None
    return de, en


def clean_phrase(text: str) -> str | None:
    """Tidy one phrase synonym; parentheses in phrases are glosses or optional words, so drop them."""
    if has_placeholder(text) or "…" in text or "..." in text:
        return None
    text = _resolve_slashes(normalize_text(_PARENS_RE.sub("", text)))
    return text.strip(" ,;") or None if text else None


def split_ding_line(line: str) -> list[Pair] | None:
    """Aligned (German, English) sub-entries of one Ding line; None when the sides do not align."""
    de_side, sep, en_side = line.rstrip("\n").partition(" :: ")
    if not sep:
        return None
    de_subs, en_subs = de_side.split(" | "), en_side.split(" | ")
    if len(de_subs) != len(en_subs):
        return None
    return [(strip_annotations(d), strip_annotations(e)) for d, e in zip(de_subs, en_subs)]


def extract_sub_entry(de: str, en: str) -> tuple[str, Pair | None]:
    """Classify one aligned sub-entry as ('sentence'|'phrase'|'word'|'skipped', pair)."""
    de_first, en_first = _SENTENCE_ALT_RE.split(de)[0], _SENTENCE_ALT_RE.split(en)[0]
    if is_sentence(de_first) and is_sentence(en_first):
        pair = clean_sentence_pair(de_first, en_first)
        return ("sentence", pair) if pair else ("skipped", None)
    de_syns = [s for s in (clean_phrase(x) for x in de.split(";")) if s]
    en_syns = [s for s in (clean_phrase(x) for x in en.split(";")) if s]
    de_multi = [s for s in de_syns if len(s.split()) >= 2]
    if not de_multi:
        return ("word", None) if de_syns else ("skipped", None)
    if not en_syns:
        return "skipped", None
    # Synonyms in a sub-entry all translate each other; the first clean ones are the most common.
    return "phrase", (de_multi[0], en_syns[0])


def read_ding(path: str, counts: Counts) -> tuple[list[Pair], list[Pair], str]:
    """Parse the Ding file into (sentences, phrases, version)."""
    sentences: list[Pair] = []
    phrases: list[Pair] = []
    version = "unknown"
    counts.ding.update(lines=0, lines_misaligned=0)  # report zeros explicitly rather than omit them
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#"):
                if line.startswith("# Version ::"):
                    version = line.split("::", 1)[1].strip()
                continue
            if not line.strip():
                continue
            counts.ding["lines"] += 1
            subs = split_ding_line(line)
            if subs is None:
                counts.ding["lines_misaligned"] += 1
                continue
            for de, en in subs:
                kind, pair = extract_sub_entry(de, en)
                counts.ding[f"sub_entries_{kind}"] += 1
                if kind == "sentence":
                    sentences.append(pair)
                elif kind == "phrase":
                    phrases.append(pair)
    return sentences, phrases, version


def read_mo(path: str) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a compiled gettext catalog; plurals give their singular, context is removed."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 20:
        raise ValueError(f"{path}: too short for a .mo file")
    for endian in ("<", ">"):
        if struct.unpack(endian + "I", data[:4])[0] == _MO_MAGIC:
            break
    else:
        raise ValueError(f"{path}: bad .mo magic number")
    _revision, n, orig_off, trans_off = struct.unpack(endian + "4I", data[4:20])
    entries = []
    for i in range(n):
        olen, opos = struct.unpack_from(endian + "2I", data, orig_off + 8 * i)
        tlen, tpos = struct.unpack_from(endian + "2I", data, trans_off + 8 * i)
        msgid = data[opos:opos + olen].decode("utf-8", errors="replace")
        msgstr = data[tpos:tpos + tlen].decode("utf-8", errors="replace")
        if not msgid:  # the header entry holds catalog metadata, not a translation
            continue
        msgid = msgid.split("\x04", 1)[-1].split("\x00", 1)[0]
        entries.append((msgid, msgstr.split("\x00", 1)[0]))
    return entries


def clean_gettext_string(text: str) -> str | None:
    """UI string as plain text, or None when it holds placeholders, markup or is not prose."""
    # Multi-line help texts and "-v, --verbose" option lists are not sentence-like UI strings.
    if "\n" in text.strip() or len(text) > MAX_GETTEXT_CHARS or text.lstrip().startswith("-"):
        return None
    if _PRINTF_RE.search(text) or _BRACE_RE.search(text) or _MARKUP_RE.search(text):
        return None
    text = normalize_text(_ACCEL_RE.sub("", _INLINE_CONTEXT_RE.sub("", text)))
    letters = sum(c.isalpha() for c in text)
    if letters < max(2, len(text) / 2):  # paths, numbers, symbols are not translations
        return None
    return text


def default_locale_dirs() -> list[str]:
    """/usr/share/locale, LibreOffice's catalogs and every game's locale root that is installed."""
    extra = [LIBREOFFICE_LOCALE_DIR] if os.path.isdir(LIBREOFFICE_LOCALE_DIR) else []
    return [DEFAULT_LOCALE_DIR, *extra] + sorted({path for pattern in GAME_LOCALE_GLOBS for path in glob.glob(pattern)})


def default_help_roots() -> list[str]:
    """LibreOffice's help when both its German and English pages are installed."""
    return [DEFAULT_HELP_ROOT] if all(os.path.isdir(os.path.join(DEFAULT_HELP_ROOT, lang)) for lang in ("de", "en-US")) else []


def read_gettext(locale_dirs: list[str], counts: Counts) -> tuple[list[Pair], list[str]]:
    """German (msgstr) / English (msgid) pairs from every de and de_* catalog under each locale dir."""
    paths = sorted(path for locale_dir in locale_dirs
                   for pattern in (("de", "LC_MESSAGES", "*.mo"), ("de_*", "LC_MESSAGES", "*.mo"))
                   for path in glob.glob(os.path.join(locale_dir, *pattern)))
    pairs: list[Pair] = []
    for path in paths:
        try:
            entries = read_mo(path)
        except (OSError, ValueError, struct.error):
            counts.gettext["catalogs_unreadable"] += 1
            continue
        counts.gettext["catalogs"] += 1
        for msgid, msgstr in entries:
            counts.gettext["entries"] += 1
            en, de = clean_gettext_string(msgid), clean_gettext_string(msgstr)
            if en is None or de is None:
                counts.gettext["entries_filtered"] += 1
                continue
            pairs.append((de, en))
    counts.gettext["pairs"] = len(pairs)
    return pairs, paths


def clean_pairs(pairs: list[Pair], counts: Counts, seen: set[Pair]) -> list[Pair]:
    """Apply the length/identity/ratio rules and drop exact duplicates of anything in `seen`."""
    kept = []
    counts.cleaning.update(dict.fromkeys(("empty", "too_long", "identical", "length_ratio", "duplicate"), 0))
    for de, en in pairs:
        de, en = normalize_text(de), normalize_text(en)
        if not de or not en:
            reason = "empty"
        elif len(de) > MAX_CHARS or len(en) > MAX_CHARS:
            reason = "too_long"
        elif de.casefold() == en.casefold():  # an untranslated string or a proper name
            reason = "identical"
        elif max(len(de), len(en)) > RATIO_MIN_CHARS and max(len(de), len(en)) > MAX_RATIO * min(len(de), len(en)):
            reason = "length_ratio"
        elif (de, en) in seen:
            reason = "duplicate"
        else:
            seen.add((de, en))
            kept.append((de, en))
            continue
        counts.cleaning[reason] += 1
    return kept


def _overlap_key(text: str) -> str:
    return normalize_text(text).casefold()


def _hash_order(pairs: list[Pair], seed: int) -> list[Pair]:
    """Order depending only on the text and seed, so held-out sets match across machines."""
    return sorted(pairs, key=lambda p: hashlib.sha256(f"{seed}\t{p[0]}\t{p[1]}".encode()).hexdigest())


def split_corpus(sentences: list[Pair], others: list[Pair], test_size: int, valid_size: int,
                 seed: int, counts: Counts, sentence_copies: int = 1) -> tuple[list[Pair], list[Pair], list[Pair]]:
    """Hold out test and valid Ding sentences; train keeps nothing whose either side is a test side.

    sentence_copies: how many times each training Ding sentence is written (upsampling the
    held-out sets' own domain); the held-out sets do not depend on it.
    """
    ordered = _hash_order(sentences, seed)
    test = ordered[:test_size]
    test_keys = {_overlap_key(s) for pair in test for s in pair}

    def overlaps_test(pair: Pair) -> bool:
        return _overlap_key(pair[0]) in test_keys or _overlap_key(pair[1]) in test_keys

    valid: list[Pair] = []
    rest: list[Pair] = []
    for pair in ordered[test_size:]:
        if overlaps_test(pair):
            counts.split["removed_overlap_test"] += 1
        elif len(valid) < valid_size:
            valid.append(pair)
        else:
            rest.append(pair)
    # Only sentence pairs were hash-ordered; keep the rest in input order so the shuffle is reproducible.
    rest_set = set(rest)
    train = [p for p in sentences if p in rest_set] * sentence_copies
    for pair in others:
        if overlaps_test(pair):
            counts.split["removed_overlap_test"] += 1
        else:
            train.append(pair)
    random.Random(seed).shuffle(train)
    counts.split.update(train=len(train), valid=len(valid), test=len(test), train_sentences=len(rest) * sentence_copies)
    return train, valid, test


def training_parts(train: list[Pair], sentences: list[Pair]) -> tuple[list[Pair], list[Pair]]:
    """train.tsv by source: the Ding example sentences once each (in the order they first appear) and every other pair
    (in train.tsv's order). A mix can then weight the held-out sets' own domain on its own (nmt-corpus-mix PATH:COPIES)."""
    sentence_set = set(sentences)
    written: set[Pair] = set()
    ding: list[Pair] = []
    others: list[Pair] = []
    for pair in train:
        if pair not in sentence_set:
            others.append(pair)
        elif pair not in written:
            written.add(pair)
            ding.append(pair)
    return ding, others


def write_tsv(path: str, pairs: list[Pair]) -> None:
    """Write German\\tEnglish lines, UTF-8, no header."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for de, en in pairs:
            f.write(f"{de}\t{en}\n")


def read_tsv(path: str) -> list[Pair]:
    """Read a corpus TSV written by write_tsv into (German, English) pairs."""
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if line.strip()]


def _package_version(name: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def build_corpus(args: argparse.Namespace) -> dict:
    """Run the whole pipeline and write the TSVs plus corpus.json; returns the report."""
    counts = Counts()
    sentences, phrases, ding_version = read_ding(args.ding, counts)
    locale_dirs = args.locale_dir or default_locale_dirs()
    gettext_pairs, catalogs = read_gettext(locale_dirs, counts)
    help_roots = default_help_roots() if args.help_root is None else [root for root in args.help_root if root]
    help_pairs: list[Pair] = []
    for root in help_roots:
        help_pairs += read_help(root, counts.help)[0]
    seen: set[Pair] = set()
    sources = {"ding_sentences": len(sentences), "ding_phrases": len(phrases), "gettext_pairs": len(gettext_pairs), "help_pairs": len(help_pairs)}
    # Sentences are cleaned first so the held-out sets never depend on the gettext catalogs present.
    sentences = clean_pairs(sentences, counts, seen)
    others = clean_pairs(phrases, counts, seen) + clean_pairs(gettext_pairs, counts, seen) + clean_pairs(help_pairs, counts, seen)
    train, valid, test = split_corpus(sentences, others, args.test_size, args.valid_size, args.seed, counts, args.sentence_copies)
    os.makedirs(args.out, exist_ok=True)
    train_sentences, train_others = training_parts(train, sentences)
    for name, pairs in (("train", train), ("valid", valid), ("test", test), ("train-sentences", train_sentences),
                        ("train-others", train_others)):
        write_tsv(os.path.join(args.out, f"{name}.tsv"), pairs)
    report = {
        "sources": sources | {"gettext_catalogs": counts.gettext["catalogs"]},
        "ding": dict(sorted(counts.ding.items())),
        "gettext": dict(sorted(counts.gettext.items())),
        "help": dict(sorted(counts.help.items())),
        "dropped": dict(sorted(counts.cleaning.items())),
        "split": dict(sorted(counts.split.items())),
        "inputs": {
            "ding_path": os.path.abspath(args.ding),
            "ding_version": ding_version,
            "trans_de_en_package_version": _package_version("trans-de-en"),
            "locale_dirs": [os.path.abspath(path) for path in locale_dirs],
            "gettext_catalogs": catalogs,
            "help_roots": [os.path.abspath(path) for path in help_roots],
            "libreoffice_help_de_package_version": _package_version("libreoffice-help-de"),
            "seed": args.seed,
            "sentence_copies": args.sentence_copies,
        },
    }
    with open(os.path.join(args.out, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    return report


def print_report(report: dict) -> None:
    for section in ("sources", "ding", "gettext", "help", "dropped", "split"):
        print(f"{section}:")
        for key, value in report[section].items():
            print(f"  {key:28s} {value:>8}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nmt-corpus", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--out", required=True, help="output directory for train/valid/test.tsv, and train.tsv by source: train-sentences.tsv (the Ding example sentences, once each) and train-others.tsv")
    parser.add_argument("--ding", default=DEFAULT_DING, help="Ding de-en dictionary file")
    parser.add_argument("--locale-dir", action="append", default=None,
                        help="a root of de/LC_MESSAGES/*.mo; repeat for several "
                             f"(default: {DEFAULT_LOCALE_DIR} and the games' locale roots under /usr/share/games)")
    parser.add_argument("--help-root", action="append", default=None,
                        help="a root of translated HTML help with de/ and en-US/ pages whose elements share ids; repeat "
                             f"for several; --help-root '' reads none (default: {DEFAULT_HELP_ROOT} when installed)")
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--valid-size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--sentence-copies", type=int, default=1,
                        help="write each training Ding example sentence N times: they are the held-out sets' domain "
                             "(everyday sentences) and otherwise under 7%% of the training pairs")
    args = parser.parse_args(argv)
    if args.sentence_copies < 1:
        parser.error(f"--sentence-copies must be at least 1, got {args.sentence_copies}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.ding):
        print(f"error: Ding dictionary not found at {args.ding}; "
              "install it with: apt-get install trans-de-en", file=sys.stderr)
        return 2
    report = build_corpus(args)
    print_report(report)
    print(f"wrote {args.out}/{{train,valid,test}}.tsv and corpus.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
