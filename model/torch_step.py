"""TorchStep: the Step protocol of model/search.py over the PyTorch decode_step with a KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nmt_serve.model.padding import pad_sources
from nmt_serve.model.transformer import KV, Transformer


class TorchStep:
    """Rows at different positions share one decode_step call; the cache follows `parent_rows`.

    The reference implementation that parity compares the ONNX Runtime step against. It runs
    where the model's weights are (CPU or GPU); inputs and log-probs are numpy, as Step says.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model.eval()
        self.device = model.embed.weight.device
        self.vocab_size = model.config.vocab_size
        self.cross: list[KV] = []
        self.src_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.reset_rows()

    def reset_rows(self) -> None:
        self.past: list[KV] = self.model.empty_past(0, self.device)
        self.past_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # (R, P)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # (R,) position of the next token

    def _tensor(self, values: object) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(self.device)

    @torch.inference_mode()
    def begin(self, src_ids: Sequence[Sequence[int]]) -> None:
        config = self.model.config
        ids, mask = pad_sources(src_ids, config.pad_id, config.eos_id)
        ids, self.src_mask = torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)
        self.cross = self.model.cross_kv(self.model.encode(ids, self.src_mask))
        self.reset_rows()

    @torch.inference_mode()
    def __call__(self, source_index: np.ndarray, parent_rows: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
        sources, parents = self._tensor(source_index), self._tensor(parent_rows)
        is_new = parents < 0
        gather = parents.clamp(min=0)
        rows = len(parents)
        if len(self.positions) == 0:
            # Nothing cached yet: every row must be new; give them an empty past.
            past = self.model.empty_past(rows, self.device)
            past_mask = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
            positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        else:
            past = [(key[gather], value[gather]) for key, value in self.past]
            past_mask = self.past_mask[gather] & ~is_new[:, None]
            positions = torch.where(is_new, 0, self.positions[gather])
        cross = [(key[sources], value[sources]) for key, value in self.cross]
        tgt = self._tensor(tgt_ids)[:, None]
        log_probs, self.past = self.model.decode_step(tgt, positions, past, past_mask, cross, self.src_mask[sources])
        self.past_mask = torch.cat([past_mask, torch.ones(rows, 1, dtype=torch.bool, device=self.device)], dim=1)
        self.positions = positions + 1
        return log_probs[:, 0].cpu().numpy()
