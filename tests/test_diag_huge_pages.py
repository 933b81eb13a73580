"""benchmarks/diag_huge_pages.py: its copies hold the tensors' values in the pages they were advised, and its cold
calls walk the experts in the order it gives."""
import mmap
import sys

import numpy as np
import pytest

from benchmarks import diag_huge_pages as diag

THP_ADVISED = sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and diag.thp_mode() in ("always", "madvise")


def test_a_copy_holds_the_values_at_a_huge_page_boundary():
    a = np.random.default_rng(0).integers(0, 255, (3, 1000, 700), dtype=np.uint8)
    keep = []
    for huge in (False, True):
        copy = diag.in_pages(a, huge, keep)
        assert copy.ctypes.data % diag.HUGE_PAGE == 0 and copy.dtype == a.dtype
        np.testing.assert_array_equal(copy, a)
    assert len(keep) == 2


@pytest.mark.skipif(not THP_ADVISED, reason="no transparent huge pages to advise here")
def test_the_huge_copy_is_in_huge_pages_and_the_other_is_not():
    a = np.ones(3 * diag.HUGE_PAGE, np.uint8)
    keep = []
    small, huge = diag.in_pages(a, False, keep), diag.in_pages(a, True, keep)
    assert diag.huge_page_bytes([small]) == 0
    assert diag.huge_page_bytes([huge]) >= diag.HUGE_PAGE  # the kernel may leave some pages small, not all


def test_cold_calls_take_windows_of_the_order_in_turn():
    order = np.array([5, 3, 9, 0, 7, 1, 4, 8, 2, 6, 11, 10, 13, 12, 15, 14])
    first, second, third = (diag.cold_ids(order, call) for call in range(3))
    assert first.tolist() == [order[:8].tolist()] and second.tolist() == [order[8:].tolist()]
    np.testing.assert_array_equal(third, first)  # every expert back after E / 8 - 1 other calls
    assert first.dtype == np.int64 and first.shape == (1, diag.TOP_K)
