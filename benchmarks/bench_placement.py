"""Which placement policy? Hit rates of resident experts on routing traces that behave like real
routing (anchors.md: strong recency, mild popularity) and on uniform routing (random weights).

Compares the adaptive policy (decayed hit counts with hysteresis; the default judges its swaps and stops making
them where they earn less than a hit each: engine/offload/swap_judge.py) with the same policy making every swap,
static placement from measured popularity, pure LFU (no decay) and near-LRU (fast decay), at several slot budgets,
for gpt-oss-20b-like (32 experts, top-4) and Qwen3-30B-A3B-like (128, top-8) layers. Each cell: the hit rate after
the warm-up and the swaps per layer per token.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from engine.offload.placement import AdaptivePlacement, StaticPlacement, make_policy  # noqa: E402
from engine.offload.traces import realistic_trace, replay, uniform_trace  # noqa: E402

WARMUP = 100


POLICIES = {
    "adaptive, judged (the default)": lambda layers: make_policy("adaptive", layers),
    "adaptive, every swap made": lambda layers: AdaptivePlacement(layers),
    "near-LRU (decay 0.5)": lambda layers: AdaptivePlacement(layers, decay=0.5, margin=1.0, max_swaps=64),
    "LFU (no decay)": lambda layers: AdaptivePlacement(layers, decay=1.0, margin=1.0, max_swaps=64),
    "static (warm-up popularity)": lambda layers: StaticPlacement(layers),
}


def main() -> None:
    figures = []
    print(f"{'shape':22s} {'routing':10s} {'slots':>6s}  " + "  ".join(f"{n[:26]:>26s}" for n in POLICIES))
    for shape, experts, k in (("gpt-oss-20b-like", 32, 4), ("qwen3-30b-a3b-like", 128, 8)):
        for routing, trace in (("realistic", realistic_trace(1500, 4, experts, k, seed=7)),
                               ("uniform", uniform_trace(800, 4, experts, k, seed=7))):
            for fraction in (0.125, 0.25, 0.5, 0.75):
                slots = max(k, int(fraction * experts))
                rates = {name: replay(make, trace, experts, slots, WARMUP) for name, make in POLICIES.items()}
                print(f"{shape:22s} {routing:10s} {slots:6d}  " + "  ".join(f"{r[0]:18.3f} ({r[1]:4.2f}/t)" for r in rates.values()))
                static = rates["static (warm-up popularity)"][0]
                adaptive_name = next(iter(POLICIES))
                figures.append({"name": f"hit rate, {shape}, {routing} routing, {slots}/{experts} slots, {adaptive_name}",
                                "value": rates[adaptive_name][0], "unit": "fraction of routed experts resident",
                                "reference": "static placement from warm-up popularity", "reference_value": static,
                                "ratio": rates[adaptive_name][0] / static if static else None,
                                "others": {name: {"hit_rate": r[0], "swaps_per_layer_per_token": r[1]}
                                           for name, r in rates.items()}})
    path = write_result("placement", figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
