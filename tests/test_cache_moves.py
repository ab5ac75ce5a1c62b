"""The step cache's row moves compiled (runtime/kernels/cache_moves.c, built by runtime/build_extensions.py) against their
numpy form in StepCache._copy_rows: the same cache bytes, slot lineage and count of slots copied."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from nmt_serve.runtime import step_cache
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
