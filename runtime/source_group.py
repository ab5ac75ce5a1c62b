"""SourceGroup: one set of the buffers a decoder call's cross-attention reads its sources from.

The decoder reads its sources in two groups (export/decoder_graph.py): the sources of at most
NARROW_SOURCE_WIDTH tokens from buffers that many columns wide, the others from buffers as wide as
the longest of them. Cross-attention reads every bound column, and most sentences are short: on
nmt-bench's test sentences 72% have at most 16 tokens, and one long source in a call would otherwise
widen the cross-attention of every row to its width.

A group holds per place (one source each): the cross K/V of every decoder layer, the source mask,
the key of the source the place holds (its K/V are copied only into a place new to it) and the rows
reading it (`queries`). A group no row reads binds no place on the CPU, where MultiHeadAttention
returns an empty batch at once; elsewhere (StepCache.dummy_places) it binds one dummy place whose
unmasked columns hold whatever the place held, read by row 0, its result never gathered, so that no
attention kernel meets an empty batch it may not accept.
Torch-free: the server imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nmt_serve.runtime.source_layout import SourceLayout

# Sources of at most this many tokens (EOS included) sit in the narrow group. Measured on the default model's int8
# decoder (nmt-step-ablation --widths): each 16 unused columns of a 32-row call cost 14-24% of it. A multiple of
# step_cache.SOURCE_WIDTH_MULTIPLE, as every bound width: a row's result must not depend on the group it sits in.
NARROW_SOURCE_WIDTH = 16
NARROW_PREFIX = "narrow_"
NO_SOURCE = -1  # a place's key when it holds no source


def narrow_name(cross_name: str) -> str:
    """The decoder input of the narrow group that matches one of the encoder's cross K/V outputs."""
    return f"{NARROW_PREFIX}{cross_name}"


def grown(array: np.ndarray, shape: tuple[int, ...], fill: int = 0, kept: tuple[int, ...] = ()) -> np.ndarray:
    """`array` in another `shape` (larger, or narrower on an axis whose tail is not needed), `fill`
    elsewhere (zeros, not empty memory: masked source slots are multiplied by 0, and 0 * NaN from
    stale memory is NaN). `kept` limits what is carried over on the first axes (say, the live rows);
    the other axes carry all of `array` that fits."""
    new = np.zeros(shape, dtype=array.dtype) if fill == 0 else np.full(shape, fill, dtype=array.dtype)
    region = tuple(slice(min(extent, size)) for extent, size in zip((*kept, *array.shape[len(kept) :]), shape, strict=True))
    new[region] = array[region]
    return new


class SourceGroup:
    def __init__(self, tensors: int, n_heads: int, head_dim: int, initial_places: int) -> None:
        self.n_heads, self.head_dim, self.initial_places = n_heads, head_dim, initial_places
        self.cross = [np.zeros((0, n_heads, 0, head_dim), dtype=np.float32) for _ in range(tensors)]  # (places, H, width, Dh) each
        self.mask = np.zeros((0, 0), dtype=bool)
        self.keys = np.zeros(0, dtype=np.int64)  # per place: the key of the source it holds, NO_SOURCE for none
        self._query_buffer = np.zeros(0, dtype=np.int64)  # `queries` lives at its front
        self.queries = self._query_buffer.reshape(0, 0)  # (bound places, queries per place): the rows reading each place
        self.sources = 0  # places holding a source the call reads
        self.bound = 0  # places the call binds: the sources, or the dummy

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.cross)

    def forget_sources(self) -> None:
        """No place holds a source any more (the caller's pool slots are about to be reused)."""
        self.keys[:] = NO_SOURCE
        self.sources = self.bound = 0

    def fit(self, places: int, width: int) -> bool:
        """Buffers for `places` places (doubling when too few) exactly `width` columns wide. A place whose source is
        cut by a narrower width forgets it (it is copied again if a later call reads it). True: new buffers."""
        place_cap, width_cap = self.mask.shape
        if places <= place_cap and width == width_cap:
            return False
        new_places = max(places, place_cap * 2 if places > place_cap else place_cap, self.initial_places)
        cut = self.mask.sum(axis=1) > width
        self.cross = [grown(buffer, (new_places, self.n_heads, width, self.head_dim)) for buffer in self.cross]
        self.mask = grown(self.mask, (new_places, width))
        self.keys = grown(self.keys, (new_places,), fill=NO_SOURCE)
        self.keys[: len(cut)][cut] = NO_SOURCE
        return True

    def fill(self, layout: SourceLayout, pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray) -> int:
        """Copy into each place the source the layout gives it, unless it holds it already; returns how many were copied."""
        sources = len(layout.source_keys)
        width = min(self.width, pool_mask.shape[1])  # every source of the group fits in both
        stale = np.flatnonzero(self.keys[:sources] != layout.source_keys)
        for place, slot in zip(stale.tolist(), layout.source_slots[stale].tolist(), strict=True):
            for buffer, pool in zip(self.cross, pool_cross, strict=True):  # basic indexing: no temporary copy
                buffer[place, :, :width] = pool[slot, :, :width]
            self.mask[place, :width] = pool_mask[slot, :width]
            self.mask[place, width:] = False
        if stale.size:
            self.keys[stale] = layout.source_keys[stale]
        self.sources = sources
        return len(stale)

    def bind_queries(self, source_queries: np.ndarray) -> bool:
        """The rows reading each bound place, (bound places, queries); True when the array moved (bind again)."""
        shape = source_queries.shape
        moved = False
        if self.queries.shape != shape:  # a new shape, at the same address unless the buffer is too small
            if source_queries.size > len(self._query_buffer):
                self._query_buffer = np.zeros(max(source_queries.size, 2 * len(self._query_buffer)), dtype=np.int64)
                moved = True
            self.queries = self._query_buffer[: source_queries.size].reshape(shape)
        self.queries[:] = source_queries
        self.bound = shape[0]
        return moved

    def dummy_place(self) -> None:
        """Make place 0 safe to read with no source of the call in it: at least one unmasked column."""
        if not self.mask[0].any():
            self.mask[0, 0] = True

    def padded_and_total(self) -> tuple[int, int]:
        """Masked and all columns of the places holding the call's sources."""
        mask = self.mask[: self.sources]
        return int(mask.size - np.count_nonzero(mask)), int(mask.size)
