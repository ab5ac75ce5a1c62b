"""The step cache's row moves and the sources' copies compiled (runtime/kernels/cache_moves.c, built by
runtime/build_extensions.py) against their numpy forms (StepCache._copy_rows, source_group.copy_source): the same cache
bytes, slot lineage and count of slots copied."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from nmt_serve.runtime import source_group, step_cache
from nmt_serve.runtime.step_cache import StepCache
from tests.extensions import compiled_extension


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The extension built in this session from the source (tests/extensions.py)."""
    return compiled_extension("cache_moves", tmp_path_factory.mktemp("cache_moves"))  # type: ignore[return-value]


def cache(rng: np.random.Generator, dtype: type, rows: int = 12, capacity: int = 10) -> SimpleNamespace:
    """What _copy_rows reads of a StepCache: a (tensors, rows, heads, length, head dim) block and the slot lineage,
    rows sharing some of their first slots' numbers as beams of one hypothesis do."""
    block = rng.integers(-100, 100, size=(6, rows, 4, capacity, 8)).astype(dtype)
    ids = np.zeros((rows, capacity), dtype=np.int64)
    for row in range(rows):
        shared = int(rng.integers(0, capacity))
        ids[row, :shared] = np.arange(1, shared + 1)
        ids[row, shared:] = 1000 * (row + 1) + np.arange(shared, capacity)
    return SimpleNamespace(_kv_block=block, _slot_ids=ids, slots_copied=0)


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_compiled_moves_give_the_numpy_moves(compiled: ModuleType, monkeypatch: pytest.MonkeyPatch, dtype: type) -> None:
    """Random moves between distinct rows, each from the first slot its lineage differs (the compiled moves find it as
    they copy; the numpy form, told to look for every move, with numpy): the same block, lineage and count either way;
    rows not written keep their bytes."""
    monkeypatch.setattr(step_cache, "SMALL_COPY_SLOTS", 0)
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    for _ in range(30):
        with_numpy = cache(rng, dtype)
        with_compiled = SimpleNamespace(_kv_block=with_numpy._kv_block.copy(), _slot_ids=with_numpy._slot_ids.copy(), slots_copied=0)
        rows = rng.permutation(12).tolist()
        moves = int(rng.integers(1, 6))
        destination, origin = rows[:moves], rows[moves : 2 * moves]
        lengths = rng.integers(0, 11, size=moves).tolist()
        monkeypatch.setattr(step_cache, "native_cache_moves", None)
        StepCache._copy_rows(with_numpy, destination, origin, lengths)  # type: ignore[arg-type]
        monkeypatch.setattr(step_cache, "native_cache_moves", compiled)
        StepCache._copy_rows(with_compiled, destination, origin, lengths)  # type: ignore[arg-type]
        np.testing.assert_array_equal(with_compiled._kv_block, with_numpy._kv_block)
        np.testing.assert_array_equal(with_compiled._slot_ids, with_numpy._slot_ids)
        assert with_compiled.slots_copied == with_numpy.slots_copied


def test_a_swap_reads_both_rows_first_without_the_extension(compiled: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows trading places (a row written that another move reads) take the numpy path, which reads every origin first."""
    monkeypatch.setattr(step_cache, "native_cache_moves", compiled)
    moved = cache(np.random.default_rng(0), np.float32)
    before = moved._kv_block.copy()
    StepCache._copy_rows(moved, [0, 1], [1, 0], [10, 10])  # type: ignore[arg-type]
    np.testing.assert_array_equal(moved._kv_block[:, 0], before[:, 1])
    np.testing.assert_array_equal(moved._kv_block[:, 1], before[:, 0])


def test_bad_moves_are_refused(compiled: ModuleType) -> None:
    block, ids = np.zeros((2, 3, 1, 4, 8), np.float32), np.zeros((3, 4), np.int64)
    with pytest.raises(ValueError, match="outside the block of 3 rows x 4 slots"):
        compiled.copy_rows(block, ids, [0], [3], [0], [2])
    with pytest.raises(ValueError, match="outside the block"):
        compiled.copy_rows(block, ids, [0], [1], [0], [5])
    with pytest.raises(ValueError, match="5-D"):
        compiled.copy_rows(block[0], ids, [0], [1], [0], [2])
    with pytest.raises(ValueError, match="int64"):
        compiled.copy_rows(block, ids.astype(np.int32), [0], [1], [0], [2])
    assert compiled.copy_rows(block, ids, [0], [1], [0], [4]) == 4
    with pytest.raises(TypeError, match="firsts must be a list of ints or None"):
        compiled.copy_rows(block, ids, [0], [1], (0,), [4])


def test_moves_without_firsts_start_at_the_first_slot_whose_lineage_differs(compiled: ModuleType) -> None:
    """firsts None: a move copies from its first slot whose number differs from its origin's, or is 0 (unknown)."""
    block = np.arange(2 * 3 * 1 * 6 * 2, dtype=np.float32).reshape(2, 3, 1, 6, 2)
    ids = np.array([[1, 2, 3, 4, 5, 6], [1, 2, 9, 4, 5, 6], [0, 0, 0, 0, 0, 0]], dtype=np.int64)
    moved = block.copy()
    assert compiled.copy_rows(moved, ids, [1], [0], None, [5]) == 3  # slots 2-4: slot 2 differs, the rest follow
    np.testing.assert_array_equal(moved[:, 1, :, :2], block[:, 1, :, :2])
    np.testing.assert_array_equal(moved[:, 1, :, 2:5], block[:, 0, :, 2:5])
    np.testing.assert_array_equal(moved[:, 1, :, 5:], block[:, 1, :, 5:])
    assert ids[1].tolist() == [1, 2, 3, 4, 5, 6]
    assert compiled.copy_rows(moved, ids, [1], [0], None, [6]) == 0  # the same lineage now: nothing to copy
    assert compiled.copy_rows(moved, ids, [0], [2], None, [2]) == 2  # 0 in the origin: never proven equal


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_compiled_source_copies_give_the_numpy_copies(compiled: ModuleType, monkeypatch: pytest.MonkeyPatch, dtype: type) -> None:
    """A source's every tensor and its mask copied into a place of wider buffers (the engine's pool, a step cache group)
    by the compiled call and by numpy: the same bytes, the place's columns past the source zeroed, other places kept."""
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    for _ in range(20):
        width, places, items = int(rng.integers(0, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
        wide = width + int(rng.integers(0, 6))
        origins = [rng.integers(-100, 100, size=(items, 3, width + int(rng.integers(0, 3)), 5)).astype(dtype) for _ in range(4)]
        origins.append(rng.integers(0, 2, size=(items, width + 1)).astype(bool))
        destinations = [rng.integers(-100, 100, size=(places, 3, wide, 5)).astype(dtype) for _ in range(4)]
        destinations.append(rng.integers(0, 2, size=(places, wide)).astype(bool))
        place, row = int(rng.integers(0, places)), int(rng.integers(0, items))
        expected = [array.copy() for array in destinations]
        monkeypatch.setattr(source_group, "native_cache_moves", None)
        source_group.copy_source(expected, origins, place, row, width)
        monkeypatch.setattr(source_group, "native_cache_moves", compiled)
        source_group.copy_source(destinations, origins, place, row, width)
        for got, want, origin in zip(destinations, expected, origins, strict=True):
            np.testing.assert_array_equal(got, want)
            if got.ndim == 2:
                got, origin = got[:, None, :, None], origin[:, None, :, None]
            np.testing.assert_array_equal(got[place, :, :width], origin[row, :, :width])
            assert not got[place, :, width:].any()


def test_bad_source_copies_are_refused(compiled: ModuleType) -> None:
    pool, source = np.zeros((2, 3, 8, 4), np.float32), np.ones((1, 3, 5, 4), np.float32)
    with pytest.raises(ValueError, match="place 2 of 2, row 0 of 1, width 5 of 8 and 5: outside the arrays"):
        compiled.copy_sources([pool], [source], 2, 0, 5, True)
    with pytest.raises(ValueError, match="width 6 of 8 and 5"):
        compiled.copy_sources([pool], [source], 0, 0, 6, True)
    with pytest.raises(ValueError, match="differ in heads, head dim or item type"):
        compiled.copy_sources([pool], [source.astype(np.float64)], 0, 0, 5, True)
    with pytest.raises(ValueError, match="differ in heads"):
        compiled.copy_sources([pool], [np.ones((1, 5), np.float32)], 0, 0, 5, True)
    with pytest.raises(ValueError, match="4-D .* or 2-D"):
        compiled.copy_sources([pool[0]], [source[0]], 0, 0, 5, True)
    with pytest.raises(ValueError, match="one length"):
        compiled.copy_sources([pool, pool], [source], 0, 0, 5, True)
    assert not pool.any()
