"""StepCache lays a call's sources out on lists for a few rows (`_arrange_few_sources`) and with numpy for many
(`_arrange_sources`): the same places, copies, masks, queries and row places either way, over calls whose sources join,
stay and leave, short ones (the narrow group) and long ones (the wide group), with and without dummy places."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.source_group import source_width
from nmt_serve.runtime.step_cache import StepCache

SLOTS = 10


def encoded_pool(rng: np.random.Generator, step: OrtStep, lengths: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """A pool of encoded sources as the engine keeps it: cross K/V per layer (slots, H, width, Dh), masks (slots, width)."""
    config = step.config
    width = source_width(max(lengths))
    cross = [rng.standard_normal((len(lengths), config.n_heads, width, config.head_dim)).astype(np.float32) for _ in step.cross_names]
    mask = np.arange(width)[None, :] < np.array(lengths)[:, None]
    for layer in cross:
        layer *= mask[:, None, :, None]
    return cross, mask


def group_state(cache: StepCache) -> list[object]:
    state: list[object] = [cache.sources_copied]
    for group in (cache.narrow, cache.wide):
        held = group.sources
        state += [group.sources, group.bound, group.width, group.keys[:held].tolist(), group.queries.tolist(),
                  group.mask[:held].tolist(), [layer[:held].tobytes() for layer in group.cross]]  # fmt: skip
    return state


@pytest.mark.parametrize("dummy_places", [False, True])
def test_sources_laid_out_on_lists_as_with_numpy(tiny_model_dir: Path, dummy_places: bool) -> None:
    step = OrtStep(tiny_model_dir)
    rng = np.random.default_rng(int(dummy_places))
    lengths = rng.integers(1, 40, size=SLOTS).tolist()
    lengths[:2] = [3, 33]  # at least one narrow and one wide source
    cross, mask = encoded_pool(rng, step, lengths)
    generation = [0] * SLOTS  # a slot given a new source gets a new key, as the engine's job ids are
    with_lists, with_numpy = (StepCache(step.decoder, step.config, step.cross_names) for _ in range(2))
    for cache in (with_lists, with_numpy):
        cache.dummy_places = dummy_places
    wide_calls = narrow_calls = 0
    for _ in range(40):
        for slot in rng.choice(SLOTS, size=int(rng.integers(0, 2)), replace=False).tolist():
            generation[slot] += 1
        chosen = rng.choice(SLOTS, size=int(rng.integers(1, 5)), replace=False).tolist()
        slots = [slot for slot in chosen for _ in range(int(rng.integers(1, 4)))]
        slots = rng.permutation(slots).tolist()
        keys = [1000 * generation[slot] + slot for slot in slots]
        for cache in (with_lists, with_numpy):
            cache._reserve(len(slots), 1)
        with_lists._arrange_few_sources(list(keys), list(slots), cross, mask)
        with_numpy._arrange_sources(np.array(keys, dtype=np.int64), np.array(slots, dtype=np.int64), cross, mask)
        assert group_state(with_lists) == group_state(with_numpy)
        assert with_lists._row_queries[: len(slots)].tolist() == with_numpy._row_queries[: len(slots)].tolist()
        assert with_lists._row_key_list == with_numpy._row_key_list == keys
        wide_calls += with_lists.wide.sources > 0
        narrow_calls += with_lists.narrow.sources > 0
    assert wide_calls and narrow_calls and with_lists.sources_copied > 0
