"""SourcePool: sources land in free slots with a zeroed, masked tail; slots are reused, double when full; the width narrows."""

from __future__ import annotations

import numpy as np

from nmt_serve.server.engine.source_pool import SourcePool

HEADS, HEAD_DIM, LAYERS = 2, 3, 4


def encoded(lengths: list[int], seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """An encoder call's outputs for sources of these lengths, padded to the longest (mask True on tokens)."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    cross = [rng.standard_normal((len(lengths), HEADS, width, HEAD_DIM)).astype(np.float32) for _ in range(LAYERS)]
    mask = np.array([[position < length for position in range(width)] for length in lengths])
    return cross, mask


def test_source_pool_stores_each_source_in_its_slot_with_a_masked_zero_tail() -> None:
    pool = SourcePool(LAYERS, HEADS, HEAD_DIM)
    long_cross, long_mask = encoded([6])
    pool.store(long_cross, long_mask)
    cross, mask = encoded([3, 2], seed=1)
    slots = pool.store(cross, mask)
    assert pool.width == 6 and len(set(slots)) == 2
    for row, slot in enumerate(slots):
        np.testing.assert_array_equal(pool.src_mask[slot], np.r_[mask[row], np.zeros(3, dtype=bool)])
        for layer, values in zip(pool.cross, cross, strict=True):
            np.testing.assert_array_equal(layer[slot, :, :3], values[row])
            assert not layer[slot, :, 3:].any()


def test_source_pool_reuses_released_slots_and_doubles_when_full() -> None:
    pool = SourcePool(LAYERS, HEADS, HEAD_DIM)
    first = pool.store(*encoded([2, 2, 2]))
    assert sorted(first) == [0, 1, 2] and pool.src_mask.shape[0] == 3
    pool.release(first[1])
    assert pool.store(*encoded([2])) == [first[1]]  # no growth while a slot is free
    assert pool.src_mask.shape[0] == 3
    more = pool.store(*encoded([2]))
    assert pool.src_mask.shape[0] == 6 and more == [3]  # doubled; lowest new slot first


def test_source_pool_fit_narrows_only_when_well_below_the_width_and_keeps_the_sources() -> None:
    pool = SourcePool(LAYERS, HEADS, HEAD_DIM)
    pool.store(*encoded([40]))
    cross, mask = encoded([5], seed=2)
    slot = pool.store(cross, mask)[0]
    pool.fit(30)
    assert pool.width == 40  # not yet half the width: narrowing would be churn
    pool.fit(6)
    assert pool.width < 40 and pool.width >= 6
    np.testing.assert_array_equal(pool.cross[0][slot, :, :5], cross[0][0])
    assert pool.src_mask[slot, :5].all() and not pool.src_mask[slot, 5:].any()


def test_source_pool_clear_frees_every_slot_and_keeps_small_buffers_whose_reuse_leaves_nothing_stale() -> None:
    pool = SourcePool(LAYERS, HEADS, HEAD_DIM)
    pool.store(*encoded([9, 7]))
    held = [layer.ctypes.data for layer in pool.cross]
    pool.clear()
    cross, mask = encoded([4], seed=3)
    assert pool.store(cross, mask) == [0]  # the lowest slot again, in the same buffers
    assert [layer.ctypes.data for layer in pool.cross] == held and pool.src_mask.shape == (2, 9)
    np.testing.assert_array_equal(pool.src_mask[0], np.arange(9) < 4)
    for layer, values in zip(pool.cross, cross, strict=True):  # the 9-token source's columns past 4 are zeros now
        np.testing.assert_array_equal(layer[0, :, :4], values[0])
        assert not layer[0, :, 4:].any()


def test_source_pool_clear_gives_back_buffers_over_its_keep_bound() -> None:
    pool = SourcePool(LAYERS, HEADS, HEAD_DIM, keep_bytes=1000)
    pool.store(*encoded([9, 7]))
    assert pool.nbytes > 1000
    pool.clear()
    assert pool.src_mask.shape == (0, 1) and all(layer.shape[0] == 0 for layer in pool.cross)
    assert pool.store(*encoded([3])) == [0]
