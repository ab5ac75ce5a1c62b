"""Bounds on the memory a CPU training run holds: oneDNN's kernel cache and glibc's heap.

Token-count batches give nearly every step new tensor shapes. On an Intel Xeon with AMX (bf16 autocast), a
CPU fine-tune of the small preset grew from 7.3 GB to 19.7 GB in 330 steps of 16,000 tokens and slowed from
about 6 to 9 s a step. Two things grow (130 steps of 8,000 tokens, resident memory at step ~5 -> ~125):
oneDNN's cache of compiled kernels, one per operation and shape (1,024 by default) and almost never hit
here: 3.2 -> 7.7 GB as it was, 3.7 -> 5.6 GB capped at 32; and glibc's heap, whose mmap threshold rises
after each large free so that later large buffers come from the heap and fragment it: with a fixed 1 MiB
threshold as well, 2.2 -> 2.5 GB, flat (docs/training.md).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import MutableMapping

KERNEL_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
TRAINING_KERNEL_CACHE = 32
HEAP_THRESHOLD_VARIABLE = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up; set, it wins over bound_heap
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def bound_kernel_cache(environ: MutableMapping[str, str] = os.environ) -> str:
    """Cap oneDNN's kernel cache unless the user chose a capacity; returns the capacity in force.

    oneDNN reads the variable when it creates its first kernel, so this must run before the first CPU matmul.
    """
    return environ.setdefault(KERNEL_CACHE_VARIABLE, str(TRAINING_KERNEL_CACHE))


def bound_heap(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Fix glibc's mmap threshold at 1 MiB, so that large buffers go back to the system when freed.

    Returns the threshold set, or None where the user set one, or the C library is not glibc.
    """
    if HEAP_THRESHOLD_VARIABLE in environ:
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own symbols: its C library's, if it has one
    if mallopt is None:
        return None
    return MMAP_THRESHOLD_BYTES if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 else None
