"""Token-count batches of similar-length pairs, so little compute goes to padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nmt_serve.model.config import BOS_ID, EOS_ID, PAD_ID
from nmt_serve.model.padding import pad_sources
from nmt_serve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Batch:
    src_ids: torch.Tensor  # (B, S) source ids + EOS, right-padded
    src_mask: torch.Tensor  # (B, S) bool, True = real token
    tgt_in: torch.Tensor  # (B, T) BOS + target ids, right-padded
    tgt_out: torch.Tensor  # (B, T) target ids + EOS, right-padded with PAD
    n_tgt_tokens: int

    @property
    def size(self) -> int:
        return self.src_ids.shape[0]

    def to(self, device: torch.device) -> Batch:
        """The same batch on `device` (itself when it is there already)."""
        if self.src_ids.device == device:
            return self
        src_ids, src_mask, tgt_in, tgt_out = (tensor.to(device, non_blocking=True) for tensor in (self.src_ids, self.src_mask, self.tgt_in, self.tgt_out))
        return Batch(src_ids, src_mask, tgt_in, tgt_out, self.n_tgt_tokens)


def make_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Batch:
    """Tensors for (source ids, target ids) pairs, neither with special tokens yet."""
    src_ids, src_mask = pad_sources([src for src, _ in pairs], PAD_ID, EOS_ID)
    tgt_len = max(len(tgt) for _, tgt in pairs) + 1
    tgt_in = np.full((len(pairs), tgt_len), PAD_ID, dtype=np.int64)
    tgt_out = np.full((len(pairs), tgt_len), PAD_ID, dtype=np.int64)
    for row, (src, tgt) in enumerate(pairs):
        tgt_in[row, : len(tgt) + 1] = [BOS_ID, *tgt]
        tgt_out[row, : len(tgt) + 1] = [*tgt, EOS_ID]
    return Batch(torch.from_numpy(src_ids), torch.from_numpy(src_mask), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), int((tgt_out != PAD_ID).sum()))


def plan_batches(
    lengths: Sequence[tuple[int, int]],
    max_tokens: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Index groups whose padded size (rows * longest side) stays within `max_tokens`.

    Pairs are sorted by length with random tie order, cut greedily, then the batch order is
    shuffled: each epoch sees different neighbours, yet padding stays small.
    """
    lengths_array = np.asarray(lengths, dtype=np.int64).reshape(-1, 2) + 1  # + EOS / BOS
    longest = lengths_array.max(axis=1)
    order = np.lexsort((rng.random(len(longest)), lengths_array[:, 0], longest))
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        end = start + 1
        # Sorted ascending, so the last row added is the longest in the batch.
        while end < len(order) and (end + 1 - start) * longest[order[end]] <= max_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    rng.shuffle(batches)
    return batches


def encode_pairs(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token ids of (German, English) pairs; pairs with an empty side or one longer than `max_len` are skipped."""
    sources = tokenizer.encode_batch([src for src, _ in pairs])
    targets = tokenizer.encode_batch([tgt for _, tgt in pairs])
    return [(s, t) for s, t in zip(sources, targets, strict=True) if 0 < len(s) <= max_len and 0 < len(t) <= max_len]
