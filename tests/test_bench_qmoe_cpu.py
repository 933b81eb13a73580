"""benchmarks/bench_qmoe_cpu.py's decode figure on a small node: its reference is the streaming read measured in the
same run, before and after the decode timings, the larger of the two."""
from __future__ import annotations

import pytest


def test_the_decode_figure_reads_against_the_larger_of_two_streaming_reads(monkeypatch):
    from benchmarks import bench_qmoe_cpu as bench

    monkeypatch.setitem(bench.SHAPES, "B", (8, 64, 64, 2))  # experts, hidden, intermediate, top-k
    reads = iter([40.0, 55.0])  # GB/s: before the decode timings, after them (a third read would raise)
    monkeypatch.setattr(bench, "stream_read_bandwidth", lambda: next(reads))
    figures = bench.main(["--shape", "B", "--routing", "cold", "--runs", "6", "--no-prefill", "--no-generic",
                          "--no-write"])
    decode = next(f for f in figures if f["name"].startswith("decode weight bandwidth"))
    assert decode["reference_value"] == 55.0
    assert decode["value"] > 0 and decode["ratio"] == pytest.approx(decode["value"] / 55.0)
    assert "before and after the decode timings" in decode["reference"]
    # what else used the CPUs meanwhile (engine/host_load.py), beside the figure
    assert 0.0 <= decode["host_steal_share"] <= 1.0 and 0.0 <= decode["host_others_share"] <= 1.0
