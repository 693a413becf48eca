"""`all_finite`: the same verdict as ``np.isfinite(x).all()``, without an array-sized boolean scratch."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from hybridfleet.codec.base import FINITE_CHUNK, all_finite


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("size", [0, 1, FINITE_CHUNK - 1, FINITE_CHUNK, 3 * FINITE_CHUNK + 7])
def test_all_finite_agrees_with_numpy_wherever_the_bad_value_is(dtype, size):
    x = np.random.default_rng(size).standard_normal(size).astype(dtype)
    assert all_finite(x) is True
    positions = {0, size // 2, size - 1, FINITE_CHUNK - 1, FINITE_CHUNK, 2 * FINITE_CHUNK + 3}
    for pos in sorted(p for p in positions if 0 <= p < size):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[pos] = bad
            assert all_finite(y) is bool(np.isfinite(y).all()) is False, (pos, bad)


def test_all_finite_takes_any_shape_and_layout():
    x = np.ones((3, FINITE_CHUNK), np.float32)
    x[2, -1] = np.nan
    assert not all_finite(x)                 # contiguous, checked in pieces
    assert all_finite(x[:2])                 # a contiguous view
    assert not all_finite(x.T)               # not contiguous: checked whole
    assert all_finite(x[:, :-1].T)
    assert all_finite(np.float32(2.0).reshape(()))
    assert all_finite(np.arange(10))         # integers are always finite


def test_all_finite_scratch_stays_at_one_chunk():
    # Prepare: a 32 MiB float32 gradient; np.isfinite(x).all() would take 8 MiB of booleans
    x = np.ones(8 * FINITE_CHUNK, np.float32)
    tracemalloc.start()
    try:
        # Execute
        ok = all_finite(x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Assert: one chunk of scratch (1 MiB), not 8 MiB
    assert ok
    assert peak <= FINITE_CHUNK + (64 << 10), peak
