"""nmt-nllb-bench: an NLLB-200-distilled-600M-shaped model through nmt-import + our engine, against CTranslate2.

The model is random (bench/random_multilingual.py at NLLB-200 distilled 600M's shape: d_model 1024,
12 + 12 pre-norm layers, FFN 4096, 16 heads, 256,206 ids), saved as a Hugging Face dir. CTranslate2
gets it through its own TransformersConverter, ours through nmt-import nllb and nmt-export. Every
source is "eng_Latn tokens </s>" and every target starts with the forced "fra_Latn" token, as a
request for English -> French sends them; the forced token counts in the output length of both.
Cells are timed interleaved (bench/engine_bench.py's time_cells) at a forced output length. The
import and each export are timed; the import's peak RSS is that of its process.
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-nllb-bench", "dev", ["torch", "transformers", "sentencepiece", "ctranslate2"])

from nmt_serve.bench.engine_bench import format_table, time_cells  # noqa: E402
from nmt_serve.bench.import_timing import ImportTimings, add_import_arguments, import_and_export  # noqa: E402
from nmt_serve.bench.marian_bench import SourceEosSystem, format_agreement  # noqa: E402
from nmt_serve.bench.random_multilingual import NLLB_600M_SHAPE, NLLB_VOCAB, build_multilingual_dir, multilingual_sentences  # noqa: E402
from nmt_serve.bench.report import write_report  # noqa: E402
from nmt_serve.bench.systems import Cell, CTranslate2System, EngineSystem, System, add_cell_arguments, cells_from  # noqa: E402
from nmt_serve.model.languages import load_languages  # noqa: E402
from nmt_serve.model.tokenizer import Tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

SOURCE_LANGUAGE, TARGET_LANGUAGE = "eng_Latn", "fra_Latn"


def build_systems(source_dir: Path, checkpoint: Path, work: Path, threads: int) -> list[System]:
    import ctranslate2

    tokens = Tokenizer.load(checkpoint).token_strings()
    eos = tokens.index("</s>")
    systems: list[System] = []
    for quantization, label in ((None, "fp32"), ("int8", "int8")):
        ct2_dir = work / f"ct2-{label}"
        ctranslate2.converters.TransformersConverter(str(source_dir)).convert(str(ct2_dir), quantization=quantization)
        systems.append(SourceEosSystem(CTranslate2System(ct2_dir, tokens, threads, label, target_prefix=[TARGET_LANGUAGE]), eos))
        gc.collect()
    target_prefix = load_languages(checkpoint).prefixes(SOURCE_LANGUAGE, TARGET_LANGUAGE)[1]  # type: ignore[union-attr]
    systems += [EngineSystem(checkpoint / f"onnx-{label}", threads, label, target_prefix=target_prefix) for label in ("fp32", "int8")]
    return systems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-nllb-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    add_cell_arguments(parser, repeats=3)
    add_import_arguments(parser, parity_limit=8)
    # At this size a PyTorch beam search over 256k ids is most of an export; random weights never stop before the length limit.
    parser.add_argument("--export-parity", type=int, default=4, help="sentences each export checks against PyTorch (greedy and beam 4)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/nllb.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source_dir = build_multilingual_dir(work / "nllb-200-600m", "nllb", vocab_size=NLLB_VOCAB, **NLLB_600M_SHAPE)
        timings = ImportTimings("nllb", args.parity_limit, args.export_parity)
        checkpoint = import_and_export(source_dir, "nllb", work, multilingual_sentences(200, seed=21), timings)
        systems = build_systems(source_dir, checkpoint, work, args.threads)
        gc.freeze()
        source_prefix = load_languages(checkpoint).prefixes(SOURCE_LANGUAGE, TARGET_LANGUAGE)[0]  # type: ignore[union-attr]
        texts = multilingual_sentences(max(c.batch for c in cells), seed=22)
        sources = [[*source_prefix, *ids] for ids in Tokenizer.load(checkpoint).encode_batch(texts)]
        results = time_cells(systems, sources, cells, args.repeats)
        sections = [
            format_table(f"NLLB-200 distilled 600M shape (random weights), {SOURCE_LANGUAGE} -> {TARGET_LANGUAGE}, output length {args.length}, "
                         f"{args.threads} threads", systems, cells, results),
            timings.table(),
            format_agreement(checkpoint),
        ]  # fmt: skip
    write_report("NLLB-200-shaped model: nmt-import + our engine against CTranslate2", "nmt-nllb-bench", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
