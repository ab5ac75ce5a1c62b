"""nmt-marian-bench: an OPUS-MT-shaped Marian model through nmt-import + our engine, against CTranslate2 and transformers.

The model is random (opus-mt-de-en's shape: bench/random_marian.py), saved as a Hugging Face dir.
Each peer gets it its own way: CTranslate2 through its TransformersConverter, transformers'
MarianMTModel.generate as the PyTorch column, ours through nmt-import and nmt-export. Cells are
timed interleaved (bench/engine_bench.py's time_cells) at a forced output length, so every system
produces the same number of tokens. The import itself is timed with its peak RSS.
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

require_extra("nmt-marian-bench", "dev", ["torch", "transformers", "sentencepiece", "ctranslate2"])

import torch  # noqa: E402

from nmt_serve.bench.engine_bench import format_table, native_systems, time_cells  # noqa: E402
from nmt_serve.bench.import_timing import ImportTimings, add_import_arguments, import_and_export  # noqa: E402
from nmt_serve.bench.random_marian import OPUS_MT_SHAPE, OPUS_MT_VOCAB, build_marian_dir, german_sentences  # noqa: E402
from nmt_serve.bench.report import write_report  # noqa: E402
from nmt_serve.bench.systems import Cell, CTranslate2System, EngineSystem, System, add_cell_arguments, cells_from  # noqa: E402
from nmt_serve.model.padding import pad_sources  # noqa: E402
from nmt_serve.model.tokenizer import Tokenizer  # noqa: E402
from nmt_serve.runtime.manifest import load_model_dir  # noqa: E402

logger = logging.getLogger(__name__)

PARITY_SENTENCES = 16  # each export's PyTorch/ONNX parity check (greedy and beam 4)


class TransformersSystem:
    """transformers' MarianMTModel.generate on the Hugging Face dir itself (fp32, its KV cache)."""

    def __init__(self, source_dir: Path, threads: int, pad_id: int) -> None:
        from transformers import MarianMTModel

        torch.set_num_threads(threads)
        self.model = MarianMTModel.from_pretrained(str(source_dir)).eval()
        self.pad_id = pad_id
        self.name = "transformers fp32"

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        # Marian's source layout (tokens, then </s>, right-padded), as our engine and nmt-import's parity check feed it.
        ids, mask = pad_sources(sources, self.pad_id, self.model.config.eos_token_id)
        with torch.no_grad():
            output = self.model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask).long(), num_beams=cell.beam,
                                         do_sample=False, min_new_tokens=cell.length, max_new_tokens=cell.length, early_stopping=True)  # fmt: skip
        return (output.shape[1] - 1) * len(sources)  # the decoder start token is not generated


class SourceEosSystem:
    """A CTranslate2 translator fed the source layout of Marian and NLLB: the tokens, then </s> (their tokenizers append it)."""

    def __init__(self, inner: CTranslate2System, eos_id: int) -> None:
        self.inner, self.eos_id, self.name = inner, eos_id, inner.name

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        return self.inner.run([[*source, self.eos_id] for source in sources], cell)


def build_systems(source_dir: Path, checkpoint: Path, work: Path, threads: int) -> list[System]:
    import ctranslate2

    tokenizer = Tokenizer.load(checkpoint)
    tokens = tokenizer.token_strings()
    eos = tokens.index("</s>")
    systems: list[System] = [TransformersSystem(source_dir, threads, tokens.index("<pad>"))]
    for quantization, label in ((None, "fp32"), ("int8", "int8")):
        ct2_dir = work / f"ct2-{label}"
        ctranslate2.converters.TransformersConverter(str(source_dir)).convert(str(ct2_dir), quantization=quantization)
        systems.append(SourceEosSystem(CTranslate2System(ct2_dir, tokens, threads, label), eos))
    model_dirs = {label: checkpoint / f"onnx-{label}" for label in ("fp32", "int8")}
    systems += [EngineSystem(model_dir, threads, label) for label, model_dir in model_dirs.items()]
    return systems + native_systems(model_dirs, threads)


def format_agreement(checkpoint: Path) -> str:
    """Each exported dir's parity report: outputs identical to the imported PyTorch model, as for the shipped model."""
    lines = ["| model dir | greedy identical | beam 4 identical | max abs log-prob diff (tensors) |", "|---|---|---|---|"]
    for precision in ("fp32", "int8"):
        parity = load_model_dir(checkpoint / f"onnx-{precision}", verify_hashes=False).parity
        search = parity["search"]
        lines.append(f"| onnx-{precision} | {search['greedy']['identical_tokens']}/{search['greedy']['sentences']} | "
                     f"{search['beam4']['identical_tokens']}/{search['beam4']['sentences']} | {parity['tensors']['max_abs_log_prob_diff']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-marian-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    add_cell_arguments(parser, repeats=5)
    add_import_arguments(parser, parity_limit=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/marian.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source_dir = build_marian_dir(work / "opus-mt-de-en", vocab_size=OPUS_MT_VOCAB, **OPUS_MT_SHAPE)
        timings = ImportTimings("marian", args.parity_limit, PARITY_SENTENCES)
        # The int8 dir as the shipped ones: its self-attention cache in int8, scaled on sentences of their own.
        checkpoint = import_and_export(source_dir, "marian", work, german_sentences(200, seed=21), timings, german_sentences(500, seed=23))
        systems = build_systems(source_dir, checkpoint, work, args.threads)
        gc.freeze()
        sources = Tokenizer.load(checkpoint).encode_batch(german_sentences(max(c.batch for c in cells), seed=22))
        results = time_cells(systems, sources, cells, args.repeats)
        sections = [
            format_table(f"opus-mt-de-en shape (random weights), output length {args.length}, {args.threads} threads", systems, cells, results),
            timings.table(),
            format_agreement(checkpoint),
        ]  # fmt: skip
    write_report("OPUS-MT-shaped model: nmt-import + our engine against CTranslate2 and transformers", "nmt-marian-bench", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
