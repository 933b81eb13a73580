"""Adaptive placement's safe point: AdaptivePlacement.rebalance, judge included, per decode step.

rebalance runs at every decode step's end (OffloadEngine.end_step), while the GPU idles: its time is pure loss.
Qwen3-30B-A3B-like layers (128 experts, top-8) with half the experts resident (64 slots, 4 of them left to copied
misses), 48 layers by default. Routing: uniform (random weights: the judge pauses the swaps and watches the ones
placement would make, the usual state there) or realistic (anchors.md: swaps pay and are made); no limit, or the
swap allowance's few per safe point. Each case: the median seconds of a rebalance call after a warm-up, the
observe() calls of a step between calls (not timed).

    python benchmarks/bench_rebalance.py [--layers 48] [--steps 1000] [--warmup 400]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from engine.offload.placement import LayerSlots, make_policy  # noqa: E402
from engine.offload.traces import realistic_trace, uniform_trace  # noqa: E402

EXPERTS, K, SLOTS, MISS_SLOTS = 128, 8, 64, 4


def timed(trace: np.ndarray, limit: int | None, warmup: int) -> tuple[float, float, float]:
    """Median µs per rebalance call after `warmup` steps, swaps made per call, and the share of calls paused."""
    layers = [LayerSlots(EXPERTS, SLOTS) for _ in range(trace.shape[1])]
    policy = make_policy("adaptive", layers)
    policy.miss_slots = [MISS_SLOTS] * len(layers)
    for layer in range(len(layers)):
        policy.observe(layer, trace[0, layer])
    policy.initial()
    seconds, swaps, paused = [], 0, 0
    for step in range(1, trace.shape[0]):
        for layer in range(len(layers)):
            policy.observe(layer, trace[step, layer])
        was_paused = policy.judge.paused
        started = time.perf_counter()
        made = policy.rebalance(limit)
        if step >= warmup:
            seconds.append(time.perf_counter() - started)
            swaps += len(made)
            paused += was_paused
    return float(np.median(seconds)) * 1e6, swaps / len(seconds), paused / len(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=400)
    args = parser.parse_args()
    traces = {"uniform": uniform_trace(args.steps, args.layers, EXPERTS, K, seed=1),
              "realistic": realistic_trace(args.steps, args.layers, EXPERTS, K, seed=1)}
    print(f"{args.layers} layers x {EXPERTS} experts, {SLOTS} slots ({MISS_SLOTS} miss slots)")
    for routing, trace in traces.items():
        for limit in (None, 4):
            us, swaps, paused = timed(trace, limit, args.warmup)
            print(f"{routing:9s} routing, limit {str(limit):4s}: {us:7.1f} µs per safe point ({us / args.layers:.2f} "
                  f"a layer), {swaps:5.1f} swaps made per call, paused at {paused:4.0%} of them")


if __name__ == "__main__":
    main()
