"""Activation rows that test the per-row quantization's rounding where it is hardest to get right."""

from __future__ import annotations

import numpy as np


def near_half_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Rows whose values lie within a few units in the last place of half way between two levels of the row's own
    scale (not a power of two): where x times the scale's reciprocal can round to another level than x / scale."""
    peak = rng.uniform(0.05, 50, rows).astype(np.float32)
    scale = (peak * np.float32(1.0 / 127.0)).astype(np.float32)  # what the quantization computes from max |x| = peak
    halves = (rng.integers(-126, 126, (rows, width)) + 0.5).astype(np.float32) * scale[:, None]
    nudge = rng.integers(-3, 4, (rows, width))  # units in the last place to move each value, down or up
    x = halves.astype(np.float32)
    for times in (1, 2, 3):
        for step in (-1, 1):
            moving = nudge * step >= times
            x[moving] = np.nextafter(x[moving], np.float32(step * np.inf))
    x[:, 0] = peak
    return x
