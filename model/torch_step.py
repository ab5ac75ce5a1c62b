"""TorchStep: the Step protocol of model/search.py over the PyTorch decode_step with a KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from model.padding import pad_sources
from model.transformer import KV, Transformer


class TorchStep:
    """Rows at different positions share one decode_step call; the cache follows `parent_rows`.

    The reference implementation that parity compares the ONNX Runtime step against.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model.eval()
        self.vocab_size = model.config.vocab_size
        self.cross: list[KV] = []
        self.src_mask = torch.zeros(0, 0, dtype=torch.bool)
        self.reset_rows()

    def reset_rows(self) -> None:
        self.past: list[KV] = self.model.empty_past(0)
        self.past_mask = torch.zeros(0, 0, dtype=torch.bool)  # (R, P)
        self.positions = torch.zeros(0, dtype=torch.long)  # (R,) position of the next token

    @torch.inference_mode()
    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        config = self.model.config
        ids, mask = pad_sources(src_ids, config.pad_id, config.eos_id)
        ids, self.src_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        self.cross = self.model.cross_kv(self.model.encode(ids, self.src_mask))
        self.reset_rows()

    @torch.inference_mode()
    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        sources = torch.from_numpy(np.asarray(source_index, dtype=np.int64))
        parents = torch.from_numpy(np.asarray(parent_rows, dtype=np.int64))
        is_new = parents < 0
        gather = parents.clamp(min=0)
        rows = len(parents)
        if len(self.positions) == 0:
            # Nothing cached yet: every row must be new; give them an empty past.
            past = self.model.empty_past(rows)
            past_mask = torch.zeros(rows, 0, dtype=torch.bool)
            positions = torch.zeros(rows, dtype=torch.long)
        else:
            past = [(key[gather], value[gather]) for key, value in self.past]
            past_mask = self.past_mask[gather] & ~is_new[:, None]
            positions = torch.where(is_new, 0, self.positions[gather])
        cross = [(key[sources], value[sources]) for key, value in self.cross]
        tgt = torch.from_numpy(np.asarray(tgt_ids, dtype=np.int64))[:, None]
        log_probs, self.past = self.model.decode_step(tgt, positions, past, past_mask, cross, self.src_mask[sources])
        self.past_mask = torch.cat([past_mask, torch.ones(rows, 1, dtype=torch.bool)], dim=1)
        self.positions = positions + 1
        return log_probs[:, 0].numpy()
