"""Sharing a decode step's cold experts between the GPU and the CPU at once (the offload engine's "both" decode path).

The GPU reads the experts in no slot from the host tier over PCIe (~50 GB/s on the H200 machine) while the CPU
computes some of them from host memory (~60-90 GB/s): anchors.md's bound for a miss assumes both. Per token, with c of
its k pairs cold, the CPU takes the last ``cpu_take[c]`` cold pairs in rank order (the smallest weights) and the GPU
the rest. ``split_cold_pairs`` is that rule in NumPy: the reference of the GPU's ``route_split`` kernel (route.cu),
and the rule of the simulated device and the tests' stand-in. ``cpu_take_table`` chooses the table from rates.

Pairs come whole there, so the two sides' parts seldom end together: at Qwen3-30B-A3B-like 0% on an H100 host the CPU's
4 of 8 cold pairs took 196 µs against the GPU's 232, 5 took 229 against 181 (RESULTS.md, sixty-fifth session). An
expert's output is the sum of its parts over the intermediate rows (the activation acts row by row, FC2 sums over
the rows), so one pair can be split: the GPU computes rows [0, r) of the GPU's last cold pair in rank order and the
CPU rows [r, I) of it, the two parts meeting in the merge's sum. ``split_tables`` chooses the share and r per count of
cold pairs (r 0: no pair split), ``split_cold_rows`` is the rule with it (route_split's reference). A decode step of one
token only: the GPU's decode kernels read a split pair's rows as their last tile (decode5.cu).
"""

from __future__ import annotations

import numpy as np


def split_cold_pairs(cold: np.ndarray, cpu_take: np.ndarray) -> np.ndarray:
    """Which pairs the CPU computes (bool [T, k]): per token the last cpu_take[c] of its c cold pairs (`cold`, bool
    [T, k], pairs in rank order)."""
    cold = np.asarray(cold, bool)
    counts = cold.sum(axis=1)
    take = np.asarray(cpu_take)[counts]
    from_end = np.cumsum(cold[:, ::-1], axis=1)[:, ::-1]  # cold pairs at this rank or later
    return cold & (from_end <= take[:, None])


def cpu_take_table(k: int, cpu_expert_s: float, cpu_fixed_s: float, gpu_expert_s: float,
                   host_s: float = 0.0) -> np.ndarray:
    """cpu_take[c] for c = 0..k cold pairs (int32 [k + 1]): the CPU's share n that makes the later of the two parts
    soonest, the CPU's part costing cpu_fixed_s + n * cpu_expert_s (nothing at n = 0), the GPU's (c - n) *
    gpu_expert_s; ties to the GPU (fewer pairs on the CPU). `host_s`: the host's own work after the CPU's part, before
    the GPU can go on to the next layer (the merge's queueing, the decoder, the next dense segment's launch): the
    GPU's part runs beside it, so it counts on the CPU's side, at n = 0 too (the host still waits for the routing)."""
    table = np.zeros(k + 1, np.int32)
    for c in range(k + 1):
        n = np.arange(c + 1)
        cpu = host_s + np.where(n > 0, cpu_fixed_s + n * cpu_expert_s, 0.0)
        table[c] = int(np.argmin(np.maximum(cpu, (c - n) * gpu_expert_s)))  # the first (smallest n) of equal times
    return table


def split_cold_rows(cold: np.ndarray, cpu_take: np.ndarray, split_rows: np.ndarray) -> np.ndarray:
    """split_cold_pairs with a pair split by rows (int32 [T, k]): 0 the GPU computes the pair, 1 the CPU does, r + 1
    (r > 0) the GPU computes its intermediate rows [0, r) and the CPU the rest. Per token with c cold pairs and
    split_rows[c] > 0, the cold pair before the CPU's last cpu_take[c] (the GPU's last in rank order) is split, where
    the GPU has one; only in a step of one token (T = 1), else as split_cold_pairs."""
    on_cpu = split_cold_pairs(cold, cpu_take).astype(np.int32)
    cold = np.asarray(cold, bool)
    if cold.shape[0] != 1:
        return on_cpu
    c = int(cold[0].sum())
    rows = int(np.asarray(split_rows)[c])
    gpu_cold = np.flatnonzero(cold[0] & (on_cpu[0] == 0))
    if rows > 0 and gpu_cold.size:
        on_cpu[0, gpu_cold[-1]] = rows + 1
    return on_cpu


def split_tables(k: int, inter: int, row_step: int, cpu_expert_s: float, cpu_fixed_s: float, gpu_expert_s: float,
                 host_s: float = 0.0, fc1_share: float = 2 / 3,
                 cpu_reads_fc2_whole: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(cpu_take, split_rows) for c = 0..k cold pairs (int32 [k + 1] each): cpu_take_table's share, or where a split
    pair makes the later of the two parts sooner, the CPU's whole pairs n beside it and the rows r (a multiple of
    `row_step` in (0, inter)) of the split pair that the GPU computes; split_rows[c] 0 where no pair is split. The
    costs as cpu_take_table's; the GPU's part of a split pair costs r / inter of an expert (it reads FC1's first r rows
    and FC2's first r columns), the CPU's (1 - r / inter), or with `cpu_reads_fc2_whole` (CpuQMoE.reads_rows_in_part
    false) (1 - r / inter) of FC1 (`fc1_share` of an expert's bytes) and all of FC2. A split is weighed against every
    whole share, not only the best one's neighbour: at gpt-oss-20B-like 0% (the CPU 141 µs an expert + 75 a call, the
    GPU 289) 3 of 4 whole on the CPU end at 498 µs, 2 and half of the third at ~430."""
    take = cpu_take_table(k, cpu_expert_s, cpu_fixed_s, gpu_expert_s, host_s)
    rows = np.zeros(k + 1, np.int32)
    r = np.arange(row_step, inter, row_step)
    if r.size == 0:
        return take, rows
    cpu_part = fc1_share * (1 - r / inter) + (1 - fc1_share) if cpu_reads_fc2_whole else 1 - r / inter
    for c in range(1, k + 1):
        n = int(take[c])
        best = max(host_s + (cpu_fixed_s + n * cpu_expert_s if n else 0.0), (c - n) * gpu_expert_s)
        for whole in range(c):  # the CPU's whole pairs beside the split one; the GPU keeps c - whole - 1 and r rows
            cpu = host_s + cpu_fixed_s + (whole + cpu_part) * cpu_expert_s
            gpu = (c - whole - 1 + r / inter) * gpu_expert_s
            later = np.maximum(cpu, gpu)
            at = int(np.argmin(later))
            if later[at] < best:
                best, take[c], rows[c] = later[at], whole, r[at]
    return take, rows


ROW_STEP = 64  # a split pair's rows in multiples of the GPU decode kernels' k-tile (FC2's intermediate 64 a tile)


def fc1_share(gated: bool) -> float:
    """FC1's share of an expert's bytes: 2 I x H of 3 I x H gated (gate and up), else I x H of 2 I x H."""
    return 2 / 3 if gated else 1 / 2


def cpu_spans(ids: np.ndarray, codes: np.ndarray, num_experts: int, inter: int) -> np.ndarray | None:
    """CpuQMoE.run_experts' spans for the CPU's part of a step whose pairs split_cold_rows coded: a split pair's
    expert from its row r on, every other expert whole; None where no pair is split."""
    return _spans(ids, codes, num_experts, inter, cpu=True)


def device_spans(ids: np.ndarray, codes: np.ndarray, num_experts: int, inter: int) -> np.ndarray | None:
    """The same for the GPU's part: a split pair's expert up to its row r."""
    return _spans(ids, codes, num_experts, inter, cpu=False)


def _spans(ids, codes, num_experts: int, inter: int, cpu: bool):
    split = np.asarray(codes) > 1
    if not split.any():
        return None
    spans = np.zeros((num_experts, 2), np.int64)
    spans[:, 1] = inter
    for e, code in zip(np.asarray(ids)[split], np.asarray(codes)[split]):
        spans[e] = (code - 1, inter) if cpu else (0, code - 1)
    return spans


def gpu_rows_of_split(codes: np.ndarray, inter: int) -> float:
    """The GPU's share of the split pairs in a step's codes (split_cold_rows), in experts: the sum of r / inter."""
    codes = np.asarray(codes)
    return float((codes[codes > 1] - 1).sum()) / inter
