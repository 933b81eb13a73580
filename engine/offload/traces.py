"""Synthetic routing traces that behave like real MoE routing (shared/reference/anchors.md).

Per layer: a live set of 50-60% of the experts with mild Zipf popularity (s ~ 0.45), a sticky
recency process (a token often repeats experts of the last few tokens), a rare tail outside the
live set, and occasional topic switches that move the live set. Random-weight models route
almost uniformly instead: the worst case for any cache.
"""

from __future__ import annotations

import numpy as np


SWITCH_EVERY = 400  # tokens between topic switches


def realistic_trace(num_tokens: int, num_layers: int, num_experts: int, k: int, seed: int = 0,
                    live_fraction: float = 0.55, zipf_s: float = 0.45, repeat_p: float = 0.8,
                    recent_window: int = 8, tail_p: float = 0.03,
                    switch_every: int = SWITCH_EVERY) -> np.ndarray:
    """Expert ids [tokens, layers, k] (distinct within a token)."""
    rng = np.random.default_rng(seed)
    trace = np.empty((num_tokens, num_layers, k), np.int32)
    live_size = max(k, int(round(live_fraction * num_experts)))
    for layer in range(num_layers):
        live = rng.permutation(num_experts)[:live_size]
        popularity = 1.0 / np.arange(1, live_size + 1) ** zipf_s
        popularity /= popularity.sum()
        recent: list[int] = []
        for t in range(num_tokens):
            if switch_every and t and t % switch_every == 0:  # topic switch: a third of the live set moves
                moved = rng.choice(live_size, live_size // 3, replace=False)
                outside = np.setdiff1d(np.arange(num_experts), live)
                live[moved] = rng.choice(outside, len(moved), replace=len(outside) < len(moved))
            chosen: list[int] = []
            while len(chosen) < k:
                draw = rng.random()
                if recent and draw < repeat_p:
                    expert = recent[rng.integers(len(recent))]
                elif draw < repeat_p + tail_p:
                    expert = int(rng.integers(num_experts))
                else:
                    expert = int(live[rng.choice(live_size, p=popularity)])
                if expert not in chosen:
                    chosen.append(expert)
            trace[t, layer] = chosen
            recent = (recent + chosen)[-recent_window * k:]
    return trace


def uniform_trace(num_tokens: int, num_layers: int, num_experts: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(num_experts, k, replace=False) for _ in range(num_layers)]
                     for _ in range(num_tokens)]).astype(np.int32)


def replay(make_policy, trace: np.ndarray, num_experts: int, slots: int, warmup: int = 50) -> tuple[float, float]:
    """Replay a trace through a placement policy: (fraction of routed experts found resident after
    the warm-up, swaps per layer per token). Static placement is fixed from the warm-up's counts (its opening is the
    warm-up here, whatever its own rule would say)."""
    from engine.offload.placement import LayerSlots, StaticPlacement

    layers = [LayerSlots(num_experts, slots) for _ in range(trace.shape[1])]
    policy = make_policy(layers)
    static = isinstance(policy, StaticPlacement)
    hits = total = swaps = 0
    for t in range(trace.shape[0]):
        for layer in range(trace.shape[1]):
            ids = trace[t, layer]
            if t >= warmup:
                hits += int(np.count_nonzero(layers[layer].slot_of[ids] >= 0))
                total += ids.size
            policy.observe(layer, ids)
        if static and t + 1 < warmup:
            continue
        if static and t + 1 == warmup:
            policy.choose()
        moved = len(policy.rebalance())
        swaps += moved if t >= warmup else 0
    return hits / max(1, total), swaps / max(1, (trace.shape[0] - warmup) * trace.shape[1])


def hit_rate(policy_name: str, trace: np.ndarray, num_experts: int, slots: int, warmup: int = 50) -> float:
    from engine.offload.placement import make_policy

    return replay(lambda layers: make_policy(policy_name, layers), trace, num_experts, slots, warmup)[0]
