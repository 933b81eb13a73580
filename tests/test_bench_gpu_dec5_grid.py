"""bench_gpu_dec5_grid's configuration list (CPU only; the benchmark itself needs a GPU)."""
from __future__ import annotations

import pytest

from benchmarks.bench_gpu_dec5_grid import parse_configs


def test_the_default_grid_comes_first_once_and_repeats_are_dropped():
    assert parse_configs("4:3, 3:4,4:3,0:0") == [(0, 0), (4, 3), (3, 4)]
    assert parse_configs("") == [(0, 0)]


@pytest.mark.parametrize("text, error", [("4-3", "'4-3' is not FC1:FC2 blocks per SM"),
                                         ("4:x", "'4:x' is not FC1:FC2"),
                                         ("4:3:1", "'4:3:1' is not FC1:FC2"),
                                         ("-1:3", "'-1:3' has a negative block count")])
def test_a_bad_configuration_is_named(text, error):
    with pytest.raises(SystemExit, match=error):
        parse_configs(text)
