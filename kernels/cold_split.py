"""Sharing a decode step's cold experts between the GPU and the CPU at once (the offload engine's "both" decode path).

The GPU reads the experts in no slot from the host tier over PCIe (~50 GB/s on the H200 machine) while the CPU
computes some of them from host memory (~60-90 GB/s): anchors.md's bound for a miss assumes both. Per token, with c of
its k pairs cold, the CPU takes the last ``cpu_take[c]`` cold pairs in rank order (the smallest weights) and the GPU
the rest. ``split_cold_pairs`` is that rule in NumPy: the reference of the GPU's ``route_split`` kernel (route.cu),
and the rule of the simulated device and the tests' stand-in. ``cpu_take_table`` chooses the table from rates.
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
