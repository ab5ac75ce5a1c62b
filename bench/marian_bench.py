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
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from nmt_serve.model.extras import require_extra

require_extra("nmt-marian-bench", "dev", ["torch", "transformers", "sentencepiece", "ctranslate2"])

import torch  # noqa: E402

from nmt_serve.bench.engine_bench import format_table, time_cells  # noqa: E402
from nmt_serve.bench.random_marian import OPUS_MT_SHAPE, OPUS_MT_VOCAB, build_marian_dir, german_sentences  # noqa: E402
from nmt_serve.bench.report import write_report  # noqa: E402
from nmt_serve.bench.systems import Cell, CTranslate2System, EngineSystem, System, add_cell_arguments, cells_from  # noqa: E402
from nmt_serve.model.corpus import write_tsv  # noqa: E402
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
    """A CTranslate2 translator fed Marian's source layout: the tokens, then </s> (MarianTokenizer appends it)."""

    def __init__(self, inner: CTranslate2System, eos_id: int) -> None:
        self.inner, self.eos_id, self.name = inner, eos_id, inner.name

    def run(self, sources: Sequence[Sequence[int]], cell: Cell) -> int:
        return self.inner.run([[*source, self.eos_id] for source in sources], cell)


def timed_import(source_dir: Path, out: Path, parity_limit: int, test: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of `nmt-import marian` (checkpoint, tokenizers, parity with transformers)."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "nmt_serve.importers.import_command", "marian", str(source_dir), "--out", str(out),
               "--parity-limit", str(parity_limit), "--parity-test", str(test)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # ru_maxrss is in kB on Linux


def timed_export(checkpoint: Path, precision: str, test: Path) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-m", "nmt_serve.export.onnx_export", str(checkpoint), "--out", str(checkpoint / f"onnx-{precision}"),
               "--precision", precision, "--parity-test", str(test), "--parity-limit", str(PARITY_SENTENCES)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


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
    systems += [EngineSystem(checkpoint / f"onnx-{label}", threads, label) for label in ("fp32", "int8")]
    return systems


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
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every system")
    parser.add_argument("--parity-limit", type=int, default=16, help="sentences the import compares with transformers")
    parser.add_argument("--out", type=Path, default=Path("bench/results/marian.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source_dir = build_marian_dir(work / "opus-mt-de-en", vocab_size=OPUS_MT_VOCAB, **OPUS_MT_SHAPE)
        test = work / "sentences.tsv"
        write_tsv(str(test), [(text, "") for text in german_sentences(200, seed=21)])
        checkpoint = work / "imported"
        import_seconds, import_rss = timed_import(source_dir, checkpoint, args.parity_limit, test)
        export_seconds = {precision: timed_export(checkpoint, precision, test) for precision in ("fp32", "int8")}
        systems = build_systems(source_dir, checkpoint, work, args.threads)
        gc.freeze()
        sources = Tokenizer.load(checkpoint).encode_batch(german_sentences(max(c.batch for c in cells), seed=22))
        results = time_cells(systems, sources, cells, args.repeats)
        sections = [
            format_table(f"opus-mt-de-en shape (random weights), output length {args.length}, {args.threads} threads", systems, cells, results),
            "| step | wall seconds | peak RSS |\n|---|---|---|\n"
            f"| nmt-import marian (checkpoint, tokenizers, parity with transformers on {args.parity_limit} sentences) | {import_seconds:.1f} | "
            f"{import_rss:.2f} GB |\n" + "".join(f"| nmt-export --precision {p} (with parity on {PARITY_SENTENCES} sentences) | {s:.1f} | |\n"
                                                for p, s in export_seconds.items()),
            format_agreement(checkpoint),
        ]  # fmt: skip
    write_report("OPUS-MT-shaped model: nmt-import + our engine against CTranslate2 and transformers", "nmt-marian-bench", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
