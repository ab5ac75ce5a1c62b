"""An imported model against transformers' own model (MarianMTModel, M2M100ForConditionalGeneration): log-probs and greedy outputs.

The reference is the source dir loaded by transformers; its greedy generate() outputs are the
targets, so the log-probs compared are those of real continuations. Pad is banned in both
searches (OPUS-MT generation and fairseq ban it, model/config.py banned_ids), and generate() gets no
forced EOS at its length limit, which our search does not add either. A multilingual model gets its
language tokens on both sides: the source's first token, and the target's first token forced
(generate()'s forced_bos_token_id, our target_prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt_serve.model.padding import pad_sources
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.transformer import Transformer

logger = logging.getLogger(__name__)

BATCH = 16
LOG_PROB_ELEMENTS = 1 << 24  # 64 MB of float32 per log-prob tensor of the teacher-forced comparison


def reference_greedy(reference: Any, src_ids: np.ndarray, src_mask: np.ndarray, pad_id: int, max_new_tokens: int,
                     forced_first: int | None = None) -> list[list[int]]:  # fmt: skip
    """transformers' greedy outputs without the decoder start token, up to and without EOS (`forced_first` included)."""
    output = reference.generate(
        input_ids=torch.from_numpy(src_ids), attention_mask=torch.from_numpy(src_mask).long(), num_beams=1, do_sample=False,
        max_new_tokens=max_new_tokens, min_length=0, bad_words_ids=[[pad_id]], forced_eos_token_id=None, repetition_penalty=1.0,
        no_repeat_ngram_size=0, length_penalty=1.0, forced_bos_token_id=forced_first,
    )  # fmt: skip
    eos = reference.config.eos_token_id
    targets = []
    for row in output[:, 1:].tolist():
        targets.append(row[: row.index(eos)] if eos in row else [token for token in row if token != pad_id])
    return targets


def teacher_forced_diff(model: Transformer, reference: Any, src_ids: np.ndarray, src_mask: np.ndarray, targets: list[list[int]]) -> float:
    """Max |ours - theirs| over every real target position's log-probs (banned ids left out)."""
    config = model.config
    width = max(len(target) for target in targets) + 1
    fed = np.full((len(targets), width), config.pad_id, dtype=np.int64)
    real = np.zeros((len(targets), width), dtype=bool)
    for row, target in enumerate(targets):
        fed[row, : len(target) + 1] = [config.bos_id, *target]
        real[row, : len(target) + 1] = True
    allowed = torch.ones(config.vocab_size, dtype=torch.bool)
    allowed[list(config.banned_ids)] = False
    worst = 0.0
    # Rows in chunks of at most LOG_PROB_ELEMENTS log-probs: 16 rows of [positions, V] are 1 GB per tensor at NLLB-200's 256k ids.
    chunk = max(1, LOG_PROB_ELEMENTS // (width * config.vocab_size))
    for start in range(0, len(targets), chunk):
        rows = slice(start, start + chunk)
        sources, mask, tgt = torch.from_numpy(src_ids[rows]), torch.from_numpy(src_mask[rows]), torch.from_numpy(fed[rows])
        with torch.no_grad():
            ours = model(sources, mask, tgt)
            theirs = torch.log_softmax(reference(input_ids=sources, attention_mask=mask.long(), decoder_input_ids=tgt).logits.float(), dim=-1)
        diff = (ours - theirs)[torch.from_numpy(real[rows])][:, allowed]
        worst = max(worst, float(diff.abs().max()))
    return worst


def compare_with_transformers(source_dir: Path, model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str], max_new_tokens: int = 64,
                              prefixes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> dict[str, Any]:  # fmt: skip
    """{'sentences', 'max_abs_log_prob_diff', 'greedy_identical', 'greedy_total', 'first_difference'} over `sentences`.

    `prefixes`: the language tokens (before each source, forced first in the target; at most one) of a multilingual model.
    """
    from transformers import AutoModelForSeq2SeqLM  # the import extra; only this check loads transformers' model

    reference = AutoModelForSeq2SeqLM.from_pretrained(str(source_dir)).eval()
    config = model.config
    source_prefix, target_prefix = prefixes
    # Both sides stop where the position table ends (our search clamps there; transformers would fail past it).
    max_new_tokens = min(max_new_tokens, config.max_positions - 1)
    encoded = [[*source_prefix, *ids][: config.max_positions - 1] for ids in tokenizer.encode_batch(list(sentences))]
    worst, identical, first_difference = 0.0, 0, None
    for start in range(0, len(encoded), BATCH):
        batch = encoded[start : start + BATCH]
        src_ids, src_mask = pad_sources(batch, config.pad_id, config.eos_id)
        targets = reference_greedy(reference, src_ids, src_mask, config.pad_id, max_new_tokens, target_prefix[0] if target_prefix else None)
        worst = max(worst, teacher_forced_diff(model, reference, src_ids, src_mask, targets))
        options = SearchOptions(beam_size=1, max_output_tokens=max_new_tokens, target_prefix=target_prefix)
        ours = generate(TorchStep(model), batch, options, config.bos_id, config.eos_id, config.max_positions)
        for offset, (target, hypotheses) in enumerate(zip(targets, ours, strict=True)):
            if list(hypotheses[0].token_ids) == target:
                identical += 1
            elif first_difference is None:
                first_difference = {"sentence": sentences[start + offset][:200], "transformers": target[:40], "ours": list(hypotheses[0].token_ids)[:40]}
    report = {"sentences": len(encoded), "max_abs_log_prob_diff": worst, "greedy_identical": identical, "greedy_total": len(encoded),
              "first_difference": first_difference}  # fmt: skip
    logger.info("against transformers' %s: max |log-prob diff| %.2e, greedy identical %d/%d", type(reference).__name__, worst, identical, len(encoded))
    return report
