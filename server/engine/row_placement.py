"""Where rows go between decoder calls: each row continuing a place keeps it, the rest fill the holes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def split_rows(rows: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Consecutive slices of `rows`, of the given lengths (np.split's result, without its per-call cost)."""
    ends = list(itertools.accumulate(counts))
    return [rows[end - count : end] for count, end in zip(counts, ends, strict=True)]


# Up to this many rows, `place_rows` runs in plain Python, and so does the engine's whole layout of a call
# (Engine._few_row_inputs; StepCache's PYTHON_LAYOUT_ROWS is the same bound): cheaper than ~10 numpy calls, each of
# which costs several microseconds right after a decoder run has flushed the CPU caches. Measured in one process on
# nmt-bench's beam-4 cells (default int8 model, one thread): host time per step 60-70 us less at batch 1 and 2, 19-81 us
# less at batch 8 (32 rows; three runs); at batch 32 (128 rows) lists cost 339 us more.
PYTHON_PLACEMENT_ROWS = 32


# Per request, in row order: how many rows it has in the next call and the places its rows held in the last one.
Groups = Sequence[tuple[int, Sequence[int]]]


def place_rows(origin: np.ndarray, groups: Groups | None = None) -> np.ndarray:
    """Where each row of the next call goes, given the row of the last call it continues (-1 = new).

    The first row continuing a place below the new row count stays there (nothing to copy); every other row takes a
    hole (a place no row stays in): with `groups`, first a hole its own request left, in the order the request held
    them, then the rest in order. So a beam request whose rows pick other parents keeps its places as a set, and each
    place its source: the step cache then lays out the call's sources again only when a request joins, leaves or
    changes its number of rows (StepCache.arrange compares each row's source with the last call's). Without that
    preference half of the beam-4 calls at batch 8 laid their sources out again, at 0.12 ms each (4% of the step).
    """
    return place_rows_python(origin, groups) if len(origin) <= PYTHON_PLACEMENT_ROWS else place_rows_numpy(origin, groups)


def place_rows_python(origin: np.ndarray, groups: Groups | None = None) -> np.ndarray:
    return np.array(place_rows_list(origin.tolist(), groups), dtype=np.int64)


def place_rows_list(origin: list[int], groups: Groups | None = None) -> list[int]:
    """`place_rows` on lists."""
    rows = len(origin)
    place, taken = [-1] * rows, [False] * rows
    for row, continued in enumerate(origin):
        if 0 <= continued < rows and not taken[continued]:
            place[row], taken[continued] = continued, True
    first = 0
    for count, held in groups or ():
        own = iter([hole for hole in held if hole < rows and not taken[hole]])
        for row in range(first, first + count):
            if place[row] < 0:
                hole = next(own, -1)
                if hole < 0:
                    break
                place[row], taken[hole] = hole, True
        first += count
    holes = iter([hole for hole in range(rows) if not taken[hole]])
    return [where if where >= 0 else next(holes) for where in place]


def place_rows_numpy(origin: np.ndarray, groups: Groups | None = None) -> np.ndarray:
    rows = len(origin)
    place = np.full(rows, -1, dtype=np.int64)
    continuing = np.flatnonzero(origin >= 0)
    _, first = np.unique(origin[continuing], return_index=True)
    stays = continuing[first]
    stays = stays[origin[stays] < rows]
    place[stays] = origin[stays]
    taken = np.zeros(rows, dtype=bool)
    taken[place[stays]] = True
    if groups and len(stays) < rows:  # some row needs a hole
        _own_holes(place, taken, groups)
    place[place < 0] = np.flatnonzero(~taken)  # as many holes as rows without a place
    return place


def _ranks(groups: np.ndarray) -> np.ndarray:
    """Each item's rank among the items of its group, for items sorted by group."""
    if not len(groups):
        return groups
    starts = np.flatnonzero(np.concatenate([[True], groups[1:] != groups[:-1]]))
    return np.arange(len(groups)) - np.repeat(starts, np.diff(np.append(starts, len(groups))))


def _own_holes(place: np.ndarray, taken: np.ndarray, groups: Groups) -> None:
    """`place_rows_list`'s pass over `groups`, in place, in numpy: the i-th row of a request without a place takes the
    i-th hole that request left, where there is one."""
    rows = len(place)
    counts = [count for count, _ in groups]
    held = np.concatenate([np.asarray(places, dtype=np.int64) for _, places in groups])
    held_group = np.repeat(np.arange(len(groups)), [len(places) for _, places in groups])
    free = held < rows
    free[free] = ~taken[held[free]]
    holes, hole_group = held[free], held_group[free]
    needing = np.flatnonzero(place < 0)
    needing_group = np.repeat(np.arange(len(groups)), counts)[needing]
    # (request, rank) pairs as one sorted key each: the i-th needing row of a request meets its i-th hole.
    hole_keys = hole_group * (rows + 1) + _ranks(hole_group)
    needing_keys = needing_group * (rows + 1) + _ranks(needing_group)
    at = np.minimum(np.searchsorted(hole_keys, needing_keys), max(len(hole_keys) - 1, 0))
    met = (at < len(hole_keys)) & (hole_keys[at] == needing_keys) if len(hole_keys) else np.zeros(len(needing), dtype=bool)
    place[needing[met]] = holes[at[met]]
    taken[holes[at[met]]] = True
