"""nmt-import marian|nllb|m2m100 SOURCE --out DIR: a Hugging Face OPUS-MT, NLLB-200 or M2M-100 model -> our checkpoint dir, optionally exported.

SOURCE is a local directory, or a hub id (Helsinki-NLP/opus-mt-de-en, facebook/nllb-200-distilled-600M)
that is downloaded only because the user named it. The checkpoint is written to a temporary dir beside --out and moved
into place when complete; each --export precision is written the same way into DIR/onnx-PRECISION.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from nmt_serve.model.extras import require_extra

require_extra("nmt-import", "import", ["torch", "transformers", "sentencepiece", "onnx"])

from nmt_serve.export.parity import random_pairs  # noqa: E402  (after the extra check)
from nmt_serve.importers import m2m100  # noqa: E402
from nmt_serve.importers.marian import MarianImportError, build_model, build_tokenizer, import_record, language_tokens, read_source  # noqa: E402
from nmt_serve.importers.marian_parity import compare_with_transformers  # noqa: E402
from nmt_serve.model.checkpoint import IMPORT_RECORD_FILE, save_weights  # noqa: E402
from nmt_serve.model.corpus import read_tsv  # noqa: E402
from nmt_serve.model.languages import LANGUAGES_FILE, UnknownLanguage, resolve  # noqa: E402
from nmt_serve.model.tokenizer import TOKENIZER_FILE  # noqa: E402
from nmt_serve.runtime.manifest import PRECISIONS  # noqa: E402

logger = logging.getLogger(__name__)

KINDS = ("marian", *m2m100.KINDS)
# What the families need from the hub; nothing else (TensorFlow/Flax weights) is fetched.
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin", "source.spm", "target.spm", "vocab.json",
             "tokenizer_config.json", "tokenizer.json", "sentencepiece.bpe.model", "special_tokens_map.json"]  # fmt: skip


class ImportFailed(Exception):
    """Ends the command with exit 1 and this one-line message."""


def fetch(source: str) -> Path:
    """A local dir as given; a hub id downloaded (the user asked for it by naming it)."""
    path = Path(source)
    if path.exists():
        return path
    if source.count("/") != 1 or source.startswith(("/", ".")):
        raise ImportFailed(f"SOURCE {source[:200]!r}: no such directory, and not a hub id of the form owner/name")
    try:
        from huggingface_hub import snapshot_download

        logger.info("downloading %s from the Hugging Face hub", source)
        return Path(snapshot_download(repo_id=source, allow_patterns=HUB_FILES))
    except Exception as error:  # offline, unknown id, gated repo: the hub client raises many kinds
        raise ImportFailed(f"SOURCE {source!r}: download from the Hugging Face hub failed ({type(error).__name__}: {str(error)[:300]}); "
                           "without network access, copy the model dir here and pass its path") from error  # fmt: skip


def write_files(out: Path, model: Any, tokenizer: Any, record: dict[str, Any], languages: Any = None) -> None:
    """Everything into a temporary dir beside `out`, renamed to `out` once complete."""
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        save_weights(model, work)
        tokenizer.save(work / TOKENIZER_FILE)
        if languages is not None:
            languages.save(work / LANGUAGES_FILE)
        (work / IMPORT_RECORD_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.rename(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def write_checkpoint(source_dir: Path, out: Path, origin: str, languages: tuple[str | None, str | None], check_sentences: Sequence[str]) -> None:
    source = read_source(source_dir)
    model, tokenizer = build_model(source), build_tokenizer(source)
    record: dict[str, Any] = import_record(source, origin)
    record["source_language"] = languages[0] or record["source_language"]
    record["target_language"] = languages[1] or record["target_language"]
    record["parity_with_transformers"] = compare_with_transformers(source_dir, model, tokenizer, check_sentences)
    write_files(out, model, tokenizer, record, language_tokens(source))


def default_pair(kind: str, known: Sequence[str], requested: tuple[str | None, str | None]) -> tuple[str, str]:
    """The import's default language pair as model codes: --source-language / --target-language, else the family's."""
    pair = []
    for flag, wanted, default in zip(("--source-language", "--target-language"), requested, m2m100.DEFAULT_LANGUAGES[kind], strict=True):
        try:
            pair.append(resolve(wanted or default, known))
        except UnknownLanguage as error:
            raise ImportFailed(f"{flag} {(wanted or default)[:40]!r} {error} (e.g. {', '.join(list(known)[:8])})") from None
    return pair[0], pair[1]


def write_multilingual_checkpoint(kind: str, source_dir: Path, out: Path, origin: str, languages: tuple[str | None, str | None],
                                  check_sentences: Sequence[str]) -> None:  # fmt: skip
    source = m2m100.read_source(source_dir, kind)
    model, (tokenizer, tokens) = m2m100.build_model(source), m2m100.build_tokenizer(source)
    pair = default_pair(kind, list(tokens.target), languages)
    record = m2m100.import_record(source, origin, pair)
    # Parity on the default pair: its source token first in each source, its target token forced first.
    record["parity_with_transformers"] = compare_with_transformers(source_dir, model, tokenizer, check_sentences, prefixes=tokens.prefixes(*pair))
    write_files(out, model, tokenizer, record, tokens)


def export_precision(checkpoint: Path, precision: str, parity_test: Path | None, parity_limit: int, check_texts: Sequence[str]) -> Path:
    from nmt_serve.export.onnx_export import export_model_dir
    from nmt_serve.export.parity import run_parity

    final = checkpoint / f"onnx-{precision}"
    work = checkpoint / f".onnx-{precision}.exporting"
    shutil.rmtree(work, ignore_errors=True)
    try:
        export_model_dir(checkpoint, work, precision, checkpoint.name, "imported", check_texts)
        run_parity(work, checkpoint, parity_test, parity_limit)
        os.rename(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-import", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("kind", choices=KINDS, help="source model family")
    parser.add_argument("source", help="Hugging Face model dir (marian: config.json, weights, source.spm, target.spm, vocab.json; nllb: config.json, "
                        "weights, tokenizer.json or sentencepiece.bpe.model; m2m100: config.json, weights, vocab.json, sentencepiece.bpe.model) "
                        "or hub id")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint dir to write (must not exist)")
    parser.add_argument("--export", default="", help=f"comma-separated precisions to export into OUT/onnx-PRECISION ({', '.join(PRECISIONS)})")
    parser.add_argument("--source-language", help="source language code (marian: default tokenizer_config.json's, or the opus-mt-SRC-TGT "
                        "name's; nllb, m2m100: the default of requests that name none, eng_Latn / en)")
    parser.add_argument("--target-language", help="target language code (marian: as --source-language; nllb, m2m100: fra_Latn / fr)")
    parser.add_argument("--parity-test", type=Path, help="TSV whose sources check parity (default: 100 generated German sentences; "
                        "a multilingual model is checked on its default pair)")
    parser.add_argument("--parity-limit", type=int, default=100, help="sentences compared with transformers and checked after export")
    return parser


def parse_precisions(text: str) -> list[str]:
    precisions = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in precisions if item not in PRECISIONS]
    if unknown:
        raise ImportFailed(f"--export: unknown precision {unknown[0][:40]!r} (choose from {', '.join(PRECISIONS)})")
    return precisions


def quiet_libraries() -> None:
    """This command's own INFO lines and every library's warnings; not the libraries' INFO lines and progress bars
    (the exporter's passes log some hundred lines per precision)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("nmt_serve").setLevel(logging.INFO)
    # torch.onnx warns of every torchvision operator it cannot register, though no model here has one.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        precisions = parse_precisions(args.export)
        if args.out.exists():
            raise ImportFailed(f"--out {args.out}: already exists; choose a new dir")
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ImportFailed(f"--out {args.out}: cannot create its parent dir ({error.strerror}); choose a dir you can write") from None
        pairs = read_tsv(str(args.parity_test)) if args.parity_test else random_pairs(args.parity_limit)
        sentences = [source for source, _ in pairs][: args.parity_limit]
        languages = (args.source_language, args.target_language)
        if args.kind == "marian":
            write_checkpoint(fetch(args.source), args.out, args.source, languages, sentences)
        else:
            write_multilingual_checkpoint(args.kind, fetch(args.source), args.out, args.source, languages, sentences)
        for precision in precisions:
            logger.info("exported %s", export_precision(args.out, precision, args.parity_test, args.parity_limit, sentences[:8]))
    except (ImportFailed, MarianImportError) as error:
        sys.stderr.write(f"nmt-import: {error}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
