"""A step's routed (token, k) pairs sorted by residency in one compiled call (issue #4).

The hybrid node's per-layer bookkeeping on a decode step's few pairs was ~8 NumPy calls (the residency lookup, its
counts, the per-expert statistics' np.add.at, the cold ids, the distinct residents and misses), each 5-10 µs with the
caches cold after a kernel. classify_pairs does the same in one pass; tests/test_step_pairs.py checks it against those
NumPy expressions on random steps.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NO_COUNTS = np.zeros(0, np.int64)  # classify_pairs' counts when nothing is counted (a shadow pass)


@njit(cache=True, nogil=True)
def classify_pairs(ids, slot_of, counts, count):
    """ids [T, k] (-1: an unrouted pair), slot_of [E] (-1: cold). Returns

        resident        bool [T, k]: routed to an expert in a slot
        cold            ids' dtype [T, k]: the id where not resident, else -1
        hits, missed    resident pairs, routed pairs not resident
        residents       distinct experts of the resident pairs
        miss_experts    int64, the distinct experts of the missed pairs, ascending
        miss_tokens     int64, the pairs routed to each of them

    and, when `count`, adds each routed pair to counts [hits per expert | misses per expert] (OffloadStats.count)."""
    E = slot_of.size
    resident = np.zeros(ids.shape, np.bool_)
    cold = np.full(ids.shape, -1, ids.dtype)
    pairs_of = np.zeros(E, np.int64)  # per expert: its missed pairs, or -1 for a resident one
    hits = missed = residents = 0
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            expert = ids[t, j]
            if expert < 0:
                continue
            if slot_of[expert] >= 0:
                resident[t, j] = True
                hits += 1
                if pairs_of[expert] == 0:
                    pairs_of[expert] = -1
                    residents += 1
                if count:
                    counts[expert] += 1
            else:
                cold[t, j] = expert
                missed += 1
                pairs_of[expert] += 1
                if count:
                    counts[E + expert] += 1
    distinct = 0
    for expert in range(E):
        if pairs_of[expert] > 0:
            distinct += 1
    miss_experts = np.empty(distinct, np.int64)
    miss_tokens = np.empty(distinct, np.int64)
    n = 0
    for expert in range(E):
        if pairs_of[expert] > 0:
            miss_experts[n] = expert
            miss_tokens[n] = pairs_of[expert]
            n += 1
    return resident, cold, hits, missed, residents, miss_experts, miss_tokens


@njit(cache=True, nogil=True)
def split_pairs(ids, on_cpu, slot_of, counts, count):
    """A "both" step's pairs (HybridExpertNode.account_split), or with on_cpu all False a tier step's
    (account_resident): ids [T, k] (-1: unrouted), on_cpu bool [T, k] (the pairs the CPU computed), slot_of [E].
    Returns

        resident        bool [T, k]: routed to an expert in a slot
        hits            resident pairs
        cpu_pairs       routed pairs the CPU computed
        cpu_experts     int64, the distinct experts of those pairs, ascending
        gpu_experts     distinct experts of the other routed pairs
        gpu_held        those of them in a slot

    and, when `count`, adds each routed pair to counts [hits per expert | misses per expert] (OffloadStats.count)."""
    E = slot_of.size
    resident = np.zeros(ids.shape, np.bool_)
    side = np.zeros(E, np.int8)  # per expert: 1 the CPU computed a pair of it, 2 the GPU did, 3 both
    hits = cpu_pairs = 0
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            expert = ids[t, j]
            if expert < 0:
                continue
            held = slot_of[expert] >= 0
            if held:
                resident[t, j] = True
                hits += 1
            if count:
                counts[expert if held else E + expert] += 1
            if on_cpu[t, j]:
                cpu_pairs += 1
                side[expert] |= 1
            else:
                side[expert] |= 2
    distinct = gpu_experts = gpu_held = 0
    for expert in range(E):
        if side[expert] & 1:
            distinct += 1
        if side[expert] & 2:
            gpu_experts += 1
            if slot_of[expert] >= 0:
                gpu_held += 1
    cpu_experts = np.empty(distinct, np.int64)
    n = 0
    for expert in range(E):
        if side[expert] & 1:
            cpu_experts[n] = expert
            n += 1
    return resident, hits, cpu_pairs, cpu_experts, gpu_experts, gpu_held


@njit(cache=True, nogil=True)
def take_copied(ids, cold, copied):
    """The pairs of `cold` routed to one of the `copied` experts (a decode step's few) go to the device with the
    resident ones. Returns (the device's ids: ids where resident or copied, else -1; cold without those pairs; the
    pairs taken), in ids' dtype: what a mask of the copied pairs, a count and two np.where gave."""
    device_ids = np.full(ids.shape, -1, ids.dtype)
    rest = cold.copy()
    taken = 0
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                continue  # unrouted
            expert = cold[t, j]
            if expert >= 0:
                if expert not in copied:
                    continue
                rest[t, j] = -1
                taken += 1
            device_ids[t, j] = ids[t, j]
    return device_ids, rest, taken


@njit(cache=True, nogil=True)
def count_routed(ids, counts):
    """Every routed pair of ids [T, k] (-1: unrouted) added to counts [E] by expert: a step whose experts were all
    resident, counted into the layer's hits per expert (what OffloadStats.count did with a mask of every pair, in
    three NumPy calls). Returns the pairs counted."""
    counted = 0
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            expert = ids[t, j]
            if expert >= 0:
                counts[expert] += 1
                counted += 1
    return counted
