"""kernels/cold_split.py: which cold pairs the CPU takes (the rule route_split applies on the GPU, tested against it in
tests/test_qmoe_gpu.py) and the table of how many, from the two sides' costs."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cold_split import (cpu_spans, cpu_take_table, device_spans, gpu_rows_of_split, split_cold_pairs,
                                split_cold_rows, split_tables)


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


def test_the_tables_split_a_pair_where_both_parts_end_sooner():
    # the CPU 1 s an expert, the GPU 1 s, no fixed cost, 128 rows in steps of 64: with 1 cold pair the GPU would keep
    # it whole (a tie at 1 s); split at row 64 each side reads half of it: 0.5 s. With 2 cold pairs one each (1 s)
    # beats a split (1.5 s at best)
    take, rows = split_tables(2, 128, 64, 1.0, 0.0, 1.0)
    assert (take.tolist(), rows.tolist()) == ([0, 0, 1], [0, 64, 0])
    # a CPU kernel that reads FC2 whole (CpuQMoE.reads_rows_in_part false): its part of the split pair reads half of
    # FC1 (2/3 of an expert) and all of FC2 (1/3): 0.67 s against the GPU's 0.5, still sooner than 1 s whole ...
    take, rows = split_tables(2, 128, 64, 1.0, 0.0, 1.0, cpu_reads_fc2_whole=True)
    assert (take.tolist(), rows.tolist()) == ([0, 0, 1], [0, 64, 0])
    # ... and with a call's fixed cost of 0.4 s it is not (1.07 s against 1 s whole): the whole share as it was
    take, rows = split_tables(2, 128, 64, 1.0, 0.4, 1.0, cpu_reads_fc2_whole=True)
    assert take.tolist() == cpu_take_table(2, 1.0, 0.4, 1.0).tolist() and not rows.any()


def test_a_split_is_weighed_against_every_whole_share():
    """gpt-oss-20B-like at 0% on the sixty-sixth session's H200 host: the CPU 141 µs an expert + 75 µs a call, the
    GPU 289 µs. Whole, the CPU's 3 of 4 (498 µs) beat 2 (the GPU's 578); split, 2 whole and about half of the third
    end together at ~430 µs, which a split beside the whole share's 3 (the CPU's part only longer) never finds."""
    cpu, fixed, gpu = 141e-6, 75e-6, 289e-6
    assert cpu_take_table(4, cpu, fixed, gpu)[4] == 3
    take, rows = split_tables(4, 2880, 64, cpu, fixed, gpu)
    assert take[4] == 2 and rows[4] % 64 == 0
    r = rows[4] / 2880
    cpu_side, gpu_side = fixed + (2 + 1 - r) * cpu, (1 + r) * gpu
    assert max(cpu_side, gpu_side) < 435e-6 and abs(cpu_side - gpu_side) < 10e-6
    # the sixty-fifth session's H100 rates (183 µs + 54, the GPU 279): 2 whole and ~0.3 of the third on the CPU
    take, rows = split_tables(4, 2880, 64, 183e-6, 54e-6, 279e-6)
    assert take[4] == 2 and 0.6 < rows[4] / 2880 < 0.8
    # no row between the steps: the whole share
    take, rows = split_tables(8, 64, 64, 35e-6, 52e-6, 53e-6)
    assert take.tolist() == cpu_take_table(8, 35e-6, 52e-6, 53e-6).tolist() and not rows.any()


def test_spans_give_each_side_its_rows_of_the_split_pair():
    ids, codes = np.array([[5, 2, 7]]), np.array([[0, 129, 1]], np.int32)
    cpu, device = cpu_spans(ids, codes, 8, 192), device_spans(ids, codes, 8, 192)
    assert cpu[2].tolist() == [128, 192] and device[2].tolist() == [0, 128]
    assert (np.delete(cpu, 2, axis=0) == [0, 192]).all() and (np.delete(device, 2, axis=0) == [0, 192]).all()
    assert cpu_spans(ids, np.array([[0, 1, 1]]), 8, 192) is None
    assert gpu_rows_of_split(codes, 192) == pytest.approx(128 / 192)
