"""nmt-int8-schemes: every int8 quantization scheme of one checkpoint against its PyTorch fp32 model on this CPU.

Per scheme: identical greedy / beam-4 outputs, the largest log-prob difference, BLEU, and the engine's
tokens/s (interleaved with fp32, medians). Which scheme nmt-export ships is chosen from this table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from nmt_serve.model.extras import require_extra

require_extra("nmt-int8-schemes", "dev", ('torch', 'onnx', 'sacrebleu'))

from nmt_serve.bench.engine_bench import sample_sources, time_cells
from nmt_serve.bench.report import write_report
from nmt_serve.bench.systems import Cell, EngineSystem, add_cell_arguments, cells_from
from nmt_serve.export.int8_cache import calibrate_cache_scales, calibration_sources, quantize_cache_file
from nmt_serve.export.onnx_export import DECODER_FILE, ENCODER_FILE, graph_data_files, graph_spec
from nmt_serve.export.optimize import INT8_SCHEMES, convert_to_int8
from nmt_serve.export.parity import check_tensors, compare_searches, decode_searches
from nmt_serve.export.shared_weights import share_weights
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.tokenizer import tokenizer_files
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.manifest import load_model_dir, write_manifest
from nmt_serve.runtime.ort_step import OrtStep

logger = logging.getLogger(__name__)

INT8_CACHE_SUFFIX = " + int8 cache"  # a scheme's row label with the self-attention cache in int8


def build_scheme_dir(fp32_dir: Path, scheme: str, out: Path, cache_scales: np.ndarray | None = None) -> Path:
    """An int8 model dir made from an exported fp32 one with `scheme`; with cache_scales, its decoder keeps the
    self-attention cache in int8 (export/int8_cache.py)."""
    out.mkdir(parents=True, exist_ok=True)
    fp32 = load_model_dir(fp32_dir)
    for name in (ENCODER_FILE, DECODER_FILE):
        convert_to_int8(fp32_dir / name, out / name, scheme)
    if cache_scales is not None:
        quantize_cache_file(out / DECODER_FILE, cache_scales, fp32.config.n_heads, fp32.config.head_dim)
    share_weights(out, (ENCODER_FILE, DECODER_FILE))  # laid out as nmt-export lays out its dirs
    # An imported model's target_tokenizer.json comes along: its decoding needs it.
    tokenizers = tokenizer_files(fp32_dir)
    for name in tokenizers:
        shutil.copyfile(fp32_dir / name, out / name)
    manifest = dataclasses.replace(fp32, precision="int8", files={}, parity={},
                                   graphs={"encoder": graph_spec(out / ENCODER_FILE), "decoder": graph_spec(out / DECODER_FILE)})  # fmt: skip
    write_manifest(out, manifest, [ENCODER_FILE, DECODER_FILE, *graph_data_files(out), *tokenizers])
    return out


def measure_schemes(checkpoint: Path, fp32_dir: Path, schemes: Sequence[str], test: Path, limit: int, work: Path,
                    cache_calibration: Path | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per model dir (fp32, then each scheme, then each scheme with an int8 cache scaled on `cache_calibration`'s
    pairs): the largest log-prob difference and export/parity.py's search report against the PyTorch outputs,
    which are decoded once for all of them."""
    loaded = load_checkpoint(checkpoint)
    config, tokenizer = loaded.config, loaded.tokenizer
    pairs = read_tsv(str(test))[: limit or None]
    sources = [ids[: config.max_positions - 1] for ids in tokenizer.encode_batch([src for src, _ in pairs])]
    references = [ref for _, ref in pairs]
    expected = decode_searches(TorchStep(loaded.model), sources, config, "torch")
    dirs = {"fp32": fp32_dir} | {scheme: build_scheme_dir(fp32_dir, scheme, work / scheme) for scheme in schemes}
    if cache_calibration is not None:
        scales = calibrate_cache_scales(loaded.model, calibration_sources(cache_calibration, tokenizer))
        dirs |= {f"{scheme}{INT8_CACHE_SUFFIX}": build_scheme_dir(fp32_dir, scheme, work / f"{scheme}-int8-cache", scales) for scheme in schemes}
    results: dict[str, dict[str, Any]] = {}
    for label, model_dir in dirs.items():
        ort_step = OrtStep(model_dir, threads=1)
        tensors = check_tensors(TorchStep(loaded.model), ort_step, sources[:5])
        search = compare_searches(expected, decode_searches(ort_step, sources, config, "onnx"), tokenizer, references)
        results[label] = {"max_log_prob_diff": tensors["max_abs_log_prob_diff"], "search": search,
                          "bytes": sum(path.stat().st_size for path in model_dir.glob("*.onnx")), "dir": model_dir}  # fmt: skip
    return results


def measure_speed(results: dict[str, dict[str, Any]], checkpoint: Path, test: Path, cells: list[Cell], repeats: int) -> dict[tuple[Cell, str], float]:
    systems = [EngineSystem(entry["dir"], 1, label) for label, entry in results.items()]
    gc.freeze()
    sources = sample_sources(test, max(cell.batch for cell in cells), load_checkpoint(checkpoint).config.vocab_size, checkpoint)
    timings = time_cells(systems, sources, cells, repeats)
    return {key: statistics.median(values) for key, values in timings.items()}


def format_tables(results: dict[str, dict[str, Any]], speed: dict[tuple[Cell, str], float], cells: list[Cell], sentences: int) -> str:
    lines = [f"### Agreement with PyTorch fp32 ({sentences} held-out sentences)", "",
             "| scheme | graphs (MB) | max log-prob diff | greedy identical | beam 4 identical | BLEU greedy | BLEU beam 4 |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, entry in results.items():
        greedy, beam = entry["search"]["greedy"], entry["search"]["beam4"]
        lines.append(f"| {label} | {entry['bytes'] / 1e6:.1f} | {entry['max_log_prob_diff']:.3f} | {100 * greedy['identical_ratio']:.1f}% | "
                     f"{100 * beam['identical_ratio']:.1f}% | {greedy['bleu_onnx']:.2f} | {beam['bleu_onnx']:.2f} |")  # fmt: skip
    torch = next(iter(results.values()))["search"]
    lines.append(f"| pytorch fp32 | - | - | 100.0% | 100.0% | {torch['greedy']['bleu_torch']:.2f} | {torch['beam4']['bleu_torch']:.2f} |")
    header = " | ".join(f"b{cell.batch} k{cell.beam}" for cell in cells)
    lines += ["", "### Engine tokens/s, 1 thread (median; ratio to fp32)", "", f"| scheme | {header} |", "|---|" + "---|" * len(cells)]
    for label in results:
        row = [f"{speed[(cell, f'nmt-serve {label}')]:.0f} ({speed[(cell, f'nmt-serve {label}')] / speed[(cell, 'nmt-serve fp32')]:.2f}x)" for cell in cells]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-int8-schemes", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--checkpoint", type=Path, default=Path("artifacts/de-en-small"))
    parser.add_argument("--fp32-dir", type=Path, default=None, help="its exported fp32 model dir (default: CHECKPOINT/onnx-fp32)")
    parser.add_argument("--test", type=Path, default=Path("data/corpus/test.tsv"), help="German<TAB>English pairs")
    parser.add_argument("--limit", type=int, default=0, help="only the first N pairs (0 = all)")
    parser.add_argument("--schemes", default=",".join(INT8_SCHEMES))
    add_cell_arguments(parser, repeats=5)
    parser.add_argument("--cache-calibration", type=Path, default=None,
                        help="source sentences or pairs (not the test set): each scheme is measured once more with its self-attention "
                             "cache in int8, scaled on them (nmt-export --cache-calibration)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8_schemes.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cells = cells_from(args)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure_schemes(args.checkpoint, args.fp32_dir or args.checkpoint / "onnx-fp32", args.schemes.split(","), args.test, args.limit, Path(tmp),
                                   args.cache_calibration)  # fmt: skip
        speed = measure_speed(results, args.checkpoint, args.test, cells, args.repeats)
        table = format_tables(results, speed, cells, len(read_tsv(str(args.test))[: args.limit or None]))
    write_report("int8 schemes", "nmt-int8-schemes", argv, [table], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
