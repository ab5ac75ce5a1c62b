"""nmt-verbatim-report: how many verbatim spans survive translation, and BLEU, with and without protection (bench/results/verbatim.md).

The held-out set: German paragraphs of the LibreOffice help that hold a span the rules find
(model/verbatim.py; the corpus holds every such paragraph out, model/help_corpus.py is_held_out) and
one-line German gettext strings that hold one and that the corpus leaves out (clean_gettext_string
refuses strings with placeholders). A server translates the set twice: options.detect_verbatim true
and false. A span survives when the translation holds it as often as the source does.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import hashlib
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-verbatim-report", "dev", ("sacrebleu",))

import grpc
import sacrebleu

from nmt_serve.bench.load_report import ROOT, ServerProcess
from nmt_serve.bench.report import write_report
from nmt_serve.model.corpus import DEFAULT_LOCALE_DIR, MAX_GETTEXT_CHARS, clean_gettext_string, read_mo
from nmt_serve.model.help_corpus import DEFAULT_HELP_ROOT, held_out_paragraphs
from nmt_serve.model.verbatim import RULES, detect
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb
from nmt_serve.protos.nmt.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger("nmt-verbatim-report")
Pair = tuple[str, str]
BATCH = 8  # texts per Translate call
NOTES = ("Key combinations stay as written (German key names), while the help's English pages name the keys in English: those spans "
         "count as verbatim here and cost BLEU against the reference. The paragraphs are held out of corpora built from now on; "
         "a model trained before may have seen them, which favours the rows without protection. Neither figure depends on the "
         "machine's speed; it was shared with other work.")
MIN_WORDS = 3


def spans_of(text: str) -> list[str]:
    return [text[start:end] for start, end in detect(text)]


def gettext_strings(locale_dir: str) -> list[Pair]:
    """One-line German catalog strings with spans that the corpus leaves out (clean_gettext_string refuses them)."""
    pairs = []
    for path in sorted(glob.glob(os.path.join(locale_dir, "de", "LC_MESSAGES", "*.mo"))):
        try:
            entries = read_mo(path)
        except (OSError, ValueError):
            continue
        for english, german in entries:
            if (clean_gettext_string(german) is None and "\n" not in german.strip() and len(german) <= MAX_GETTEXT_CHARS
                    and len(german.split()) >= MIN_WORDS and "<" not in german and not any(mark in german for mark in "&_~")):  # fmt: skip
                pairs.append((german.strip(), english.strip()))
    return pairs


def sample(pairs: list[Pair], count: int) -> list[Pair]:
    """Up to `count` distinct pairs holding spans, chosen by a hash of the German text (the same on every machine)."""
    chosen = {german: english for german, english in pairs if len(german.split()) >= MIN_WORDS and spans_of(german)}
    return sorted(chosen.items(), key=lambda pair: hashlib.sha256(pair[0].encode()).hexdigest())[:count]


def surviving(source: str, translation: str) -> tuple[int, int]:
    """(spans of the source, how many the translation holds as often as the source does)."""
    counts = Counter(spans_of(source))
    return sum(counts.values()), sum(count for span, count in counts.items() if translation.count(span) >= count)


async def translate_all(target: str, texts: list[str], detect_verbatim: bool) -> list[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        options = pb.DecodingOptions(detect_verbatim=detect_verbatim)
        replies = [await stub.Translate(pb.TranslateRequest(texts=texts[start:start + BATCH], options=options), timeout=120)
                   for start in range(0, len(texts), BATCH)]  # fmt: skip
    return [translation.hypotheses[0].text for reply in replies for translation in reply.translations]


def score(name: str, pairs: list[Pair], translations: list[str]) -> tuple[str, int, int]:
    totals = [surviving(german, translation) for (german, _), translation in zip(pairs, translations, strict=True)]
    spans, kept = sum(total for total, _ in totals), sum(count for _, count in totals)
    bleu = sacrebleu.metrics.BLEU().corpus_score(translations, [[english for _, english in pairs]]).score
    return f"| {name} | {len(pairs)} | {spans} | {kept} | {100 * kept / max(spans, 1):.1f}% | {bleu:.2f} |", spans, kept


def rule_counts(pairs: list[Pair]) -> str:
    counts = Counter(rule.name for german, _ in pairs for rule in RULES for _ in rule.pattern.finditer(german))
    return ", ".join(f"{name} {count}" for name, count in counts.most_common())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-verbatim-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts" / "de-en-small" / "onnx-int8")
    parser.add_argument("--help-root", default=DEFAULT_HELP_ROOT)
    parser.add_argument("--locale-dir", default=DEFAULT_LOCALE_DIR)
    parser.add_argument("--paragraphs", type=int, default=200, help="help paragraphs at most")
    parser.add_argument("--strings", type=int, default=200, help="gettext strings at most")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "verbatim.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    sets = {"help paragraphs": sample(held_out_paragraphs(args.help_root), args.paragraphs),
            "gettext strings": sample(gettext_strings(args.locale_dir), args.strings)}  # fmt: skip
    lines = ["| set, protection | texts | spans | verbatim | share | BLEU |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(args.model_dir, Path(tmp), "--http-port", "0")
        try:
            for name, pairs in sets.items():
                for detecting in (False, True):
                    translations = asyncio.run(translate_all(server.target, [german for german, _ in pairs], detecting))
                    row, spans, kept = score(f"{name}, {'detect_verbatim' if detecting else 'none'}", pairs, translations)
                    lines.append(row)
                    logger.info("%s, detect_verbatim %s: %d of %d spans verbatim", name, detecting, kept, spans)
        finally:
            server.stop()
    found = "; ".join(f"{name}: {rule_counts(pairs)}" for name, pairs in sets.items())
    model = args.model_dir.relative_to(ROOT) if args.model_dir.is_relative_to(ROOT) else args.model_dir
    sections = ["\n".join(lines), f"Model dir: {model}, greedy, sentences split. Spans in the sets by rule: {found}. BLEU: sacreBLEU "
                f"{sacrebleu.__version__} defaults, one reference.", NOTES]  # fmt: skip
    write_report("Verbatim spans on held-out help paragraphs and catalog strings", "nmt-verbatim-report", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
