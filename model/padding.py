"""Source padding shared by every decoder step and batcher: ids + EOS, right-padded, and the mask. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_sources(src_ids: Sequence[Sequence[int]], pad_id: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, S) int64 ids with EOS appended to each source and PAD after it, and the (N, S) bool mask (True = real)."""
    width = max(len(ids) for ids in src_ids) + 1
    batch = np.full((len(src_ids), width), pad_id, dtype=np.int64)
    for row, ids in enumerate(src_ids):
        batch[row, : len(ids) + 1] = [*ids, eos_id]
    return batch, batch != pad_id
