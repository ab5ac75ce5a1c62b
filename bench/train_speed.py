"""nmt-train-speed: what each CPU training-speed option of nmt-train buys on one corpus.

Throughput: every variant trains the same preset from fresh weights for a fixed number of target-token
budgets in its own process (so each one's peak resident memory is its own), in rounds that take the
variants in a rotated order; each round plans its batches with another seed. Medians over the rounds, and
each variant's ratio to the baseline of the same round. The first steps of each leg are timed apart
(torch.compile compiles there). Quality: the options that change the optimization (more batches per
step) train with the same data order to the same target tokens, the warm-up scaled to the same tokens,
and their validation loss is compared at equal target tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from nmt_serve.model.extras import require_extra

require_extra("nmt-train-speed", "train", ('torch', 'safetensors', 'sacrebleu', 'tqdm'))

import numpy as np
import torch

from nmt_serve.bench.report import rotated, write_report
from nmt_serve.model.batching import encode_pairs, plan_batches
from nmt_serve.model.checkpoint import TOKENIZER_FILE
from nmt_serve.model.config import PRESETS
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.train import Trainer, TrainSettings, load_or_train_tokenizer
from nmt_serve.model.transformer import Transformer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    batch_scale: float = 1.0  # of --max-tokens
    accumulate: int = 1
    compile: bool = False
    bf16: bool = False

    def tokens_per_step(self, max_tokens: int) -> int:
        return int(max_tokens * self.batch_scale) * self.accumulate


VARIANTS = {variant.name: variant for variant in (
    Variant("baseline"),
    Variant("bf16", bf16=True),
    Variant("compile", compile=True),
    Variant("batch x2", batch_scale=2.0),
    Variant("accumulate 2", accumulate=2),
    Variant("accumulate 4 of half batches", batch_scale=0.5, accumulate=4),
)}  # fmt: skip
QUALITY_ACCUMULATIONS = (1, 2, 4)


def run_leg(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's leg in this process: untimed-apart first steps, then the timed steps; its peak memory."""
    variant = VARIANTS[spec["variant"]]
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    work = Path(spec["work"])
    tokenizer = Tokenizer.load(work / TOKENIZER_FILE)
    config = dataclasses.replace(PRESETS[spec["preset"]], vocab_size=tokenizer.vocab_size)
    settings = TrainSettings(max_tokens=int(spec["max_tokens"] * variant.batch_scale), accumulate=variant.accumulate, compile=variant.compile,
                             bf16=variant.bf16, seed=spec["seed"])  # fmt: skip
    pairs = read_tsv(spec["train"])
    trainer = Trainer(Transformer(config), tokenizer, pairs, pairs[:8], work, settings)
    trainer.model.train()
    started = time.perf_counter()
    for _ in range(spec["first_steps"]):
        trainer.advance()
    first_seconds = time.perf_counter() - started
    steps = max(1, round(spec["batches"] * spec["max_tokens"] / variant.tokens_per_step(spec["max_tokens"])))
    tokens, load = 0, os.getloadavg()[0]
    started = time.perf_counter()
    for _ in range(steps):
        tokens += trainer.advance()[1]
    seconds = time.perf_counter() - started
    return {"variant": variant.name, "round": spec["round"], "first_seconds": first_seconds, "steps": steps, "target_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "load": load,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip


def leg_in_process(spec: dict[str, Any]) -> dict[str, Any]:
    """run_leg in a process of its own: its resident memory peak is the variant's alone."""
    command = [sys.executable, "-m", "nmt_serve.bench.train_speed", "--leg", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"leg {spec['variant']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def padding_share(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], max_tokens: int, max_len: int) -> tuple[float, float]:
    """Shares of real tokens among the padded source and target slots of one epoch's batches (1.0 = no padding)."""
    ids = encode_pairs(tokenizer, pairs, max_len)
    lengths = [(len(src) + 1, len(tgt) + 1) for src, tgt in ids]
    batches = plan_batches([(s - 1, t - 1) for s, t in lengths], max_tokens, np.random.default_rng(0))
    real_src = real_tgt = slots_src = slots_tgt = 0
    for batch in batches:
        rows = [lengths[i] for i in batch]
        real_src, real_tgt = real_src + sum(s for s, _ in rows), real_tgt + sum(t for _, t in rows)
        slots_src, slots_tgt = slots_src + len(rows) * max(s for s, _ in rows), slots_tgt + len(rows) * max(t for _, t in rows)
    return real_src / slots_src, real_tgt / slots_tgt


def measure_speed(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    names = [name.strip() for name in args.variants.split(",")]
    results = []
    for round_index in range(args.rounds):
        for name in rotated(names, round_index):
            spec = {"variant": name, "round": round_index, "seed": args.seed + round_index, "threads": args.threads, "preset": args.preset,
                    "max_tokens": args.max_tokens, "batches": args.batches, "first_steps": args.first_steps, "train": str(args.train),
                    "work": str(work)}  # fmt: skip
            result = leg_in_process(spec)
            logger.info("round %d %s: %.0f target tokens/s (first steps %.1f s, peak %.0f MB, load %.2f)", round_index, name,
                        result["tokens_per_s"], result["first_seconds"], result["peak_rss_mb"], result["load"])  # fmt: skip
            results.append(result)
    return results


def speed_table(results: list[dict[str, Any]], max_tokens: int) -> str:
    names = list(dict.fromkeys(result["variant"] for result in results))
    baseline = {result["round"]: result["tokens_per_s"] for result in results if result["variant"] == "baseline"}
    lines = ["| variant | target tokens per step (padded, at most) | target tokens/s (median) | per round | ratio to baseline (median of rounds) "
             "| first steps (s), per round | peak RSS (MB, median) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in names:
        rows = sorted((result for result in results if result["variant"] == name), key=lambda result: result["round"])
        ratios = [row["tokens_per_s"] / baseline[row["round"]] for row in rows if row["round"] in baseline]
        lines.append(f"| {name} | {VARIANTS[name].tokens_per_step(max_tokens):,} | {statistics.median(row['tokens_per_s'] for row in rows):,.0f} | "
                     + ", ".join(f"{row['tokens_per_s']:,.0f}" for row in rows) + " | "
                     + (f"{statistics.median(ratios):.2f}x" if ratios else "-") + " | "
                     + ", ".join(f"{row['first_seconds']:.1f}" for row in rows)
                     + f" | {statistics.median(row['peak_rss_mb'] for row in rows):,.0f} |")  # fmt: skip
    return "\n".join(lines)


def measure_quality(args: argparse.Namespace, work: Path) -> dict[int, dict[str, Any]]:
    """nmt-train runs with 1, 2 and 4 batches per step over the same batches in the same order, to the same target tokens."""
    records = {}
    for accumulate in QUALITY_ACCUMULATIONS:
        out = work / f"quality-accumulate-{accumulate}"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / TOKENIZER_FILE, out / TOKENIZER_FILE)  # the same ids in every run
        steps, every = args.quality_steps // accumulate, args.quality_eval_every // accumulate
        command = [sys.executable, "-m", "nmt_serve.model.train", "--train", str(args.train), "--valid", str(args.valid), "--out", str(out),
                   "--preset", args.preset, "--threads", str(args.threads), "--max-tokens", str(args.quality_max_tokens), "--accumulate", str(accumulate),
                   "--max-steps", str(steps), "--eval-every", str(every), "--log-every", str(every), "--warmup-steps", str(args.quality_warmup // accumulate),
                   "--valid-bleu-size", "100", "--seed", str(args.seed), "--no-bf16"]  # fmt: skip
        logger.info("quality run: %s", " ".join(command[3:]))
        subprocess.run(command, check=True, capture_output=True)
        records[accumulate] = json.loads((out / "train.json").read_text(encoding="utf-8"))
    return records


def quality_table(records: dict[int, dict[str, Any]], max_tokens: int) -> str:
    checkpoints = len(records[1]["validations"])
    lines = ["| batches per step | padded tokens per step (at most) | steps | " + " | ".join(f"valid NLL at {index + 1}/{checkpoints}" for index in range(checkpoints))
             + " | greedy BLEU (100 sentences) at the end | target tokens |", "|---|---|---|" + "---|" * checkpoints + "---|---|"]  # fmt: skip
    rows = [f"| {accumulate} | {max_tokens * accumulate:,} | {record['steps']} | " + " | ".join(f"{result['valid_nll']:.3f}" for result in record["validations"])
            + f" | {record['validations'][-1]['bleu']:.2f} | {record['target_tokens']:,} |" for accumulate, record in records.items()]  # fmt: skip
    return "\n".join([*lines, *rows])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-train-speed", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/train-speed.md"))
    parser.add_argument("--train", type=Path, default=Path("data/public/multi30k-train.tsv"))
    parser.add_argument("--valid", type=Path, default=Path("data/public/multi30k-valid.tsv"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=TrainSettings().max_tokens, help="the baseline's batch (nmt-train's default)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10, help="timed work per leg, in batches of --max-tokens")
    parser.add_argument("--first-steps", type=int, default=2, help="steps timed apart before the timed ones (compilation happens there)")
    parser.add_argument("--quality-max-tokens", type=int, default=2000, help="padded tokens per batch of the quality runs")
    parser.add_argument("--quality-steps", type=int, default=160, help="steps of the one-batch quality run (0 = no quality runs)")
    parser.add_argument("--quality-eval-every", type=int, default=40)
    parser.add_argument("--quality-warmup", type=int, default=80, help="warm-up steps of the one-batch run; divided by the batches per step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # internal: one leg, in the process nmt-train-speed starts for it
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.leg:
        print(json.dumps(run_leg(json.loads(args.leg))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs = read_tsv(args.train)
        tokenizer = load_or_train_tokenizer(work, pairs, PRESETS[args.preset].vocab_size)
        src_share, tgt_share = padding_share(tokenizer, pairs, args.max_tokens, TrainSettings().max_len)
        results = measure_speed(args, work)
        records = measure_quality(args, work) if args.quality_steps else {}
    loads = [result["load"] for result in results]
    sections = [
        f"### Throughput: `{args.preset}` preset on {args.train.name} ({len(pairs):,} pairs), {args.threads} threads, {args.rounds} interleaved rounds",
        f"Each leg: a fresh model in its own process, {args.first_steps} first steps timed apart, then {args.batches} batches' worth of "
        f"{args.max_tokens:,} padded tokens (fewer, larger steps where a step holds more). The machine was shared with other work: the "
        f"1-minute load average at the start of the timed steps ranged {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores, so "
        "the variants were interleaved and compared by their ratio to the baseline of the same round.",
        speed_table(results, args.max_tokens),
        f"Length-sorted batches of {args.max_tokens:,} padded tokens: {100 * src_share:.1f}% of the source slots and {100 * tgt_share:.1f}% of "
        "the target slots hold real tokens (EOS/BOS included), which bounds what any finer bucketing could save.",
    ]
    if records:
        sections += [f"### Quality at equal target tokens: the same batches in the same order, warm-up {args.quality_warmup} steps divided "
                     f"by the batches per step, peak LR {TrainSettings().peak_lr}, dropout of the preset, fp32", quality_table(records, args.quality_max_tokens)]  # fmt: skip
    sections.append(f"Total wall time {(time.monotonic() - started) / 60:.1f} minutes.")
    write_report("Training speed", "nmt-train-speed", argv, sections, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
