"""Parity of an ONNX model dir against the PyTorch checkpoint at three levels: tensors, tokens, text (nmt-parity --checkpoint)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from nmt_serve.export.int8_cache import past_cache_scales
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.evaluate import one_line, score
from nmt_serve.model.search import Hypothesis, SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.runtime.host import cpu_facts, describe_cpu
from nmt_serve.runtime.manifest import update_parity
from nmt_serve.runtime.ort_step import OrtStep

logger = logging.getLogger(__name__)

TENSOR_STEPS = 65  # past lengths 0..64
JOIN_STEPS = (0, 1, 7, 20, 41)  # rows join at these steps, so one call mixes positions 0..64
SEARCHES = {"greedy": SearchOptions(beam_size=1), "beam4": SearchOptions(beam_size=4)}


def check_tensors(torch_step: TorchStep, ort_step: OrtStep, sources: Sequence[Sequence[int]], seed: int = 0) -> dict[str, Any]:
    """Both steps in lockstep on the same rows: staggered joins, random beam-like reorders, random tokens.

    Reports the max |diff| of log-probs and of every cached K/V slot. The slots of an int8 cache
    (export/int8_cache.py) are multiplied by their scales, read from the ONNX decoder, before the comparison.
    """
    scales = past_cache_scales(ort_step.manifest.graph_path(ort_step.model_dir, "decoder"), ort_step.cache.past_names)
    rng = np.random.default_rng(seed)
    for step in (torch_step, ort_step):
        step.begin(sources)
    vocab = torch_step.vocab_size
    rows = 0
    max_log_prob_diff = max_cache_diff = 0.0
    steps = min(TENSOR_STEPS, torch_step.model.config.max_positions)  # position t is fed at step t
    for t in tqdm(range(steps), desc="parity tensors", unit="step"):
        # Existing rows continue from random parents (duplicates = beam expansion); new ones join at position 0.
        parents = rng.integers(0, rows, size=rows) if rows else np.zeros(0, dtype=np.int64)
        joining = len(sources) * int(t in JOIN_STEPS)
        parents = np.concatenate([parents, np.full(joining, -1)]).astype(np.int64)
        rows = len(parents)
        source_index = rng.integers(0, len(sources), size=rows)
        tgt_ids = rng.integers(4, vocab, size=rows)
        expected = torch_step(source_index, parents, tgt_ids)
        actual = ort_step(source_index, parents, tgt_ids)
        max_log_prob_diff = max(max_log_prob_diff, log_prob_diff(expected, actual))
        # Torch keeps a padded cache with a mask; ONNX Runtime keeps each row's tokens from slot 0.
        torch_past = [tensor.numpy() for pair in torch_step.past for tensor in pair]
        for row in range(rows):
            real = torch_step.past_mask[row].numpy()
            for reference, candidate, scale in zip(torch_past, ort_step.cache.row_cache(row), scales, strict=True):
                values = candidate if scale is None else candidate * scale
                max_cache_diff = max(max_cache_diff, float(np.abs(reference[row][:, real] - values).max()))
    return {"steps": steps, "final_rows": rows, "max_abs_log_prob_diff": max_log_prob_diff, "max_abs_present_kv_diff": max_cache_diff}


def log_prob_diff(expected: np.ndarray, actual: np.ndarray) -> float:
    """Max |expected - actual|: a banned id (-inf in both) agrees; -inf in only one is an infinite difference."""
    both_banned = np.isneginf(expected) & np.isneginf(actual)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both_banned, 0.0, expected - actual))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def decode_all(step: Any, sources: Sequence[Sequence[int]], options: SearchOptions, config: Any, batch_size: int, desc: str) -> list[Hypothesis]:
    """Best hypothesis per source, in length-sorted batches."""
    order = sorted(range(len(sources)), key=lambda index: len(sources[index]))
    best: list[Hypothesis | None] = [None] * len(sources)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        batch = order[start : start + batch_size]
        results = generate(step, [sources[i] for i in batch], options, config.bos_id, config.eos_id, config.max_positions)
        for index, hypotheses in zip(batch, results, strict=True):
            best[index] = hypotheses[0]
    return [hypothesis for hypothesis in best if hypothesis is not None]


def decode_searches(step: Any, sources: Sequence[Sequence[int]], config: Any, label: str) -> dict[str, list[Hypothesis]]:
    """The best hypothesis of every source under each search of SEARCHES (greedy, beam 4)."""
    return {name: decode_all(step, sources, options, config, 64, f"{name} {label}") for name, options in SEARCHES.items()}


def compare_searches(expected: dict[str, list[Hypothesis]], actual: dict[str, list[Hypothesis]], tokenizer: Any,
                     references: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """Per search: how many of `actual`'s outputs equal `expected`'s (the PyTorch model's), and the BLEU and chrF of both."""
    report: dict[str, Any] = {}
    for name, wanted in expected.items():
        got = actual[name]
        identical = sum(a.token_ids == b.token_ids for a, b in zip(wanted, got, strict=True))
        torch_text = [one_line(tokenizer.decode(h.token_ids)) for h in wanted]
        onnx_text = [one_line(tokenizer.decode(h.token_ids)) for h in got]
        torch_scores, onnx_scores = score(torch_text, references), score(onnx_text, references)
        report[name] = {
            "sentences": len(wanted),
            "identical_tokens": identical,
            "identical_ratio": round(identical / max(len(wanted), 1), 4),
            "identical_text": sum(a == b for a, b in zip(torch_text, onnx_text, strict=True)),
            "bleu_torch": torch_scores["bleu"],
            "bleu_onnx": onnx_scores["bleu"],
            "bleu_delta": round(onnx_scores["bleu"] - torch_scores["bleu"], 2),
            "chrf_torch": torch_scores["chrf"],
            "chrf_onnx": onnx_scores["chrf"],
        }
    return report


def check_search(torch_step: TorchStep, ort_step: OrtStep, tokenizer: Any, pairs: Sequence[tuple[str, str]], config: Any) -> dict[str, Any]:
    """Token ids of greedy and beam 4 through both steps; BLEU of each against the references."""
    sources = [ids[: config.max_positions - 1] for ids in tokenizer.encode_batch([src for src, _ in pairs])]
    expected, actual = decode_searches(torch_step, sources, config, "torch"), decode_searches(ort_step, sources, config, "onnx")
    return compare_searches(expected, actual, tokenizer, [ref for _, ref in pairs])


BATCH_CHECK_SENTENCES = 32


def check_batch_invariance(ort_step: OrtStep, sources: Sequence[Sequence[int]], config: Any) -> dict[str, Any]:
    """Per search: the first BATCH_CHECK_SENTENCES sources decoded one at a time against all of them in
    one batch: identical token ids, and the largest score difference (0.0 where the model dir is batch-invariant)."""
    sources = list(sources[:BATCH_CHECK_SENTENCES])
    report: dict[str, Any] = {"sentences": len(sources)}
    for name, options in SEARCHES.items():
        alone = decode_all(ort_step, sources, options, config, 1, f"{name} alone")
        packed = decode_all(ort_step, sources, options, config, len(sources), f"{name} packed")
        report[name] = {
            "identical_tokens": sum(a.token_ids == b.token_ids for a, b in zip(alone, packed, strict=True)),
            "max_score_diff": max(abs(a.score - b.score) for a, b in zip(alone, packed, strict=True)),
        }
    return report


def random_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Stand-in sentences when no test TSV is given: German-looking words, no reference quality implied."""
    rng = np.random.default_rng(seed)
    words = ["ich", "habe", "Hunger", "wo", "ist", "der", "Bahnhof", "das", "Wetter", "heute", "schön", "Haus", "groß"]
    return [(" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) + ".", "") for _ in range(count)]


def run_parity(model_dir: Path, checkpoint_dir: Path, test: Path | None = None, limit: int = 0) -> dict[str, Any]:
    """All three levels; the report goes into the model dir's manifest.json and is printed as a table."""
    started = time.perf_counter()
    checkpoint = load_checkpoint(checkpoint_dir)
    torch_step, ort_step = TorchStep(checkpoint.model), OrtStep(model_dir)
    config = checkpoint.config
    pairs = read_tsv(str(test)) if test else random_pairs(32)
    if limit:
        pairs = pairs[:limit]
    tensor_sources = checkpoint.tokenizer.encode_batch([src for src, _ in pairs[:5]])
    report: dict[str, Any] = {
        "precision": ort_step.manifest.precision,
        "provider": ort_step.decoder.get_providers()[0],
        "cpu": cpu_facts(),  # int8 results depend on the CPU's instruction sets (runtime/host.py)
        "test": str(test) if test else "random sentences (no references)",
        "tensors": check_tensors(torch_step, ort_step, [ids[: config.max_positions - 1] for ids in tensor_sources]),
        "search": check_search(torch_step, ort_step, checkpoint.tokenizer, pairs, config),
    }
    search_sources = [ids[: config.max_positions - 1] for ids in checkpoint.tokenizer.encode_batch([src for src, _ in pairs])]
    report["batch"] = check_batch_invariance(ort_step, search_sources, config)
    report["seconds"] = round(time.perf_counter() - started, 1)
    update_parity(model_dir, report)
    sys.stdout.write(format_report(report) + "\n")
    return report


def format_report(report: dict[str, Any]) -> str:
    tensors = report["tensors"]
    lines = [
        f"parity {report['precision']} on {report['provider']}, {describe_cpu(report['cpu'])} ({report['test']})",
        "",
        "| level | check | value |",
        "|---|---|---|",
        f"| tensors | max abs log-prob diff ({tensors['steps']} steps, past 0..{tensors['steps'] - 1}) | {tensors['max_abs_log_prob_diff']:.2e} |",
        f"| tensors | max abs present K/V diff | {tensors['max_abs_present_kv_diff']:.2e} |",
    ]
    for name, result in report["search"].items():
        lines.append(f"| tokens | {name}: identical token ids | {result['identical_tokens']}/{result['sentences']} ({100 * result['identical_ratio']:.1f}%) |")
        lines.append(f"| text | {name}: BLEU torch / onnx (delta) | {result['bleu_torch']:.2f} / {result['bleu_onnx']:.2f} ({result['bleu_delta']:+.2f}) |")
    batch = report.get("batch")
    for name in SEARCHES if batch else ():
        lines.append(f"| batch | {name}: alone = packed token ids (max score diff) | {batch[name]['identical_tokens']}/{batch['sentences']} "
                     f"({batch[name]['max_score_diff']:.1e}) |")  # fmt: skip
    return "\n".join(lines)
