"""nmt-eval: translate a test TSV with the PyTorch step through model/search.py; print BLEU and chrF."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from importlib.metadata import version

from nmt_serve.model.extras import require_extra

require_extra("nmt-eval", "train", ('torch', 'sacrebleu', 'tqdm'))

import numpy as np
import sacrebleu
import torch
from tqdm import tqdm

from nmt_serve.model.batching import encode_pairs, plan_batches
from nmt_serve.model.checkpoint import Checkpoint, load_checkpoint, load_train_info, save_train_info
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.device import DEVICE_CHOICES, pick_device
from nmt_serve.model.loss import mean_nll
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.transformer import Transformer

logger = logging.getLogger(__name__)

NLL_BATCH_TOKENS = 8000  # padded tokens per teacher-forced batch


def translate(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    options: SearchOptions,
    batch_size: int = 64,
    progress: bool = False,
) -> list[str]:
    """Best hypothesis for each text; batches are formed from length-sorted texts, output keeps input order."""
    config = model.config
    # Leave room for EOS within the position table.
    src_ids = [ids[: config.max_positions - 1] for ids in tokenizer.encode_batch(list(texts))]
    order = sorted(range(len(texts)), key=lambda index: len(src_ids[index]))
    step = TorchStep(model)
    outputs: list[str] = [""] * len(texts)
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="translate", unit="batch", disable=not progress):
        results = generate(step, [src_ids[index] for index in batch], options, config.bos_id, config.eos_id, config.max_positions)
        for index, hypotheses in zip(batch, results, strict=True):
            outputs[index] = tokenizer.decode(hypotheses[0].token_ids)
    return outputs


def reference_nll(checkpoint: Checkpoint, pairs: Sequence[tuple[str, str]], device: torch.device) -> float:
    """Mean NLL per reference token; pairs too long for the position table are left out, as in training."""
    id_pairs = encode_pairs(checkpoint.tokenizer, pairs, checkpoint.config.max_positions - 1)
    batches = plan_batches([(len(src), len(tgt)) for src, tgt in id_pairs], NLL_BATCH_TOKENS, np.random.default_rng(0))
    return mean_nll(checkpoint.model, id_pairs, batches, device)


def one_line(text: str) -> str:
    """A hypothesis fit for a one-per-line file: a generated line break (\\n, \\x0c, \\u2028...) becomes a space."""
    return " ".join(text.splitlines())


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Detokenized sacrebleu BLEU and chrF."""
    refs = [list(references)]
    return {
        "bleu": round(sacrebleu.corpus_bleu(list(hypotheses), refs).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(list(hypotheses), refs).score, 2),
    }


def record_result(checkpoint: Path, name: str, result: dict[str, object]) -> None:
    """Keep a test score in train.json, so that a later nmt-eval run can be compared with it."""
    info = load_train_info(checkpoint)
    info.setdefault("test", {})[name] = result
    save_train_info(info, checkpoint)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-eval", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("checkpoint", type=Path, help="checkpoint dir (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--test", type=Path, required=True, help="TSV of German<TAB>English pairs")
    parser.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    parser.add_argument("--length-penalty", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per search batch")
    parser.add_argument("--limit", type=int, default=0, help="only the first N pairs (0 = all)")
    parser.add_argument("--output", type=Path, help="hypotheses file (default: CHECKPOINT/hyps.<test>.beam<K>.txt)")
    parser.add_argument("--nll", action="store_true",
                        help="also report the references' mean NLL per token (teacher-forced): on training pairs against "
                             "held-out ones it shows how far the model memorised its data")  # fmt: skip
    parser.add_argument("--record", action="store_true", help="store the scores in CHECKPOINT/train.json under test.<name>")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto", help="auto = CUDA when torch sees a GPU, else CPU")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    checkpoint = load_checkpoint(args.checkpoint, str(device))
    pairs = read_tsv(args.test)
    if args.limit:
        pairs = pairs[: args.limit]
    options = SearchOptions(beam_size=args.beam, length_penalty=args.length_penalty)
    hypotheses = translate(checkpoint.model, checkpoint.tokenizer, [src for src, _ in pairs], options, args.batch_size, progress=True)
    hypotheses = [one_line(text) for text in hypotheses]
    scores = score(hypotheses, [ref for _, ref in pairs])
    output = args.output or args.checkpoint / f"hyps.{args.test.stem}.beam{args.beam}.txt"
    output.write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    result = {"test": str(args.test), "sentences": len(pairs), "beam": args.beam, **scores}
    if args.nll:
        result["nll"] = round(reference_nll(checkpoint, pairs, device), 4)
    sys.stdout.write(json.dumps(result) + "\n")
    if args.record:
        record_result(args.checkpoint, f"beam{args.beam}" if args.beam > 1 else "greedy", result)
    logger.info("hypotheses written to %s", output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
