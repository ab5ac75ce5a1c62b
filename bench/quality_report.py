"""nmt-quality-report: sacreBLEU BLEU and chrF of one checkpoint and its model dirs on several test sets, greedy and beam 4.

Per test set and decoding: PyTorch fp32 (the checkpoint), then each exported model dir through ONNX
Runtime, every output scored against the set's one reference with sacreBLEU's defaults (detokenised
13a BLEU, chrF2); the signatures are printed once. A few translated examples per set follow.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-quality-report", "dev", ("torch", "onnx", "sacrebleu"))

import sacrebleu

from nmt_serve.bench.report import write_report
from nmt_serve.export.parity import SEARCHES, decode_all
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.evaluate import one_line
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.ort_step import OrtStep

logger = logging.getLogger(__name__)

EXAMPLES_PER_SET = 4


def translate_all(step: object, tokenizer: object, sources: Sequence[str], config: object, search: str) -> list[str]:
    ids = [encoded[: config.max_positions - 1] for encoded in tokenizer.encode_batch(list(sources))]  # type: ignore[attr-defined]
    best = decode_all(step, ids, SEARCHES[search], config, 64, f"{search}")
    return [one_line(text) for text in tokenizer.decode_batch([hypothesis.token_ids for hypothesis in best])]  # type: ignore[attr-defined]


def scores(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, float, str]:
    """BLEU, chrF and their signatures joined."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)]).score
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)]).score
    return bleu_score, chrf_score, f"BLEU: {bleu.get_signature()}; chrF: {chrf.get_signature()}"


def evaluate(checkpoint: Path, model_dirs: Sequence[Path], tests: Sequence[Path], limit: int) -> tuple[list[str], dict, str]:
    """Table rows, the examples (set -> [(German, reference, PyTorch beam 4)]) and the signatures."""
    loaded = load_checkpoint(checkpoint)
    systems = [("PyTorch fp32", TorchStep(loaded.model))] + [(f"ONNX {OrtStep(d).manifest.precision} (`{d.name}`)", OrtStep(d)) for d in model_dirs]
    rows, examples, signature = [], {}, ""
    for test in tests:
        pairs = read_tsv(str(test))[: limit or None]
        sources, references = [source for source, _ in pairs], [reference for _, reference in pairs]
        for search in SEARCHES:
            cells = []
            for label, step in systems:
                hypotheses = translate_all(step, loaded.tokenizer, sources, loaded.config, search)
                bleu, chrf, signature = scores(hypotheses, references)
                cells.append(f"{bleu:.2f} / {chrf:.2f}")
                if label == "PyTorch fp32" and search == "beam4":
                    examples[test.stem] = list(zip(sources, references, hypotheses))[:EXAMPLES_PER_SET]
            rows.append(f"| {test.stem} ({len(pairs)}) | {search} | " + " | ".join(cells) + " |")
            logger.info("%s", rows[-1])
    header = "| test set (sentences) | decoding | " + " | ".join(label for label, _ in systems) + " |"
    return [header, "|---|---|" + "---|" * len(systems), *rows], examples, signature


def format_examples(examples: dict) -> str:
    lines = ["### Examples (PyTorch fp32, beam 4)", "", "| set | German | reference | this model |", "|---|---|---|---|"]
    for name, items in examples.items():
        lines += [f"| {name} | " + " | ".join(text.replace("|", "\\|") for text in item) + " |" for item in items]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-quality-report", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("checkpoint", type=Path, help="checkpoint dir (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[], help="exported model dir to score too; repeatable")
    parser.add_argument("--test", type=Path, action="append", required=True, help="German<TAB>English test TSV; repeatable")
    parser.add_argument("--limit", type=int, default=0, help="only the first N pairs of each set (0 = all)")
    parser.add_argument("--out", type=Path, required=True, help="markdown report to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    table, examples, signature = evaluate(args.checkpoint, args.model_dir, args.test, args.limit)
    sections = [f"Checkpoint `{args.checkpoint}`; each cell is BLEU / chrF against one reference.", "\n".join(table),
                f"sacreBLEU signatures: {signature}", format_examples(examples)]  # fmt: skip
    write_report("Translation quality", "nmt-quality-report", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
