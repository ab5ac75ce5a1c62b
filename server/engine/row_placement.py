"""Where rows go between decoder calls: each row continuing a place keeps it, the rest fill the holes."""

from __future__ import annotations

import itertools

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


def place_rows(origin: np.ndarray) -> np.ndarray:
    """Where each row of the next call goes, given the row of the last call it continues (-1 = new).

    The first row continuing a place below the new row count stays there (nothing to copy); every
    other row takes a hole (a place no row stays in), in order.
    """
    return place_rows_python(origin) if len(origin) <= PYTHON_PLACEMENT_ROWS else place_rows_numpy(origin)


def place_rows_python(origin: np.ndarray) -> np.ndarray:
    return np.array(place_rows_list(origin.tolist()), dtype=np.int64)


def place_rows_list(origin: list[int]) -> list[int]:
    """`place_rows` on a list."""
    rows = len(origin)
    place, taken = [-1] * rows, [False] * rows
    for row, continued in enumerate(origin):
        if 0 <= continued < rows and not taken[continued]:
            place[row], taken[continued] = continued, True
    holes = iter([hole for hole in range(rows) if not taken[hole]])
    return [where if where >= 0 else next(holes) for where in place]


def place_rows_numpy(origin: np.ndarray) -> np.ndarray:
    rows = len(origin)
    place = np.full(rows, -1, dtype=np.int64)
    continuing = np.flatnonzero(origin >= 0)
    _, first = np.unique(origin[continuing], return_index=True)
    stays = continuing[first]
    stays = stays[origin[stays] < rows]
    place[stays] = origin[stays]
    taken = np.zeros(rows, dtype=bool)
    taken[place[stays]] = True
    place[place < 0] = np.flatnonzero(~taken)  # as many holes as rows without a place
    return place
