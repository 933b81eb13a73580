"""benchmarks/bench_offload.py: a fraction's decode figure from repeated measurements."""

import pytest

from benchmarks.bench_offload import decode_repeats, decoded_spread


def _repeat(rate: float, bound: float) -> dict:
    return {"value": rate, "reference_value": bound, "ratio": rate / bound}


def test_a_repeated_decode_point_takes_the_medians_and_keeps_every_repeat():
    repeats = [_repeat(26.0, 86.9), _repeat(28.3, 83.0), _repeat(30.4, 90.8)]
    decoded = decode_repeats(repeats)
    assert decoded["value"] == 28.3 and decoded["reference_value"] == 86.9
    # the median of the per-repeat ratios (26.0 / 86.9, 28.3 / 83.0, 30.4 / 90.8), not median rate / median bound
    assert decoded["ratio"] == pytest.approx(30.4 / 90.8)
    assert decoded["repeats"] is repeats
    assert decoded_spread(decoded) == ", ratios 30% / 34% / 33%"


def test_an_even_number_of_repeats_averages_the_middle_two_and_one_repeat_is_itself():
    decoded = decode_repeats([_repeat(20.0, 100.0), _repeat(40.0, 100.0)])
    assert decoded["value"] == 30.0 and decoded["ratio"] == pytest.approx(0.3)
    single = decode_repeats([_repeat(25.0, 80.0)])
    assert single["value"] == 25.0 and single["ratio"] == pytest.approx(25.0 / 80.0)
    assert decoded_spread(single) == ""
