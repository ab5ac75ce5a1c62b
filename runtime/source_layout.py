"""Where each source of a decoder call sits, and which rows read it: the layout StepCache gives the graph.

Given the next call's per-row source keys and the keys the source places hold now, a source
keeps the place it has (its cross K/V are not copied again); new sources, and sources whose place
is past the new source count, take the places left, lowest first, in key order. The rows reading
each source, in row order, are its queries (`source_queries`, a source with fewer rows than the
most repeats its first row), and `row_queries` says where each row's result is in the flattened
(sources x queries) output.

Two implementations with equal results (a property test holds them equal): plain Python for
small calls (on lists, `source_layout_lists`, for a caller that keeps a few rows on lists), where
each of the numpy version's ~15 calls costs several microseconds right after a decoder run has
flushed the CPU caches, and numpy for large ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

# Up to this many rows the Python version runs: 2x-4x faster at 1-16 rows, level at 32 rows of 32 sources
# (warm caches, where numpy fares best; 13-34 us against 55-60 us at 1-32 rows of beams of 4).
PYTHON_LAYOUT_ROWS = 32
# Every source has at least this many queries (a source read by one row repeats it). Cross-attention
# multiplies each source's queries by its keys in one MatMul, and ONNX Runtime's CPU MatMul takes another
# kernel for a single row than for two or more, rounding differently (measured: 5.7e-6 apart on the same
# row): with one query a greedy row alone would differ from the same row beside a beam. From 2 rows up a
# row's product is the same whatever the row count, so the result no longer depends on the batch.
MIN_QUERIES = 2


@dataclass(frozen=True)
class SourceLayout:
    source_keys: np.ndarray  # per place: the key of the source it holds
    source_slots: np.ndarray  # per place: the caller's pool slot of that source
    source_queries: np.ndarray  # (sources, queries): the rows reading each place's source
    row_queries: np.ndarray  # per row: place * queries + its rank among the rows reading its source


def source_layout(keys: np.ndarray, slots: np.ndarray, held: np.ndarray) -> SourceLayout:
    """keys, slots: per row of the call, its source's key and pool slot; held: the key each of the
    first places holds now (only places below the new source count can be kept)."""
    return source_layout_python(keys, slots, held) if len(keys) <= PYTHON_LAYOUT_ROWS else source_layout_numpy(keys, slots, held)


class SourceLayoutLists(NamedTuple):
    """SourceLayout as Python lists (`source_layout_lists`), for a caller that lays out a few rows without numpy."""

    source_keys: list[int]
    source_slots: list[int]
    source_queries: list[list[int]]  # each `queries` long
    row_queries: list[int]
    queries: int  # per source: the most rows reading one (at least MIN_QUERIES), 0 without a source


def source_layout_python(keys: np.ndarray, slots: np.ndarray, held: np.ndarray) -> SourceLayout:
    lists = source_layout_lists(keys.tolist(), slots.tolist(), held.tolist())
    sources = len(lists.source_keys)
    return SourceLayout(np.array(lists.source_keys, dtype=np.int64), np.array(lists.source_slots, dtype=np.int64),
                        np.array(lists.source_queries, dtype=np.int64).reshape(sources, lists.queries),
                        np.array(lists.row_queries, dtype=np.int64))  # fmt: skip


def source_layout_lists(row_keys: list[int], row_slots: list[int], held: list[int]) -> SourceLayoutLists:
    """`source_layout` on lists (held: the keys the first places hold now; those past the new source count are ignored)."""
    first_row: dict[int, int] = {}
    for row, key in enumerate(row_keys):
        first_row.setdefault(key, row)
    ordered = sorted(first_row)
    sources = len(ordered)
    held_at = {key: place for place, key in enumerate(held[:sources])}
    place_of: dict[int, int] = {key: held_at[key] for key in ordered if key in held_at}
    free = iter(sorted(set(range(sources)) - set(place_of.values())))
    for key in ordered:
        if key not in place_of:
            place_of[key] = next(free)
    source_keys, source_slots = [0] * sources, [0] * sources
    rows_of: list[list[int]] = [[] for _ in range(sources)]
    for key, place in place_of.items():
        source_keys[place], source_slots[place] = key, row_slots[first_row[key]]
    for row, key in enumerate(row_keys):
        rows_of[place_of[key]].append(row)
    queries = max((len(rows) for rows in rows_of), default=0)
    queries = max(queries, MIN_QUERIES) if rows_of else 0
    row_queries = [0] * len(row_keys)
    for place, rows in enumerate(rows_of):
        for rank, row in enumerate(rows):
            row_queries[row] = place * queries + rank
    source_queries = [rows + [rows[0]] * (queries - len(rows)) for rows in rows_of]
    return SourceLayoutLists(source_keys, source_slots, source_queries, row_queries, queries)


def source_layout_numpy(keys: np.ndarray, slots: np.ndarray, held: np.ndarray) -> SourceLayout:
    rows = len(keys)
    unique_keys, first_row, source_of_row = np.unique(keys, return_index=True, return_inverse=True)
    sources = len(unique_keys)
    held = held[:sources]
    by_key = np.argsort(held)
    found_at = np.minimum(np.searchsorted(held, unique_keys, sorter=by_key), max(len(held) - 1, 0))
    kept = held[by_key[found_at]] == unique_keys if len(held) else np.zeros(sources, dtype=bool)
    place_of = np.full(sources, -1, dtype=np.int64)
    place_of[kept] = by_key[found_at[kept]]
    taken = np.zeros(sources, dtype=bool)
    taken[place_of[kept]] = True
    place_of[~kept] = np.flatnonzero(~taken)  # as many free places as sources without one
    place_of_row = place_of[source_of_row.reshape(-1)]
    source_keys, source_slots = np.empty_like(unique_keys), np.empty_like(unique_keys)
    source_keys[place_of], source_slots[place_of] = unique_keys, slots[first_row]
    # Rows grouped by source (in row order); a source with fewer rows than the most repeats its first row.
    counts = np.bincount(place_of_row, minlength=sources)
    queries = int(counts.max(initial=0))
    queries = max(queries, MIN_QUERIES) if sources else 0
    by_source = np.argsort(place_of_row, kind="stable")
    starts = np.cumsum(counts) - counts
    rank = np.arange(rows) - np.repeat(starts, counts)
    source_queries = np.empty((sources, queries), dtype=np.int64)
    source_queries[:] = by_source[starts][:, None]
    source_queries[place_of_row[by_source], rank] = by_source
    row_queries = np.empty(rows, dtype=np.int64)
    row_queries[by_source] = place_of_row[by_source] * queries + rank
    return SourceLayout(source_keys, source_slots.astype(np.int64), source_queries, row_queries)
