"""StepCache: the rows of the next decoder-step call and their caches, in buffers ONNX Runtime updates in place.

Each row owns a slice of one preallocated buffer per self-attention cache tensor (slots
[0, position)); each source read by the call owns a slice of the cross K/V and source-mask
buffers of its group (the short sources' narrow buffers or the others', runtime/source_group.py),
however many rows (a beam) read it. The buffers are bound to the decoder with IO
binding, each present K/V to the same memory as its past, so a step appends one slot per row and
copies nothing. Between calls `arrange` lays out the next call's rows: a row that continues a
different row (a second beam from one parent, a new or moved row filling a hole) copies the slots
of that row it does not already hold (below); a source keeps its place while rows move, a source
new to its place copies its cross K/V from the caller's pool, and the rows are mapped to their
sources (the graph's source_queries / row_queries). Unchanged rows and
sources, the common case, cost nothing. `arrange` also names the rows the search wants
candidates for (the graph's in-graph TopK: beam rows, and greedy rows for their best two); `candidates` reads them
after `run`.

Slot lineage: every slot a call writes gets a number never used before, and a copied slot takes
its number along, so two slots with the same number hold the same K/V (the same computation,
copied). Beams of one request share the slots of their common prefix, so a row taking another
row's hypothesis copies only from the first slot whose numbers differ. On nmt-bench's beam 4
cells (default model, 32 forced tokens) one run moved 24,152 -> 7,195 slots at batch 32, 6,339 ->
1,333 at batch 8 and 782 -> 119 at batch 1 against copying each moved row's whole used length;
the engine's step profile reports slots copied per step.
Torch-free: the server imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from nmt_serve.model.config import ModelConfig
from nmt_serve.runtime.source_group import NARROW_PREFIX, NARROW_SOURCE_WIDTH, SourceGroup, grown, narrow_name
from nmt_serve.runtime.source_layout import MIN_QUERIES, SourceLayout, source_layout, source_layout_lists

try:  # built by nmt-build-kernels from runtime/kernels/cache_moves.c; without it the moves run in numpy
    from nmt_serve.runtime import _cache_moves as native_cache_moves
except ImportError:
    native_cache_moves = None
try:  # from runtime/kernels/greedy_step.c (the engine's steady greedy step); without it that step runs in Python
    from nmt_serve.runtime import _greedy_step as native_greedy_step
except ImportError:
    native_greedy_step = None
try:  # from runtime/kernels/beam_step.c (the engine's steady beam step); without it that step runs in Python
    from nmt_serve.runtime import _beam_step as native_beam_step
except ImportError:
    native_beam_step = None

INITIAL_ROWS = 8
MAX_CANDIDATES = 64  # per row: beam search asks for 2 x beam + 1 (beam <= 16, model/search.py)
INITIAL_LENGTH = 16
# An idle engine keeps buffers up to this size (the next burst skips growing them) and frees larger ones.
KEEP_BYTES = 64 << 20
# Without the compiled moves, moves of at most this many rows x slots copy every used slot (in numpy, cheaper than
# finding the slots a row already shares with its origin, for a beam or two; measured with nmt-bench's beam cells). The
# compiled moves find them as they copy.
SMALL_COPY_SLOTS = 64
# Up to this many rows a call's rows are laid out on Python lists: cheaper than the dozen numpy calls on arrays of a
# few items, each of which costs several microseconds right after a decoder call has flushed the CPU caches (the
# engine's bound for its own layout, measured there: server/engine/row_placement.py).
PYTHON_LAYOUT_ROWS = 32
MAX_BINDINGS = 64  # IO bindings kept, one per (rows, narrow places, wide places, queries) layout met since the buffers last moved


# The element types a decoder's past K/V may have, as ONNX Runtime names them.
CACHE_DTYPES = {"tensor(float)": np.float32, "tensor(int8)": np.int8}


def cache_dtype(session: ort.InferenceSession, past_names: Sequence[str]) -> type[np.generic]:
    """The one element type of the decoder's past K/V inputs; a type the cache cannot hold is refused by name."""
    types = {value.type for value in session.get_inputs() if value.name in past_names}
    if len(types) > 1 or not types <= CACHE_DTYPES.keys():
        raise ValueError(f"decoder past K/V inputs must all be one of {', '.join(CACHE_DTYPES)}; got {', '.join(sorted(types))}")
    return CACHE_DTYPES[types.pop()] if types else np.float32


@dataclass
class Binding:
    io_binding: ort.IOBinding
    layout: tuple[int, int, int, int]  # (rows, narrow places, wide places, queries)
    candidates: tuple[int, int] = (-1, -1)  # (candidate rows, candidates per row) bound


class StepCache:
    def __init__(self, session: ort.InferenceSession, config: ModelConfig, cross_names: Sequence[str]) -> None:
        """session: the decoder step; its present_* outputs are the K/V caches, each read from the past_* input named like it."""
        self.session = session
        self.n_heads, self.head_dim, self.vocab_size, self.max_positions = config.n_heads, config.head_dim, config.vocab_size, config.max_positions
        self.present_names = [output.name for output in session.get_outputs() if output.name.startswith("present_")]
        self.cross_names = list(cross_names)
        self.narrow_names = [narrow_name(name) for name in self.cross_names]
        self.past_names = [name.replace("present_", "past_", 1) for name in self.present_names]
        # float32, or int8 where the decoder keeps its self-attention cache quantized (export/int8_cache.py).
        self.cache_dtype = cache_dtype(session, self.past_names)
        # ONNX Runtime copies an input bound in CPU memory to the device its nodes run on when it is bound, not when
        # the session runs (IOBinding::BindInput). On the CPU the binding reads the live buffers at every run; on
        # CUDA a kept binding would feed every later step the tokens, positions and past K/V of the step it was
        # made for (measured: log-probs off by up to 16 from PyTorch's, 0 of 100 sentences decoded alike), so
        # there every run binds afresh. Outputs bound in CPU memory are copied into it at the end of each run.
        self.provider = session.get_providers()[0]  # where the decoder runs (the self-check's batch rule reads it too)
        self.binds_every_run = self.provider != "CPUExecutionProvider"
        # A source group no row reads binds no place on the CPU (its attention kernel returns an empty batch at once)
        # and one dummy place elsewhere, where an empty batch is not known to be accepted (runtime/source_group.py).
        self.dummy_places = self.provider != "CPUExecutionProvider"
        self.reset()

    def clear(self) -> None:
        """Drop every row; keep the buffers for the next rows unless they have grown past KEEP_BYTES."""
        held = self._kv_block.nbytes + self.narrow.nbytes + self.wide.nbytes
        if held > KEEP_BYTES:
            self.reset()
            return
        self.rows = self._longest = 0
        for group in (self.narrow, self.wide):  # pool slots are reused by new sources: their cross K/V must be copied again
            group.forget_sources()
        self._row_key_list = None

    def reset(self) -> None:
        """Drop every row and give the memory back."""
        self.rows = 0
        self._longest = 0  # the most tokens any live row has cached (a Python int: no numpy call per step)
        self._set_kv_block(np.zeros((len(self.past_names), 0, self.n_heads, 0, self.head_dim), dtype=self.cache_dtype))
        self._slot_ids = np.zeros((0, 0), dtype=np.int64)  # (row capacity, length capacity): slot lineage; 0 = unknown
        self._row_range = np.zeros(0, dtype=np.int64)
        self._next_slot_id = 1
        self.slots_copied = 0  # cache slots (each: every layer's K and V of one row and position) copied by moves, in all
        self.sources_copied = 0  # sources whose cross K/V were copied into a place, in all
        # The call's sources: those of at most NARROW_SOURCE_WIDTH tokens in the narrow group, the rest in the wide one
        # (runtime/source_group.py).
        self.narrow = SourceGroup(len(self.cross_names), self.n_heads, self.head_dim, INITIAL_ROWS, fixed_width=NARROW_SOURCE_WIDTH)
        self.wide = SourceGroup(len(self.cross_names), self.n_heads, self.head_dim, INITIAL_ROWS)
        self._positions = np.zeros(0, dtype=np.int64)  # per row: tokens cached = position of the token it is fed next
        self._tgt_ids = np.zeros((0, 1), dtype=np.int64)
        self._row_key_list: list[int] | None = None  # per row of the arranged call: its source key (unchanged keys: same layout)
        self._row_queries = np.zeros(0, dtype=np.int64)  # per row: its place in the flattened (narrow + wide places) x queries
        self._log_probs = np.zeros((0, self.vocab_size), dtype=np.float32)
        self._candidate_rows = np.zeros(0, dtype=np.int64)
        self._candidate_count = np.zeros(1, dtype=np.int64)
        self._candidate_log_probs = np.zeros(0, dtype=np.float32)  # flat: (n, count) views of the front
        self._candidate_ids = np.zeros(0, dtype=np.int64)
        self._candidate_views = self._candidate_log_probs.reshape(0, 0), self._candidate_ids.reshape(0, 0)
        self._bindings: dict[tuple[int, int, int, int], Binding] = {}  # by Binding.layout
        self._binding: Binding | None = None  # the arranged call's
        self._wanted = (0, 0)  # (candidate rows, candidates per row) of the arranged call
        self._view_row_buffers()
        self._view_candidates()

    def _view_row_buffers(self) -> None:
        """Memoryviews of the row buffers, for the steps of at most PYTHON_LAYOUT_ROWS rows: right after a decoder call has
        flushed the CPU caches the first numpy call costs ~20 us and a memoryview's item access about 1 us (measured on
        the default model's batch 1 greedy step)."""
        self._position_items = memoryview(self._positions)
        self._slot_id_items = memoryview(self._slot_ids)
        self._tgt_id_items = memoryview(self._tgt_ids.reshape(-1))
        self._row_query_items = memoryview(self._row_queries)
        self._log_probs_view, self._log_probs_view_rows = self._log_probs[:0], 0  # what `run` returns, made when rows change

    def _view_candidates(self) -> None:
        self._candidate_value_items = memoryview(self._candidate_log_probs)
        self._candidate_id_items = memoryview(self._candidate_ids)
        self._candidate_row_items = memoryview(self._candidate_rows)
        self._candidate_item_views = self._candidate_item_views_of(*self._wanted)

    def _candidate_item_views_of(self, wanted: int, count: int) -> tuple[memoryview, memoryview]:
        """`candidates` as 2-D memoryviews of the same memory."""
        size = wanted * count
        if not size:  # memoryview casts no empty shape; nothing reads them then
            return self._candidate_value_items[:0], self._candidate_id_items[:0]
        return (self._candidate_value_items[:size].cast("B").cast("f", [wanted, count]),
                self._candidate_id_items[:size].cast("B").cast(self._candidate_id_items.format, [wanted, count]))  # fmt: skip

    @property
    def capacity(self) -> tuple[int, int, int]:
        """(rows, cached tokens per row, source tokens per row of the wide group) the buffers hold now."""
        return self._positions.shape[0], self._kv_block.shape[3], self.wide.width

    @property
    def sources(self) -> int:
        """The sources the arranged call reads."""
        return self.narrow.sources + self.wide.sources

    @property
    def positions(self) -> np.ndarray:
        """Per live row: how many tokens it has cached (after `run`, including the one just fed)."""
        return self._positions[: self.rows]

    def padding_ratio(self) -> float:
        """Share of source slots the last call's cross-attention masked out (self-attention has none)."""
        narrow_padded, narrow_total = self.narrow.padded_and_total()
        wide_padded, wide_total = self.wide.padded_and_total()
        total = narrow_total + wide_total
        return (narrow_padded + wide_padded) / total if total else 0.0

    def arrange(self, parents: np.ndarray | list[int], tgt_ids: np.ndarray | list[int], source_keys: np.ndarray | list[int],
                source_slots: np.ndarray | list[int], pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray,
                candidate_rows: np.ndarray | list[int] | None = None, candidate_count: int = 0) -> None:  # fmt: skip
        """Lay out the next call: row j feeds tgt_ids[j] and continues row parents[j] of the last call
        (-1: a new row at position 0); its source is pool slot source_slots[j], which holds the source
        named source_keys[j] (a key unique while the source is in use: a reused slot gets a new key).
        pool_cross: encoder K/V per layer (slots, H, S, Dh); pool_mask (slots, S).
        candidate_rows: rows (of this call) whose best `candidate_count` log-probs `candidates` returns.
        Arrays or lists; a caller with at most PYTHON_LAYOUT_ROWS rows passes lists, laid out without a numpy call
        in the common case (the same sources as the last call).
        """
        rows = len(parents)
        if rows <= PYTHON_LAYOUT_ROWS:
            self._arrange_few_rows(parents if isinstance(parents, list) else np.asarray(parents, dtype=np.int64).tolist())
        else:
            parents = np.asarray(parents, dtype=np.int64)
            in_place = np.arange(rows)
            if rows == self.rows and bool((parents == in_place).all()):  # every row continues itself
                self._reserve(rows, self._longest + 1)
            else:
                self._arrange_rows(parents, in_place)
        key_list = source_keys if isinstance(source_keys, list) else np.asarray(source_keys, dtype=np.int64).tolist()
        if key_list != self._row_key_list:
            if rows <= PYTHON_LAYOUT_ROWS:
                slot_list = source_slots if isinstance(source_slots, list) else np.asarray(source_slots, dtype=np.int64).tolist()
                self._arrange_few_sources(list(key_list), slot_list, pool_cross, pool_mask)
            else:
                keys, slots = np.asarray(source_keys, dtype=np.int64), np.asarray(source_slots, dtype=np.int64)
                self._arrange_sources(keys, slots, pool_cross, pool_mask)
        if isinstance(tgt_ids, list) and rows <= PYTHON_LAYOUT_ROWS:
            items = self._tgt_id_items
            for row, token in enumerate(tgt_ids):
                items[row] = token
        else:
            self._tgt_ids[:rows, 0] = tgt_ids
        self.rows = rows
        self._arrange_candidates(candidate_rows, candidate_count)

    def want_candidates(self, candidate_rows: np.ndarray | None, candidate_count: int) -> None:
        """Name the rows whose best `candidate_count` log-probs the next `run` returns (`candidates`), as `arrange` does,
        for a call laid out by `continue_in_place`."""
        self._arrange_candidates(candidate_rows, candidate_count)

    def continue_in_place(self, tgt_ids: np.ndarray | list[int]) -> None:
        """Lay out the next call as the last one with new tokens: every row continues in its own place and
        the sources and candidate rows are the same (greedy requests between joins and leaves). `arrange`
        with the same rows, sources and candidates does the same; this skips its checks (numpy calls that
        each cost several microseconds right after a decoder call has flushed the CPU caches)."""
        self._reserve(self.rows, self._longest + 1)
        if isinstance(tgt_ids, list) and self.rows <= PYTHON_LAYOUT_ROWS:
            items = self._tgt_id_items
            for row, token in enumerate(tgt_ids):
                items[row] = token
        else:
            self._tgt_ids[: self.rows, 0] = tgt_ids

    def _arrange_rows(self, parents: np.ndarray, in_place: np.ndarray) -> None:
        """Positions of the next call's rows; a row continuing another row takes its slots (`_copy_rows`)."""
        rows = len(parents)
        is_new = parents < 0
        continued = np.maximum(parents, 0)
        positions = np.where(is_new, 0, self._positions[continued]) if self.rows else np.zeros(rows, dtype=np.int64)
        self._longest = int(positions.max(initial=0))
        self._reserve(rows, self._longest + 1)
        moved = ~is_new & (parents != in_place)
        if moved.any():
            self._copy_rows(np.flatnonzero(moved).tolist(), parents[moved].tolist(), positions[moved].tolist())
        self._positions[:rows] = positions

    def _arrange_few_rows(self, parents: list[int]) -> None:
        """`_arrange_rows` on lists, for at most PYTHON_LAYOUT_ROWS rows."""
        rows = len(parents)
        if rows and rows == self.rows and parents == list(range(rows)):  # every row continues itself
            self._reserve(rows, self._longest + 1)
            return
        cached = self._position_items[: self.rows].tolist()
        positions = [cached[parent] if parent >= 0 else 0 for parent in parents] if self.rows else [0] * rows
        self._longest = max(positions, default=0)
        self._reserve(rows, self._longest + 1)
        moved = [row for row, parent in enumerate(parents) if parent >= 0 and parent != row]
        if moved:
            self._copy_rows(moved, [parents[row] for row in moved], [positions[row] for row in moved])
        items = self._position_items
        for row, position in enumerate(positions):
            items[row] = position

    def _copy_rows(self, destination: list[int], origin: list[int], lengths: list[int]) -> None:
        """Each destination row takes its origin row's `lengths` cached slots, from the first slot whose lineage differs."""
        ids, block = self._slot_ids, self._kv_block
        # Slots past an origin's length keep the destination's own data and numbers: both stay true.
        # The engine moves a row only into a place whose row has no continuation (or a new place), so it
        # never writes a row that another copy reads and copies can go straight across; other callers (a
        # swap, say) get every origin read first.
        across = set(destination).isdisjoint(origin)
        if across and native_cache_moves is not None and block.flags.c_contiguous:
            # A memcpy per (tensor, head) block of a move, from the first slot it finds differing: no numpy call.
            self.slots_copied += native_cache_moves.copy_rows(block, ids, destination, origin, None, lengths)
            return
        used = max(lengths)
        if len(lengths) * used <= SMALL_COPY_SLOTS:  # a beam or two: finding the shared slots costs more than copying them
            firsts = [0] * len(lengths)
        else:
            numbers = ids[origin, :used]
            differs = (ids[destination, :used] != numbers) | (numbers == 0)  # 0: never proven equal
            firsts = np.where(differs.any(axis=1), differs.argmax(axis=1), used).tolist()
        copies = [(row, from_row, start, end) for row, from_row, start, end
                  in zip(destination, origin, firsts, lengths, strict=True) if start < end]  # fmt: skip
        if across:
            for row, from_row, start, end in copies:
                block[:, row, :, start:end] = block[:, from_row, :, start:end]  # every layer's K and V in one statement
                ids[row, start:end] = ids[from_row, start:end]
        else:
            read = [(block[:, from_row, :, start:end].copy(), ids[from_row, start:end].copy()) for _, from_row, start, end in copies]
            for (row, _, start, end), (values, numbers) in zip(copies, read, strict=True):
                block[:, row, :, start:end] = values
                ids[row, start:end] = numbers
        self.slots_copied += sum(end - start for _, _, start, end in copies)

    def _arrange_sources(self, keys: np.ndarray, slots: np.ndarray, pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray) -> None:
        """Give each source read by the call a place in its group and map rows to sources (runtime/source_layout.py): a
        source keeps the place it had, so its K/V are copied only into a place new to it. Sources of at most
        NARROW_SOURCE_WIDTH tokens go to the narrow group, the rest to the wide one, whose width follows the call's
        longest source down as well as up (`SourceGroup.width_for`)."""
        # Masks are True from a source's first token to its end: a source is longer than NARROW_SOURCE_WIDTH tokens
        # exactly when its mask holds the next column, one column read per row rather than the whole width.
        if pool_mask.shape[1] > NARROW_SOURCE_WIDTH:
            is_wide = pool_mask[slots, NARROW_SOURCE_WIDTH]
        else:
            is_wide = np.zeros(len(slots), dtype=bool)
        wide_rows = np.flatnonzero(is_wide)
        longest_wide = int(pool_mask[slots[wide_rows]].sum(axis=1).max()) if len(wide_rows) else None
        grouped = [(self.narrow, np.flatnonzero(~is_wide), None), (self.wide, wide_rows, longest_wide)]
        layouts = [source_layout(keys[rows], slots[rows], group.keys[: group.sources]) for group, rows, _ in grouped]
        # Both groups' places have as many queries: the graph concatenates their results before the rows gather theirs.
        queries = max(MIN_QUERIES, *(layout.source_queries.shape[1] for layout in layouts)) if len(keys) else 0
        offset = 0
        dummy = self.dummy_places and len(keys) > 0
        for (group, rows, longest), layout in zip(grouped, layouts, strict=True):
            self._fill_group(group, longest, layout.source_keys.tolist(), layout.source_slots.tolist(),
                             self._group_queries(layout, rows, queries, dummy), pool_cross, pool_mask, dummy)  # fmt: skip
            local_queries = max(layout.source_queries.shape[1], 1)
            place, rank = np.divmod(layout.row_queries, local_queries)
            self._row_queries[rows] = (offset + place) * queries + rank
            offset += group.bound
        self._row_key_list = keys.tolist()

    def _fill_group(self, group: SourceGroup, longest: int | None, source_keys: list[int], source_slots: list[int],
                    source_queries: np.ndarray, pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray, dummy: bool) -> None:
        """One group's part of a source layout, whichever form made it: buffers fitted to its places and longest source,
        the new sources copied in, its queries bound, and a dummy place where no row reads it and the provider needs one;
        bindings forgotten where a buffer moved."""
        places = len(source_keys)
        if group.fit(max(places, int(dummy)), group.width_for(longest)):
            self._forget_bindings()
        self.sources_copied += group.fill(source_keys, source_slots, pool_cross, pool_mask)
        if group.bind_queries(source_queries):
            self._forget_bindings()
        if not places and dummy:
            group.dummy_place()

    def _arrange_few_sources(self, keys: list[int], slots: list[int], pool_cross: Sequence[np.ndarray], pool_mask: np.ndarray) -> None:
        """`_arrange_sources` on lists, for at most PYTHON_LAYOUT_ROWS rows: the same places, copies and queries, with a
        few numpy calls where it made about forty (a new request's first step at batch 1 spent 1.5%-2% of the
        request's time in them: each costs microseconds right after a decoder call has flushed the CPU caches)."""
        check_wide = pool_mask.shape[1] > NARROW_SOURCE_WIDTH  # see `_arrange_sources`: one mask column tells
        narrow_rows: list[int] = []
        wide_rows: list[int] = []
        for row, slot in enumerate(slots):
            (wide_rows if check_wide and pool_mask[slot, NARROW_SOURCE_WIDTH] else narrow_rows).append(row)
        wide_slots = {slots[row] for row in wide_rows}
        longest_wide = max(int(np.count_nonzero(pool_mask[slot])) for slot in wide_slots) if wide_slots else None
        grouped = [(self.narrow, narrow_rows, None), (self.wide, wide_rows, longest_wide)]
        layouts = [source_layout_lists([keys[row] for row in rows], [slots[row] for row in rows],
                                       group.keys[: group.sources].tolist() if group.sources else [])
                   for group, rows, _ in grouped]  # fmt: skip
        queries = max(MIN_QUERIES, *(layout.queries for layout in layouts)) if keys else 0
        offset = 0
        dummy = self.dummy_places and len(keys) > 0
        row_queries = self._row_query_items
        for (group, rows, longest), layout in zip(grouped, layouts, strict=True):
            # As `_group_queries`: the rows of the call reading each place, a place read by fewer repeating its first.
            by_call = [[rows[row] for row in readers] + [rows[readers[0]]] * (queries - len(readers)) for readers in layout.source_queries]
            by_call = by_call or [[0] * queries] * int(dummy)  # no row reads the group: no place, or the one dummy place
            source_queries = np.array(by_call, dtype=np.int64).reshape(len(by_call), queries)
            self._fill_group(group, longest, layout.source_keys, layout.source_slots, source_queries, pool_cross, pool_mask, dummy)
            local_queries = max(layout.queries, 1)
            for row, flat in zip(rows, layout.row_queries, strict=True):
                place, rank = divmod(flat, local_queries)
                row_queries[row] = (offset + place) * queries + rank
            offset += group.bound
        self._row_key_list = keys

    @staticmethod
    def _group_queries(layout: SourceLayout, rows: np.ndarray, queries: int, dummy: bool) -> np.ndarray:
        """The layout's source_queries as rows of the whole call, widened to `queries` per place (a place read by
        fewer rows repeats its first); a group no row reads gets none, or one dummy place read by row 0."""
        local = layout.source_queries
        if not local.size:
            return np.zeros((int(dummy), queries), dtype=np.int64)
        by_call = rows[local]
        if by_call.shape[1] == queries:
            return by_call
        return np.concatenate([by_call, np.repeat(by_call[:, :1], queries - by_call.shape[1], axis=1)], axis=1)

    def _arrange_candidates(self, candidate_rows: np.ndarray | list[int] | None, count: int) -> None:
        wanted = 0 if candidate_rows is None or count <= 0 else len(candidate_rows)
        if wanted and not 0 < count <= min(MAX_CANDIDATES, self.vocab_size):
            raise ValueError(f"candidate_count must be between 1 and {min(MAX_CANDIDATES, self.vocab_size)}, got {count}")
        count = count if wanted else 0
        grown = wanted > len(self._candidate_rows)
        if grown:  # grows with the row buffers' capacity, never per step
            size = max(wanted, self._positions.shape[0])
            self._candidate_rows = np.zeros(size, dtype=np.int64)
            self._candidate_log_probs = np.zeros(size * MAX_CANDIDATES, dtype=np.float32)
            self._candidate_ids = np.zeros(size * MAX_CANDIDATES, dtype=np.int64)
            self._view_candidates()
            self._forget_bindings()
        if wanted and isinstance(candidate_rows, list) and wanted <= PYTHON_LAYOUT_ROWS:
            items = self._candidate_row_items
            for place, row in enumerate(candidate_rows):
                items[place] = row
        elif wanted:
            self._candidate_rows[:wanted] = candidate_rows
        if grown or self._wanted != (wanted, count):
            self._candidate_count[0] = count
            self._wanted = (wanted, count)
            size = wanted * count  # the views `candidates` returns, made when they change rather than at every step
            self._candidate_views = (self._candidate_log_probs[:size].reshape(wanted, count),
                                     self._candidate_ids[:size].reshape(wanted, count))  # fmt: skip
            self._candidate_item_views = self._candidate_item_views_of(wanted, count)

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """After `run`: (log-probs, token ids), each (len(candidate_rows), candidate_count), best first per row."""
        return self._candidate_views

    def candidate_items(self) -> tuple[memoryview, memoryview]:
        """`candidates` as 2-D memoryviews: a request's rows sliced from them cost no numpy call."""
        return self._candidate_item_views

    def first_candidates(self, rows: int) -> tuple[list[float], list[int], int]:
        """After `run`: the first `rows` candidate rows' log-probs and token ids as flat lists, and the candidates per
        row (the stride): what `candidates` holds, read without a numpy call."""
        size = rows * self._wanted[1]
        return self._candidate_value_items[:size].tolist(), self._candidate_id_items[:size].tolist(), self._wanted[1]

    def run(self) -> np.ndarray:
        """One decoder call over the arranged rows; log_probs (rows, V), valid until the next call."""
        layout = (self.rows, self.narrow.bound, self.wide.bound, self.wide.queries.shape[1])
        if self.binds_every_run:
            self._forget_bindings()
        if self._binding is None or self._binding.layout != layout:
            self._binding = self._bindings.get(layout) or self._bind(layout)
        if self._binding.candidates != self._wanted:
            self._bind_candidates(self._binding)
        rows, first_id = self.rows, self._next_slot_id
        # Numbered before the run: a failed run may have written the slots, and new numbers match nothing.
        few = rows <= PYTHON_LAYOUT_ROWS
        if few:  # a few rows: a store per row rather than five numpy calls
            ids, positions = self._slot_id_items, self._position_items
            for row in range(rows):
                ids[row, positions[row]] = first_id + row
        else:
            self._slot_ids[self._row_range[:rows], self._positions[:rows]] = self._row_range[:rows] + first_id
        self._next_slot_id += rows
        self.session.run_with_iobinding(self._binding.io_binding)
        if few:
            positions = self._position_items
            for row in range(rows):
                positions[row] += 1
        else:
            self._positions[:rows] += 1
        self._longest += 1
        if self._log_probs_view_rows != rows:
            self._log_probs_view, self._log_probs_view_rows = self._log_probs[:rows], rows
        return self._log_probs_view

    def _start_compiled_step(self) -> tuple[Binding, int] | None:
        """What both compiled steady steps need of the arranged call: its kept binding, which binds the wanted candidates
        of every row, and room for one more slot in each row's cache; then the first number of the call's slots, taken
        here as `run` takes them before its run (a failed run may have written the slots, and numbers never used again
        match nothing). None where the call cannot be repeated so (a device binds at every run)."""
        rows, binding = self.rows, self._binding
        if binding is None or self.binds_every_run or binding.candidates != self._wanted or self._wanted[0] != rows:
            return None
        if self._longest + 1 > self._kv_block.shape[3]:
            return None
        first_id = self._next_slot_id
        self._next_slot_id += rows
        return binding, first_id

    def start_greedy_step(self) -> tuple[object, ...] | None:
        """Start a compiled steady greedy step (runtime/kernels/greedy_step.c): the last call again with new tokens, as
        `continue_in_place` and `run` would make it. Returns what the step needs: the decoder's bound run and its binding,
        the fed tokens, the positions, the slot lineage and the first number of the call's slots, the candidate
        log-probs and ids and the candidates per row; the numbers are taken here, as `run` takes them before its run (a
        failed run may have written the slots, and numbers never used again match nothing). None where the call cannot
        be repeated so: its binding is not kept (a device binds at every run) or binds other candidates, a row's cache
        is full (`continue_in_place` grows it), or the candidate rows are not the call's rows."""
        started = self._start_compiled_step()
        if started is None:
            return None
        binding, first_id = started
        return (self.session.run_with_iobinding, binding.io_binding, self._tgt_ids, self._positions, self._slot_ids,
                first_id, self._candidate_log_probs, self._candidate_ids, self._wanted[1])  # fmt: skip

    def stepped_in_place(self) -> None:
        """A compiled steady greedy step ran the call (`start_greedy_step`): each row is one token longer."""
        self._longest += 1

    def start_beam_step(self) -> tuple[object, ...] | None:
        """Start a compiled steady beam step (runtime/kernels/beam_step.c): the last call's rows, sources and candidate
        rows, each row continuing a row of its own request, as `arrange` and `run` would lay it out and run it. Returns
        what the step needs: the decoder's bound run and its binding, the cache block and slot lineage, the fed tokens,
        the positions, the first number of the call's slots (taken here, as `run` takes them before its run), the
        candidate rows, log-probs and ids and the candidates per row. None where the call cannot be made so: its binding
        is not kept or binds other candidates, not every row is a candidate row, a row's cache is full (`arrange` grows
        it), or the cache block is not one C-ordered array."""
        started = self._start_compiled_step() if self._kv_block.flags.c_contiguous else None
        if started is None:
            return None
        binding, first_id = started
        return (self.session.run_with_iobinding, binding.io_binding, self._kv_block, self._slot_ids, self._tgt_ids, self._positions,
                first_id, self._candidate_rows, self._candidate_log_probs, self._candidate_ids, self._wanted[1])  # fmt: skip

    def stepped_beam(self, slots_copied: int) -> None:
        """A compiled steady beam step ran the call (`start_beam_step`), its moves copying `slots_copied` slots: every row
        is one token longer (a beam's rows all have its length, so the longest row is the longest before, plus one)."""
        self._longest += 1
        self.slots_copied += slots_copied

    def row_cache(self, row: int) -> list[np.ndarray]:
        """The cached self-attention K/V of one row, per past name, each (H, tokens, Dh): for parity checks."""
        return [buffer[row, :, : self._positions[row]] for buffer in self._self_kv]

    # ------------------------------------------------------------ buffers

    def _set_kv_block(self, block: np.ndarray) -> None:
        """All self-attention caches in one array (tensor, row capacity, H, length capacity, Dh), so a row move
        is one copy for every tensor; `_self_kv` holds each tensor's (contiguous) view, bound to the graph."""
        self._kv_block = block
        self._self_kv = list(block)

    def _reserve(self, rows: int, length: int) -> None:
        """Grow the row buffers (doubling) so `rows` rows of `length` cached tokens fit."""
        if length > self.max_positions:
            raise ValueError(f"a row would cache {length} tokens; the position table has {self.max_positions}")
        row_cap, length_cap, _ = self.capacity
        if rows <= row_cap and length <= length_cap:
            return
        new_rows = max(rows, row_cap * 2 if rows > row_cap else row_cap, INITIAL_ROWS)
        new_length = min(max(length, length_cap * 2 if length > length_cap else length_cap, INITIAL_LENGTH), self.max_positions)
        tensors, live = len(self.past_names), self.rows  # the live rows' caches are carried over, not the idle ones
        self._set_kv_block(grown(self._kv_block, (tensors, new_rows, self.n_heads, new_length, self.head_dim), kept=(tensors, live)))
        self._slot_ids = grown(self._slot_ids, (new_rows, new_length), kept=(live,))  # rows not carried over: 0, unknown
        self._row_range = np.arange(new_rows)
        self._positions = grown(self._positions, (new_rows,))
        self._tgt_ids = np.zeros((new_rows, 1), dtype=np.int64)
        # The rows' places among the sources are carried over: continue_in_place (a steady greedy step that grows
        # the cache) lays no sources out, and zeros would send every row to the first row's source.
        self._row_queries = grown(self._row_queries, (new_rows,), kept=(live,))
        self._row_key_list = None  # `arrange` lays the sources out again
        self._log_probs = np.zeros((new_rows, self.vocab_size), dtype=np.float32)
        self._view_row_buffers()
        self._forget_bindings()  # new memory: bind again

    def _forget_bindings(self) -> None:
        self._bindings.clear()
        self._binding = None

    def _bind(self, layout: tuple[int, int, int]) -> Binding:
        """Point the session at views of the first `rows` rows; presents share their past's memory.

        Every view starts at its buffer's first byte, so the binding of a layout stays valid until a
        buffer is replaced (`_forget_bindings`): rows and sources coming and going reuse the bindings
        of the layouts they return to (binding ~26 tensors costs ~180 us, paid at each join and leave).
        """
        rows = self.rows
        binding = self.session.io_binding()

        def bind(name: str, array: np.ndarray, output: bool = False) -> None:
            bind_to = binding.bind_output if output else binding.bind_input
            bind_to(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)

        bind("tgt_ids", self._tgt_ids[:rows])
        bind("positions", self._positions[:rows])
        for group, prefix, cross_names in ((self.narrow, NARROW_PREFIX, self.narrow_names), (self.wide, "", self.cross_names)):
            bind(f"{prefix}src_mask", group.mask[: group.bound])
            bind(f"{prefix}source_queries", group.queries)
            for name, buffer in zip(cross_names, group.cross, strict=True):
                bind(name, buffer[: group.bound])
        bind("row_queries", self._row_queries[:rows])
        for past, present, buffer in zip(self.past_names, self.present_names, self._self_kv, strict=True):
            bind(past, buffer[:rows])
            bind(present, buffer[:rows], output=True)
        bind("log_probs", self._log_probs[:rows], output=True)
        if len(self._bindings) >= MAX_BINDINGS:
            self._bindings.clear()
        self._bindings[layout] = Binding(binding, layout)
        return self._bindings[layout]

    def _bind_candidates(self, bound: Binding) -> None:
        """Rebind only the candidate tensors (their shapes change with the beam rows, the rest does not)."""
        binding = bound.io_binding
        wanted, count = self._wanted
        values, ids = self.candidates()
        binding.bind_input("candidate_rows", "cpu", 0, np.int64, [wanted], self._candidate_rows.ctypes.data)
        binding.bind_input("candidate_count", "cpu", 0, np.int64, [1], self._candidate_count.ctypes.data)
        binding.bind_output("candidate_log_probs", "cpu", 0, np.float32, list(values.shape), values.ctypes.data)
        binding.bind_output("candidate_ids", "cpu", 0, np.int64, list(ids.shape), ids.ctypes.data)
        bound.candidates = self._wanted
