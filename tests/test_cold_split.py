"""kernels/cold_split.py: which cold pairs the CPU takes (the rule route_split applies on the GPU, tested against it in
tests/test_qmoe_gpu.py) and the table of how many, from the two sides' costs."""

from __future__ import annotations

import numpy as np

from kernels.cold_split import cpu_take_table, split_cold_pairs


def _split_by_loops(cold, take):
    """The rule spelt out: per token, walk its pairs from the last rank up, giving the CPU cold ones while its share
    lasts."""
    on_cpu = np.zeros_like(cold)
    for t, row in enumerate(cold):
        left = take[int(row.sum())]
        for j in range(row.size - 1, -1, -1):
            if row[j] and left:
                on_cpu[t, j], left = True, left - 1
    return on_cpu


def test_the_cpu_takes_the_last_cold_pairs_of_each_token_as_the_table_says():
    rng = np.random.default_rng(3)
    for k in (1, 2, 4, 8):
        for _ in range(50):
            cold = rng.random((rng.integers(1, 9), k)) < rng.random()
            take = np.array([rng.integers(0, c + 1) for c in range(k + 1)])
            assert np.array_equal(split_cold_pairs(cold, take), _split_by_loops(cold, take))
    cold = np.array([[True, False, True, True], [False] * 4, [True] * 4])
    assert split_cold_pairs(cold, np.array([0, 1, 1, 2, 3])).astype(int).tolist() == [
        [0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]]


def test_the_table_balances_the_cpus_call_against_the_gpus_reads():
    # the CPU 30 µs an expert plus 60 µs a call, the GPU 60 µs an expert: with 8 cold pairs, 5 on the CPU (210 µs)
    # against 3 read (180) beats 4 / 4 (180 against 240) and 6 / 2 (240 against 120); one cold pair stays on the GPU
    # (60 against 90), and at 6 cold pairs 3 / 3 and 4 / 2 tie at 180 µs: the GPU's way
    assert cpu_take_table(8, 30e-6, 60e-6, 60e-6).tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 5]
    # no fixed cost and a CPU as fast as the GPU: half each, ties to the GPU
    assert cpu_take_table(4, 1.0, 0.0, 1.0).tolist() == [0, 0, 1, 1, 2]
    # a CPU call dearer than reading every cold expert: nothing on the CPU
    assert cpu_take_table(4, 1e-6, 1.0, 1e-6).tolist() == [0, 0, 0, 0, 0]


def test_the_table_counts_the_hosts_own_work_on_the_cpus_side():
    # a CPU as fast as the GPU, the host's work after the CPU's part as long as one expert: with 4 cold pairs 1 on the
    # CPU (1 + 1 against 3 read) beats 2 (1 + 2 against 2, a tie the GPU's way below it: 3 against 3); with 2 cold
    # pairs none (the host's 1 against 2 read ties 1 + 1 against 1)
    assert cpu_take_table(4, 1.0, 0.0, 1.0, host_s=1.0).tolist() == [0, 0, 0, 1, 1]
    # the host's work longer than reading every cold pair: nothing on the CPU
    assert cpu_take_table(4, 1.0, 0.0, 1.0, host_s=5.0).tolist() == [0, 0, 0, 0, 0]
