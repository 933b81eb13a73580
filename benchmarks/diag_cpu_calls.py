"""Diagnosis (GPU machine): where a CPU expert kernel call's fixed ~120 µs inside the engine goes.

RESULTS.md ("Two diagnoses", sixteenth session): inside a decode step a CPU kernel call costs ~120 µs plus ~42 µs
per expert (Qwen3-30B-A3B-like, 16 threads), where back-to-back calls of the node benchmark carry ~100 µs less.
Here, at each decode call of every node, three things are timed in a row, then the engine's own call runs as usual:
- an empty parallel region of the kernels' thread count (what waking the OpenMP threads costs by itself);
- the same kernel call on the same inputs into a scratch accumulator ("first": as the engine's call would run);
- that call again at once ("again": threads awake, the experts' rows just read).
Printed per experts-in-the-call: the medians of the three. "first" much above "again", with the empty region
taking the difference, says the threads' wake-up; "first" close to "again" says the cost is in the kernel itself.

    python3 benchmarks/diag_cpu_calls.py --shape qwen3-30b-a3b-like --layers 12 --fractions 0.25
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import SHAPES, decode  # noqa: E402
from benchmarks.bench_offload_ab import cpu_kernels, open_model  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402


def empty_region():
    """A parallel region with nothing to do, compiled once."""
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def touch(a):
        for i in prange(a.size):
            a[i] += 1.0
    return touch


def timed_kernels(model, rows: dict) -> None:
    """Every node's CPU kernel wrapped: per decode call, (empty region, first, again) seconds into rows[experts]."""
    touch = empty_region()
    import numba

    lanes = np.zeros(numba.get_num_threads(), np.float64)
    touch(lanes)
    for kernel in cpu_kernels(model):
        real = kernel.run_experts

        def run_experts(x2d, expert_ids, weights, out=None, real=real):
            if x2d.shape[0] == 1 and out is not None:
                experts = int(np.unique(expert_ids[expert_ids >= 0]).size)
                scratch = np.zeros_like(out)
                started = time.perf_counter()
                touch(lanes)
                woke = time.perf_counter()
                real(x2d, expert_ids, weights, out=scratch)
                first = time.perf_counter()
                real(x2d, expert_ids, weights, out=scratch)
                again = time.perf_counter()
                rows[experts].append((woke - started, first - woke, again - first))
            return real(x2d, expert_ids, weights, out=out)
        kernel.run_experts = run_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-like")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--fractions", default="0.25")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--folder")
    args = parser.parse_args()
    model, prompt = open_model(args.shape, args.layers, args.folder, prefix="diag-cpu-calls-")
    rows: dict = defaultdict(list)
    timed_kernels(model, rows)
    for fraction in [float(f) for f in args.fractions.split(",")]:
        rows.clear()
        model.offload.reconfigure(OffloadConfig(device_expert_bytes=int(fraction * all_resident_bytes(
            model.folder.experts))))
        rate, _ = decode(model, prompt, args.decode_tokens)
        print(f"{fraction:.0%} resident ({rate:.1f} tok/s with the extra calls), µs per call, median:", flush=True)
        for experts in sorted(rows):
            wake, first, again = (statistics.median(r[i] for r in rows[experts]) * 1e6 for i in range(3))
            print(f"   {experts} experts: empty region {wake:6.1f}   first {first:6.1f}   again {again:6.1f}   "
                  f"(n {len(rows[experts])})", flush=True)


if __name__ == "__main__":
    main()
