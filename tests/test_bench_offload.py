"""benchmarks/bench_offload.py: a fraction's decode figure from repeated measurements."""

import pytest

from benchmarks.bench_offload import decode_repeats, decoded_spread


def _repeat(rate: float, bound: float) -> dict:
    cpu_only = bound * 0.75  # the bound with the misses on the CPU alone: lower
    return {"value": rate, "reference_value": bound, "ratio": rate / bound, "bound_misses_on_cpu_only": cpu_only,
            "ratio_to_cpu_only_bound": rate / cpu_only}


def test_a_repeated_decode_point_takes_the_medians_and_keeps_every_repeat():
    repeats = [_repeat(26.0, 86.9), _repeat(28.3, 83.0), _repeat(30.4, 90.8)]
    decoded = decode_repeats(repeats)
    assert decoded["value"] == 28.3 and decoded["reference_value"] == 86.9
    # the median of the per-repeat ratios (26.0 / 86.9, 28.3 / 83.0, 30.4 / 90.8), not median rate / median bound
    assert decoded["ratio"] == pytest.approx(30.4 / 90.8)
    assert decoded["bound_misses_on_cpu_only"] == pytest.approx(86.9 * 0.75)
    assert decoded["ratio_to_cpu_only_bound"] == pytest.approx(30.4 / (90.8 * 0.75))
    assert decoded["repeats"] is repeats
    assert decoded_spread(decoded) == ", ratios 30% / 34% / 33%"


def test_an_even_number_of_repeats_averages_the_middle_two_and_one_repeat_is_itself():
    decoded = decode_repeats([_repeat(20.0, 100.0), _repeat(40.0, 100.0)])
    assert decoded["value"] == 30.0 and decoded["ratio"] == pytest.approx(0.3)
    single = decode_repeats([_repeat(25.0, 80.0)])
    assert single["value"] == 25.0 and single["ratio"] == pytest.approx(25.0 / 80.0)
    assert decoded_spread(single) == ""


def test_the_host_probe_times_its_fixed_work_and_slows_with_the_machine(monkeypatch):
    """host_probe_us: the median µs of its fixed host work; a machine made slower (every perf_counter step longer)
    reads slower. Checked by replacing the clock: real timings on a shared machine are not a test."""
    from types import SimpleNamespace

    import benchmarks.bench_offload as bench

    spec = SimpleNamespace(num_experts=128, k=8, normalize_routing_weights=True, use_sparse_mixer=False)  # route()'s
    for step_s, expected_us in ((10e-6, 10.0), (25e-6, 25.0)):
        ticks = iter(range(10**6))
        monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks) * step_s)
        assert bench.host_probe_us(spec, rounds=50) == pytest.approx(expected_us)


def test_the_gc_clock_counts_the_seconds_of_collections_while_registered_only():
    import gc
    import time

    from benchmarks.bench_offload import GcClock

    clock = GcClock()
    clock("start", {})
    time.sleep(0.01)
    clock("stop", {})
    assert 0.01 <= clock.seconds < 0.5
    before = clock.seconds
    gc.callbacks.append(clock)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
    assert clock.seconds > before
    after = clock.seconds
    gc.collect()
    assert clock.seconds == after
