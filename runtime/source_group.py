"""Source buffers: the widths every buffer of encoded sources follows (the step cache's groups and the engine's pool),
and SourceGroup, one set of the buffers a decoder call's cross-attention reads its sources from.

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

try:  # built by nmt-build-kernels from runtime/kernels/cache_moves.c; without it the copies run in numpy
    from nmt_serve.runtime import _cache_moves as native_cache_moves
except ImportError:
    native_cache_moves = None

# Source buffers are not narrowed below this width (a narrower call saves little and would rebind often).
MIN_SOURCE_WIDTH = 16
# Every source width the decoder sees (the cross-attention's key length) is a multiple of this. ONNX Runtime's
# MultiHeadAttention sums a row's attention in an order that depends on the key length: measured, a row's
# log-probs moved by up to 7.6e-6 when another row's longer source widened the call by a few tokens, and by 0
# at every width that is a multiple of 8 (16 and 32 too). Masked positions add exact zeros, so a row's result
# no longer depends on the rows it is batched with: what int8 with per-row scales needs to be batch-invariant.
SOURCE_WIDTH_MULTIPLE = 16
# Sources of at most this many tokens (EOS included) sit in the narrow group, in buffers of the narrowest width any
# gets. Measured on the default model's int8 decoder (nmt-step-ablation --widths): each 16 unused columns of a 32-row
# call cost 14-24% of it.
NARROW_SOURCE_WIDTH = MIN_SOURCE_WIDTH
NARROW_PREFIX = "narrow_"
NO_SOURCE = -1  # a place's key when it holds no source


def source_width(tokens: int) -> int:
    """`tokens` rounded up to a multiple of SOURCE_WIDTH_MULTIPLE: the width a source buffer of them gets."""
    return -(-tokens // SOURCE_WIDTH_MULTIPLE) * SOURCE_WIDTH_MULTIPLE


def fitted_width(width_cap: int, needed: int, spare: int | None = None) -> int:
    """The width source buffers (and the engine's pool of encoded sources) should have for sources of at
    most `needed` tokens: grown to fit, narrowed to `needed` (not below MIN_SOURCE_WIDTH) once at least
    `spare` tokens of the width are unused (default: half of it), else kept as it is; always a multiple
    of SOURCE_WIDTH_MULTIPLE."""
    needed = source_width(needed)
    if needed > width_cap:
        return needed
    if width_cap > MIN_SOURCE_WIDTH and width_cap - needed >= (width_cap // 2 if spare is None else spare):
        return max(needed, MIN_SOURCE_WIDTH)
    return width_cap


def narrow_name(cross_name: str) -> str:
    """The decoder input of the narrow group that matches one of the encoder's cross K/V outputs."""
    return f"{NARROW_PREFIX}{cross_name}"


def copy_source(destinations: list[np.ndarray], origins: list[np.ndarray], place: int, row: int, width: int) -> None:
    """For each pair: origin[row]'s first `width` columns into destination[place] and the destination's columns past
    `width` zeroed (False in a mask). Arrays: (items, H, width, Dh) cross K/V or (items, width) masks, one item type a pair.

    One compiled call for a source's every layer and its mask where numpy takes two slice assignments a tensor (26 for
    the default model), each costing microseconds right after a decoder call has flushed the CPU caches."""
    if native_cache_moves is not None and all(array.flags.c_contiguous for array in (*destinations, *origins)):
        native_cache_moves.copy_sources(destinations, origins, place, row, width, True)
        return
    for destination, origin in zip(destinations, origins, strict=True):
        columns = (slice(None),) * (destination.ndim - 3)  # the heads' axis of a cross K/V tensor
        destination[(place, *columns, slice(width))] = origin[(row, *columns, slice(width))]
        destination[(place, *columns, slice(width, None))] = 0


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
    def __init__(self, tensors: int, n_heads: int, head_dim: int, initial_places: int, fixed_width: int | None = None) -> None:
        """fixed_width: every call binds the buffers this wide (the narrow group); None: as wide as `width_for` says."""
        self.n_heads, self.head_dim, self.initial_places, self.fixed_width = n_heads, head_dim, initial_places, fixed_width
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

    def width_for(self, longest: int | None) -> int:
        """The width for a call whose longest source in this group has `longest` tokens (None: no row reads the group).

        A group of fitted width narrows as soon as a whole SOURCE_WIDTH_MULTIPLE of the width is unused, not when half
        of it is: cross-attention reads every bound column, and in place each 16 unused ones cost 14-24% of a 32-row
        int8 call (nmt-step-ablation --widths, AMD EPYC with AVX-512 VNNI). Narrowing costs a copy of the live sources
        and a rebind. Measured there, interleaved: 32 greedy requests whose 2 or 8 long sources finish first, 1.15x-1.20x
        the tokens/s of narrowing at half the width; 8 with one, 1.04x; in an open loop at 70% and 90% of capacity, the
        same tokens/s and median latency, p99 0.112 / 0.183 s against 0.146 / 0.248 s.

        A group no row reads keeps its width (at least MIN_SOURCE_WIDTH): narrowing it saves no compute (it binds no
        place, or one dummy) and replacing its buffers drops every IO binding kept: in 15 s of open loop (270 requests/s
        of test sentences) the bindings were dropped 554 times when the wide group narrowed whenever its last long
        source left (and widened when the next came), 46 times with this rule."""
        if self.fixed_width is not None:
            return self.fixed_width
        if longest is None:
            return max(self.width, MIN_SOURCE_WIDTH)
        return fitted_width(self.width, longest, spare=SOURCE_WIDTH_MULTIPLE)

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

    def fill(self, source_keys: list[int], source_slots: list[int], pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray) -> int:
        """Copy into each place the source a layout gives it (its key and pool slot), unless it holds it already;
        returns how many were copied."""
        sources = len(source_keys)
        held = self.keys[:sources].tolist() if sources else []
        stale = [place for place, (key, holds) in enumerate(zip(source_keys, held, strict=True)) if key != holds]
        if stale:
            width = min(self.width, pool_mask.shape[1])  # every source of the group fits in both
            destinations, origins = [*self.cross, self.mask], [*pool_cross, pool_mask]
            for place in stale:
                copy_source(destinations, origins, place, source_slots[place], width)
                self.keys[place] = source_keys[place]
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
