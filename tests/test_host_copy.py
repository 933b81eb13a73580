"""Gathering experts' rows on every core (engine/offload/host_copy.py) against NumPy's take."""

from __future__ import annotations

import numpy as np
import pytest

from engine.offload import host_copy
from engine.offload.host_copy import take_rows


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float16, np.float32, np.int64])
@pytest.mark.parametrize("shape", [(7,), (9, 37), (6, 5, 11), (4, 3, 2, 5)])
def test_take_rows_equals_numpy_take(dtype, shape):
    rng = np.random.default_rng(len(shape))
    src = rng.integers(0, 200, shape).astype(dtype)
    rows = np.array([shape[0] - 1, 0, 2, 2, 1])  # unsorted, repeated
    out = np.full((rows.size,) + shape[1:], 255, dtype)
    assert take_rows(src, rows, out) is out
    assert np.array_equal(out, np.take(src, rows, axis=0))


def test_rows_wider_than_one_chunk_are_split_exactly():
    src = np.random.default_rng(1).integers(0, 255, (5, 3 * host_copy.CHUNK + 17), dtype=np.uint8)
    rows = np.array([4, 1, 3])
    out = np.zeros((3, src.shape[1]), np.uint8)
    assert np.array_equal(take_rows(src, rows, out), src[rows])


def test_non_contiguous_arrays_take_numpys_path():
    src = np.arange(60, dtype=np.float32).reshape(6, 10)[:, ::2]  # a strided view
    rows = np.array([5, 0])
    out = np.empty((2, 5), np.float32)
    assert np.array_equal(take_rows(src, rows, out), src[rows])
    with pytest.raises(ValueError, match="out has shape"):
        take_rows(np.zeros((4, 3), np.uint8), np.array([1]), np.zeros((2, 3), np.uint8))
