"""benchmarks/diag_worker_parts.py: how a layer's time from its gate to the next layer's routing is split between the
GPU's clock readings and the host's."""
import pytest

from benchmarks.diag_worker_parts import chain_parts


class Published:
    def __init__(self, times):
        self.times = times

    def gpu_times(self):
        return self.times


class Worker:
    def __init__(self, by_layer):
        # engine layer -> (the loop's index, kernel, published), admitted out of layer order
        self._index_of = {layer: (index, None, Published(times)) for index, (layer, times) in enumerate(by_layer)}


def test_each_gate_to_the_next_routing_is_split_by_the_gpu_clock_and_the_rest_is_the_crossings():
    # ns on the GPU's clock: route_split began, published; the merge began to wait, saw the gate
    worker = Worker([(1, (40_000, 45_000, 60_000, 70_000)), (0, (0, 4_000, 20_000, 30_000)),
                     (2, (100_000, 106_000, 0, 0))])
    # the worker's jobs in layer order: (pairs, cpu_s, wait, reached, gated, routed), host seconds
    jobs = [(6, 0, 0, 0.0, 1.000_000, 0.999_990), (6, 0, 0, 0.0, 1.000_050, 1.000_020),
            (6, 0, 0, 0.0, 1.000_200, 1.000_090)]
    us = {name: [round(s * 1e6, 3) for s in seconds] for name, seconds in chain_parts(worker, jobs).items()}
    assert us["the GPU's part (published -> merge began)"] == [16.0, 15.0]
    assert us["  the GPU's part where the CPU took 6 pairs"] == [16.0, 15.0]  # (both layers' CPU took 6)
    assert us["the CPU's part (routing found -> gate)"] == [10.0, 30.0]
    assert us["the GPU idle before the gate (merge waited)"] == [10.0, 10.0]
    assert us["gate seen -> next route_split (merge, dense segment)"] == [10.0, 30.0]
    assert us["route_split, start -> published"] == [5.0, 6.0]
    assert us["gate -> routing found by the worker (host)"] == [20.0, 40.0]
    # the host's 20 µs less the GPU's 15 from seeing the gate to publishing; 40 less 36
    assert us["  of it off the GPU's clock: the GPU's part past the gate, the crossings"] == [pytest.approx(5.0),
                                                                                        pytest.approx(4.0)]
    # routing found 100 µs apart on the host (0.999 990 to 1.000 090), published 102 µs apart on the GPU
    assert us["first to last routing found, host less GPU (the clocks agree: ~0)"] == [pytest.approx(-2.0)]


def test_the_split_tables_inputs_are_said_with_the_table_in_force():
    from types import SimpleNamespace

    import numpy as np

    from benchmarks.diag_worker_parts import split_inputs

    engine = SimpleNamespace(split_cpu_rate=SimpleNamespace(value=95e9, fixed_s=41e-6),
                             cpu_rate_state=lambda rate: {"cpu_bytes_per_s": rate.value,
                                                          "cpu_measured_bytes_per_s": rate.value,
                                                          "cpu_call_s": rate.fixed_s,
                                                          "cpu_measured_call_s": rate.fixed_s},
                             tier_read=SimpleNamespace(value=None), host_gap=SimpleNamespace(value=2e-6),
                             share_trials=SimpleNamespace(choice="one fewer"),
                             cold_split_table=lambda layer: np.array([0, 1, 1, 2, 3, 3, 4, 5, 5 + layer]),
                             cold_split_rows=lambda layer: None)
    assert split_inputs(engine, 1) == (
        "the split's table from: CPU 95.0 GB/s + 41 µs a call, tier reads not measured, host gap 2 µs, share "
        "'one fewer': CPU takes [0, 1, 1, 2, 3, 3, 4, 5, 6] of 0..k cold pairs")
    engine.tier_read.value = 27.4e9
    assert "tier reads 27.4 GB/s" in split_inputs(engine, 0)
    # rates under 1 GB/s in MB/s ("0.0 GB/s" read as free), and none said so: "CPU 0.0 kB/s + 0 µs a call"
    engine.tier_read.value = 0.04e9
    assert "tier reads 40.0 MB/s, " in split_inputs(engine, 0)
    engine.split_cpu_rate = SimpleNamespace(value=None, fixed_s=0.0)
    assert split_inputs(engine, 0).startswith("the split's table from: CPU no rate, tier reads 40.0 MB/s, ")
    engine.cold_split_rows = lambda layer: np.array([0, 0, 0, 0, 0, 0, 0, 0, 384])  # a pair split by rows at c = 8
    assert split_inputs(engine, 0).endswith("of 0..k cold pairs, a pair split at rows [0, 0, 0, 0, 0, 0, 0, 0, 384]")
    engine.cold_split_rows = lambda layer: np.zeros(9, np.int32)
    assert split_inputs(engine, 0).endswith("of 0..k cold pairs")


def test_the_split_tables_inputs_say_the_cpu_rate_in_force_with_the_measured_one_beside_it(tmp_path):
    """The split's inputs said the CPU's rate as measured, where its table prices a CPU miss at the rate clamped to
    the host's streaming read (cpu_bytes_per_s): they say the rate in force, the measured one beside it."""
    from benchmarks.diag_worker_parts import split_inputs
    from engine.writer import write_model
    from tests.test_offload import SPEC, clamped_rates_model

    engine = clamped_rates_model(write_model(tmp_path / "m", SPEC)).offload  # 60 GB/s measured, 40 streaming
    assert split_inputs(engine, 0).startswith("the split's table from: CPU 40.0 GB/s + 6 µs a call (measured "
                                              "60.0 GB/s + 100 µs a call, its rate clamped to the stream), tier "
                                              "reads not measured, ")
