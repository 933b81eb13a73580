"""benchmarks/bench_zero_copy.py: the router logits that give each token exactly c cold pairs (the GPU parts need a
GPU and run on the GPU machine)."""

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.bench_zero_copy import cold_bank
from kernels.reference import route


@pytest.mark.parametrize("cold", [0, 1, 2, 4, 8])
def test_every_rows_top_k_holds_exactly_c_experts_in_no_slot_and_the_rows_differ(cold):
    E, k, resident = 128, 8, 32
    bank = cold_bank(np.random.default_rng(0), E, k, resident, cold, rows=64)
    top = np.argsort(-bank, axis=1)[:, :k]
    assert bank.dtype == np.float32 and bank.shape == (64, E)
    assert ((top >= resident).sum(axis=1) == cold).all()
    assert len({tuple(sorted(row)) for row in top}) > 32  # different experts in different rows
    # the reference routing (softmax, top-k) picks the same experts
    spec = SimpleNamespace(num_experts=E, k=k, use_sparse_mixer=False, normalize_routing_weights=True)
    ids, _weights = route(bank, spec)
    assert (np.sort(ids, axis=1) == np.sort(top, axis=1)).all()
