"""Diagnosis (GPU machine): do the miss policy's copies slow the CPU expert kernels that run beside them?

NOTES-overhead.md ("Sixteenth session"): inside the engine at 25-50% resident, a CPU kernel call takes ~45 µs more
than the 0% rate predicts for its bytes, and CpuRate's fit reads it as a fixed cost per call; at those points the
copies' DMA reads host memory while the kernel streams it. Here one loaded model alternates, in rounds at each
resident fraction, between the miss policy as it is and one that copies nothing (HybridExpertNode._copy_misses
answering "none"), and every CPU kernel call is timed with its experts' bytes: µs per call by experts in the call,
and GB/s, for both.

    python3 benchmarks/diag_copy_contention.py --shape qwen3-30b-a3b-like --layers 12 --fractions 0.25,0.5
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
from benchmarks.bench_offload_ab import open_model  # noqa: E402
from engine.offload import OffloadConfig, hybrid_node  # noqa: E402
from engine.offload.hybrid_node import HybridExpertNode  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402


def timed_kernels(model, sink: list) -> None:
    """Every node's CPU kernel timed in decode: (experts in the call, bytes of their weights, seconds) appended to
    `sink[0]`."""
    for runner in model.decoder.steps:
        if not isinstance(runner, HybridExpertNode):
            continue
        kernel, per_expert = runner.kernel, runner.info.bytes_per_expert
        real = kernel.run_experts

        def run_experts(x2d, expert_ids, weights, out=None, real=real, per_expert=per_expert):
            experts = int(np.unique(expert_ids[expert_ids >= 0]).size)
            started = time.perf_counter()
            result = real(x2d, expert_ids, weights, out=out)
            if x2d.shape[0] == 1:  # decode steps only (the prompt's calls carry many tokens)
                sink[0].append((experts, experts * per_expert, time.perf_counter() - started))
            return result
        kernel.run_experts = run_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-like")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=12)
    parser.add_argument("--folder")
    args = parser.parse_args()
    model, prompt = open_model(args.shape, args.layers, args.folder, prefix="diag-copy-")
    real_copy = HybridExpertNode._copy_misses
    sink: list = [[]]
    timed_kernels(model, sink)
    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = int(fraction * all_resident_bytes(model.folder.experts))
        by_variant = {"copies": defaultdict(list), "no copies": defaultdict(list)}
        rates = defaultdict(list)
        for r in range(args.rounds):
            for name in ("copies", "no copies") if r % 2 == 0 else ("no copies", "copies"):
                HybridExpertNode._copy_misses = real_copy if name == "copies" else (lambda self, *a: hybrid_node._NONE)
                model.offload.reconfigure(OffloadConfig(device_expert_bytes=budget))
                calls = sink[0] = []
                rate, _ = decode(model, prompt, args.decode_tokens)
                rates[name].append(rate)
                for experts, nbytes, seconds in calls:
                    by_variant[name][min(experts, 5)].append((nbytes, seconds))
        HybridExpertNode._copy_misses = real_copy
        print(f"{fraction:.0%} resident: decode tok/s copies {statistics.median(rates['copies']):.1f}, "
              f"no copies {statistics.median(rates['no copies']):.1f}", flush=True)
        for name, groups in by_variant.items():
            cells = []
            for experts in sorted(groups):
                rows = groups[experts]
                us = statistics.median(s for _, s in rows) * 1e6
                gbs = sum(b for b, _ in rows) / sum(s for _, s in rows) / 1e9
                cells.append(f"{experts}{'+' if experts == 5 else ''}: {us:6.0f} µs {gbs:5.1f} GB/s (n {len(rows)})")
            print(f"   {name:9s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
