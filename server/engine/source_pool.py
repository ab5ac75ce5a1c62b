"""SourcePool: the encoded sources of an engine's active requests (cross K/V and masks), one slot per request.

The step cache (runtime/step_cache.py) reads the pool up to each call's longest source. Slots are
reused once freed and double when full; the width grows with the longest source and narrows (as
the step cache's buffers do, `fitted_width`) once a long source has left, so later joins stop
copying at the old width. An engine gone idle keeps the buffers (up to `keep_bytes`) with every slot free: an idle
engine's next request would otherwise grow them again from nothing, a dozen allocations and copies that took about
1.7% of a batch-1 greedy request's time.
"""

from __future__ import annotations

import numpy as np

from nmt_serve.runtime.source_group import copy_source, fitted_width, grown
from nmt_serve.runtime.step_cache import KEEP_BYTES


class SourcePool:
    def __init__(self, layers: int, heads: int, head_dim: int, keep_bytes: int = KEEP_BYTES) -> None:
        """layers: cross K/V tensors per source (the encoder's outputs, K and V of every decoder layer); keep_bytes: the
        most memory `clear` keeps."""
        self._shape = (heads, head_dim)
        self._layers = layers
        self._keep_bytes = keep_bytes
        self.reset()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.cross) + self.src_mask.nbytes

    def clear(self) -> None:
        """No source is in use any more: every slot is free. The buffers stay unless they hold over `keep_bytes`."""
        if self.nbytes > self._keep_bytes:
            self.reset()
            return
        self._free_slots = list(range(self.src_mask.shape[0] - 1, -1, -1))  # popped lowest first

    def reset(self) -> None:
        """No source, no slot: the memory is given back."""
        heads, head_dim = self._shape
        self.cross = [np.zeros((0, heads, 1, head_dim), dtype=np.float32) for _ in range(self._layers)]  # (slots, H, S, Dh)
        self.src_mask = np.zeros((0, 1), dtype=bool)  # (slots, S)
        self._free_slots: list[int] = []

    @property
    def width(self) -> int:
        return self.src_mask.shape[1]

    def fit(self, longest: int) -> None:
        """Narrow to the longest source still in use (tokens, EOS included) when it is at most half the width.
        The step cache reads only the call's sources from here, so this width is memory, not compute: it
        narrows less eagerly than the step cache's own buffers (StepCache._fit_sources)."""
        width = fitted_width(self.width, longest)
        if width < self.width:
            self.cross = [np.ascontiguousarray(layer[:, :, :width]) for layer in self.cross]
            self.src_mask = np.ascontiguousarray(self.src_mask[:, :width])

    def store(self, cross: list[np.ndarray], mask: np.ndarray) -> list[int]:
        """Each source of an encoder call (cross: its outputs, (B, H, S, Dh) each; mask: (B, S)) in a free slot; their slots.

        Written straight into the slots (no padded copy of the encoder output first); a slot's tail past
        its source is zeroed and masked, as the step cache reads the pool up to the call's longest source.
        """
        count, width = mask.shape
        self._reserve(count - len(self._free_slots), width)
        slots = []
        destinations, origins = [*self.cross, self.src_mask], [*cross, mask]
        for row in range(count):
            slot = self._free_slots.pop()
            copy_source(destinations, origins, slot, row, width)
            slots.append(slot)
        return slots

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def _reserve(self, more: int, width: int) -> None:
        """Room for `more` sources beyond the free slots (the slots double) of `width` tokens (the pool widens)."""
        slots, pool_width = self.src_mask.shape
        if more <= 0 and width <= pool_width:
            return
        new_slots = slots + max(more, slots) if more > 0 else slots
        new_width = max(width, pool_width)
        self.cross = [grown(layer, (new_slots, layer.shape[1], new_width, layer.shape[3])) for layer in self.cross]
        self.src_mask = grown(self.src_mask, (new_slots, new_width))
        self._free_slots.extend(range(new_slots - 1, slots - 1, -1))  # popped lowest first
