"""nmt-train's CPU memory bounds: set by default, and a choice the user made in the environment is kept."""

from __future__ import annotations

import ctypes

import pytest

from nmt_serve.model.cpu_memory import (HEAP_THRESHOLD_VARIABLE, KERNEL_CACHE_VARIABLE, MMAP_THRESHOLD_BYTES,
                                        TRAINING_KERNEL_CACHE, bound_heap, bound_kernel_cache)


def test_the_kernel_cache_is_capped_when_the_user_chose_no_capacity() -> None:
    environ: dict[str, str] = {}
    assert bound_kernel_cache(environ) == str(TRAINING_KERNEL_CACHE)
    assert environ == {KERNEL_CACHE_VARIABLE: str(TRAINING_KERNEL_CACHE)}


def test_a_kernel_cache_capacity_the_user_chose_is_kept() -> None:
    environ = {KERNEL_CACHE_VARIABLE: "1024"}
    assert bound_kernel_cache(environ) == "1024"
    assert environ == {KERNEL_CACHE_VARIABLE: "1024"}


def test_a_heap_threshold_the_user_chose_is_left_to_glibc() -> None:
    assert bound_heap({HEAP_THRESHOLD_VARIABLE: "65536"}) is None


def test_the_heap_threshold_is_fixed_where_the_c_library_has_mallopt() -> None:
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("the C library here has no mallopt (not glibc)")
    assert bound_heap({}) == MMAP_THRESHOLD_BYTES
