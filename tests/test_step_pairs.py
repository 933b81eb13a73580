"""step_pairs' compiled passes against the NumPy expressions they replaced in the hybrid node and OffloadStats.count."""

import numpy as np
import pytest

from engine.offload.step_pairs import NO_COUNTS, classify_pairs, count_routed, split_pairs, take_copied
from engine.offload.stats import OffloadStats


def numpy_classify(ids, slot_of, stats: OffloadStats):
    """The hybrid node's former NumPy bookkeeping (hybrid_node.py before the fourth overhead pass)."""
    routed = ids >= 0
    resident = (slot_of[ids] >= 0) & routed
    hits = int(np.count_nonzero(resident))
    missed = int(np.count_nonzero(routed)) - hits
    stats.count(0, ids, resident, routed)
    cold = np.where(resident, -1, ids)
    residents = len(set(ids[resident].tolist()))
    experts, tokens = np.unique(cold[cold >= 0], return_counts=True)
    return resident, cold, hits, missed, residents, experts, tokens


def random_step(rng, experts: int) -> np.ndarray:
    """A decode or short prefill step's routed ids [T, k] (distinct experts per token), some pairs unrouted (-1) as
    approximate routing leaves them in some steps."""
    tokens, k = int(rng.integers(1, 9)), int(rng.integers(1, min(8, experts) + 1))
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[rng.random(ids.shape) < rng.choice([0.0, 0.2])] = -1
    return ids


def fresh_stats(experts: int) -> tuple[OffloadStats, OffloadStats]:
    """Two OffloadStats of one layer: the reference's and the compiled pass's."""
    pair = OffloadStats(), OffloadStats()
    for stats in pair:
        stats.reset(1, [experts])
    return pair


@pytest.mark.parametrize("seed", range(6))
def test_classify_pairs_equals_the_numpy_bookkeeping(seed):
    rng = np.random.default_rng(seed)
    experts = int(rng.choice([8, 32, 128]))
    stats_ref, stats_new = fresh_stats(experts)
    for _ in range(200):
        ids = random_step(rng, experts)
        slot_of = np.full(experts, -1, np.int32)
        resident_experts = rng.choice(experts, int(rng.integers(0, experts + 1)), replace=False)
        slot_of[resident_experts] = np.arange(resident_experts.size)
        expected = numpy_classify(ids, slot_of, stats_ref)
        got = classify_pairs(ids, slot_of, stats_new.pair_counts(0), True)
        for mine, theirs in zip(got, expected):
            np.testing.assert_array_equal(mine, theirs)
        assert got[1].dtype == ids.dtype and got[0].dtype == bool
        np.testing.assert_array_equal(stats_new.expert_hits[0], stats_ref.expert_hits[0])
        np.testing.assert_array_equal(stats_new.expert_misses[0], stats_ref.expert_misses[0])


@pytest.mark.parametrize("seed", range(4))
def test_split_pairs_equals_the_numpy_bookkeeping_of_a_both_step(seed):
    """split_pairs against account_split's former NumPy expressions: residency, hits, the CPU's pairs and distinct
    experts, the GPU side's distinct experts and those of them in a slot, the per-expert counts."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        experts = int(rng.choice([8, 32, 128]))
        stats_ref, stats_new = fresh_stats(experts)
        ids = random_step(rng, experts)
        on_cpu = (rng.random(ids.shape) < rng.random()) & (ids >= 0)
        slot_of = np.where(rng.random(experts) < rng.random(), 0, -1).astype(np.int32)
        routed = ids >= 0
        resident = (slot_of[ids] >= 0) & routed
        stats_ref.count(0, ids, resident, routed)
        on_gpu = np.unique(ids[~on_cpu & routed])
        got = split_pairs(ids, on_cpu, slot_of, stats_new.pair_counts(0), True)
        np.testing.assert_array_equal(got[0], resident)
        assert got[1:3] == (int(resident.sum()), int(on_cpu.sum()))
        assert got[3].dtype == np.int64 and got[3].tolist() == np.unique(ids[on_cpu]).tolist()
        assert got[4:] == (on_gpu.size, int((slot_of[on_gpu] >= 0).sum()))
        np.testing.assert_array_equal(stats_new.pair_counts(0), stats_ref.pair_counts(0))
    untouched = np.zeros(16, np.int64)
    split_pairs(np.array([[1, 2]], np.int32), np.array([[True, False]]), np.full(8, -1, np.int32), untouched, False)
    assert not untouched.any()


def test_classify_pairs_counts_nothing_when_told_not_to():
    ids = np.array([[0, 3], [1, 3]], np.int32)
    slot_of = np.array([0, -1, -1, 1], np.int32)
    resident, cold, hits, missed, residents, experts, tokens = classify_pairs(ids, slot_of, NO_COUNTS, False)
    assert (hits, missed, residents) == (3, 1, 2)
    assert cold.tolist() == [[-1, -1], [1, -1]] and experts.tolist() == [1] and tokens.tolist() == [1]
    assert NO_COUNTS.size == 0


@pytest.mark.parametrize("seed", range(4))
def test_take_copied_equals_the_numpy_masks(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        experts = int(rng.choice([8, 32, 128]))
        ids = random_step(rng, experts)
        slot_of = np.where(rng.random(experts) < rng.random(), 0, -1).astype(np.int32)
        resident, cold, *_rest, misses, _tokens = classify_pairs(ids, slot_of, NO_COUNTS, False)
        copied = np.sort(rng.choice(misses, int(rng.integers(0, misses.size + 1)), replace=False)) if misses.size \
            else np.empty(0, np.int64)
        chosen = np.zeros(experts + 1, bool)  # the hybrid node's former _pairs_of, count and np.where
        chosen[copied] = True
        in_copied = chosen[cold]
        device_ids, rest, taken = take_copied(ids, cold, copied.astype(np.int64))
        np.testing.assert_array_equal(device_ids, np.where(resident | in_copied, ids, -1))
        np.testing.assert_array_equal(rest, np.where(in_copied, -1, cold))
        assert taken == int(np.count_nonzero(in_copied))
        assert device_ids.dtype == rest.dtype == ids.dtype


@pytest.mark.parametrize("seed", range(3))
def test_count_routed_equals_counting_every_pair_resident(seed):
    """A fully resident layer's step (HybridExpertNode.account_resident): what OffloadStats.count did with a mask of
    every pair, the misses' half untouched."""
    rng = np.random.default_rng(seed)
    experts = int(rng.choice([8, 32, 128]))
    stats_ref, stats_new = fresh_stats(experts)
    for _ in range(100):
        ids = random_step(rng, experts)
        stats_ref.count(0, ids, np.ones(ids.shape, bool))
        assert count_routed(ids, stats_new.expert_hits[0]) == int(np.count_nonzero(ids >= 0))
    np.testing.assert_array_equal(stats_new.expert_hits[0], stats_ref.expert_hits[0])
    assert stats_new.expert_hits[0].sum() > 0 and not stats_new.expert_misses[0].any()
