"""kernels/cold_split.py: which cold pairs the CPU takes (the rule route_split applies on the GPU, tested against it in
tests/test_qmoe_gpu.py) and the table of how many, from the two sides' costs."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cold_split import (cpu_spans, cpu_take_table, device_spans, gpu_rows_of_split, split_cold_pairs,
                                split_cold_rows, split_rows_table)


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


def test_a_steps_split_pair_is_the_gpus_last_cold_pair_coded_by_its_first_cpu_row():
    take, rows = np.array([0, 0, 1, 1, 2]), np.array([0, 64, 0, 128, 64])
    # one token, 3 cold of 4: the CPU takes rank 3 whole, rank 1 (the GPU's last cold) is split at row 128
    assert split_cold_rows(np.array([[True, True, False, True]]), take, rows).tolist() == [[0, 129, 0, 1]]
    # 1 cold: the CPU takes none whole, the one cold pair is split at row 64
    assert split_cold_rows(np.array([[False, False, True, False]]), take, rows).tolist() == [[0, 0, 65, 0]]
    # 2 cold, no rows for c = 2; 4 cold and the CPU takes 2 whole: rank 1 split
    assert split_cold_rows(np.array([[True, True, False, False]]), take, rows).tolist() == [[0, 1, 0, 0]]
    assert split_cold_rows(np.array([[True] * 4]), take, rows).tolist() == [[0, 65, 1, 1]]
    # the CPU takes every cold pair: none left on the GPU to split
    assert split_cold_rows(np.array([[True, False, False, False]]), np.array([0, 1, 1, 1, 2]), rows).tolist() == [
        [1, 0, 0, 0]]
    # two tokens: whole pairs only (the GPU's decode kernels read a split pair as a launch's last tile)
    cold = np.array([[True, True, False, True], [True] * 4])
    assert np.array_equal(split_cold_rows(cold, take, rows), split_cold_pairs(cold, take).astype(np.int32))


def test_the_rows_table_splits_a_pair_where_both_parts_end_sooner():
    # the CPU 1 s an expert, the GPU 1 s, no fixed cost, 128 rows in steps of 64: with 1 cold pair the GPU keeps it
    # whole (a tie at 1 s); split at row 64 each side reads half of it: 0.5 s. With 2 cold pairs one each (1 s)
    # beats a split (1.5 s on the CPU at best)
    take = cpu_take_table(2, 1.0, 0.0, 1.0)
    assert take.tolist() == [0, 0, 1]
    assert split_rows_table(take, 128, 64, 1.0, 0.0, 1.0).tolist() == [0, 64, 0]
    # a CPU kernel that reads FC2 whole (CpuQMoE.reads_rows_in_part false): its part of the split pair reads half of
    # FC1 (2/3 of an expert) and all of FC2 (1/3): 0.67 s against the GPU's 0.5, still sooner than 1 s whole
    assert split_rows_table(take, 128, 64, 1.0, 0.0, 1.0, cpu_reads_fc2_whole=True).tolist() == [0, 64, 0]
    # ... and with a call's fixed cost of 0.4 s it is not (1.07 s against 1 s whole)
    assert not split_rows_table(take, 128, 64, 1.0, 0.4, 1.0, cpu_reads_fc2_whole=True).any()
    # gpt-oss-20B-like at 0% on an H100 host (sixty-fifth session): the CPU 183 µs an expert + 54 µs a call, the GPU
    # 279 µs: 4 cold pairs, 2 on the CPU (the GPU's 558 µs the later); the GPU's last pair split where both sides end
    # together, at ~0.7 of its rows
    take = cpu_take_table(4, 183e-6, 54e-6, 279e-6)
    assert take[4] == 2
    rows = split_rows_table(take, 2880, 64, 183e-6, 54e-6, 279e-6)
    r = rows[4] / 2880
    assert rows[4] % 64 == 0 and 0.6 < r < 0.8
    cpu, gpu = 54e-6 + (2 + 1 - r) * 183e-6, (1 + r) * 279e-6
    assert max(cpu, gpu) < 558e-6 - 70e-6 and abs(cpu - gpu) < 20e-6
    # a table with no cold pair left on the GPU, or no row between the steps, splits nothing
    assert not split_rows_table(np.array([0, 1, 2]), 768, 64, 35e-6, 52e-6, 53e-6).any()
    assert not split_rows_table(take, 64, 64, 35e-6, 52e-6, 53e-6).any()


def test_spans_give_each_side_its_rows_of_the_split_pair():
    ids, codes = np.array([[5, 2, 7]]), np.array([[0, 129, 1]], np.int32)
    cpu, device = cpu_spans(ids, codes, 8, 192), device_spans(ids, codes, 8, 192)
    assert cpu[2].tolist() == [128, 192] and device[2].tolist() == [0, 128]
    assert (np.delete(cpu, 2, axis=0) == [0, 192]).all() and (np.delete(device, 2, axis=0) == [0, 192]).all()
    assert cpu_spans(ids, np.array([[0, 1, 1]]), 8, 192) is None
    assert gpu_rows_of_split(codes, 192) == pytest.approx(128 / 192)
