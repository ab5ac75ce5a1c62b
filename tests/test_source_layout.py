"""runtime/source_layout.py: the Python and numpy layouts agree, and a source keeps its place."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt_serve.runtime.source_layout import source_layout_numpy, source_layout_python

# Held keys: each source in one place at most; -1 marks empty places (after a clear), any number of them.
HELD = st.lists(st.integers(-1, 14), max_size=16).filter(lambda keys: len({key for key in keys if key >= 0}) == sum(key >= 0 for key in keys))


@settings(max_examples=400, deadline=None, database=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=40), HELD)
def test_source_layout_python_and_numpy_agree(row_keys: list[int], held_keys: list[int]) -> None:
    keys = np.array(row_keys, dtype=np.int64)
    slots = keys * 10 + 3  # any per-key slot
    held = np.array(held_keys, dtype=np.int64)
    python, numpy = source_layout_python(keys, slots, held), source_layout_numpy(keys, slots, held)
    for name in ("source_keys", "source_slots", "source_queries", "row_queries"):
        assert getattr(python, name).tolist() == getattr(numpy, name).tolist(), name
    sources, queries = python.source_queries.shape
    assert sorted(python.source_keys.tolist()) == sorted(set(row_keys))
    for place, key in enumerate(held_keys[:sources]):
        if key in row_keys:  # a source held below the new count keeps its place
            assert python.source_keys[place] == key
    for row, key in enumerate(row_keys):  # each row's result is read back from a query of its own source
        place, rank = divmod(int(python.row_queries[row]), queries)
        assert python.source_keys[place] == key and python.source_queries[place, rank] == row
        assert python.source_slots[place] == key * 10 + 3
