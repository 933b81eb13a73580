"""Diagnosis: the CPU decode kernel's rate with its weights in a core's L2, in L3 and in DRAM (issue #3).

At Qwen3-30B-A3B's shape the decode kernel reads ~6 GB/s of weights a core on the H200 machine's Xeon, and as fast
with the node in L3 ("hot") as from DRAM (NOTES-cpu-kernels.md, "Forty-fifth session"), so DRAM's rate does not bound
it there: either its instructions do, or the reads a core keeps in flight. A working set inside one core's L2 tells
them apart. One node of hidden 2048 and intermediate 384 (Qwen's FC1 rows of 1,024 bytes; ~1.5 MB an expert, int4
block 32, float32 scales) is called for 1 token on one expert at a time, on each thread count of --threads:
- l2: the same expert again and again (inside the 2 MB L2 of one of that Xeon's cores);
- l3: 8 experts in turn (~12 MB: out of L2, inside L3);
- dram: all --experts in turn (512: ~750 MB, more than that Xeon's 300 MiB L3).
Each cell: the median run_experts call (µs, its Python included) and the expert's bytes over it (GB/s).

    python benchmarks/diag_cpu_levels.py [--threads 1,16] [--experts 512] [--runs 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  the engine's OpenMP wait default, set before Numba's runtime loads
from benchmarks.bench_qmoe_cpu import make_layout_weights  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402
from kernels.qmoe_spec import QMoESpec  # noqa: E402

H, I = 2048, 384
LEVELS = (("l2", 1), ("l3", 8), ("dram", None))  # (name, experts in the rotation; None: all of them)


def expert_bytes(tensors: dict, experts: int) -> float:
    """Bytes of one expert's weights and scales (what a decode call on it reads)."""
    names = ("fc1_experts_weights", "fc1_scales", "fc2_experts_weights", "fc2_scales")
    return sum(tensors[name].nbytes for name in names) / experts


def median_call_s(node: CpuQMoE, x: np.ndarray, out: np.ndarray, span: int, runs: int) -> float:
    """Median seconds of a one-token call on expert i % span for i = 0, 1, ..., after one pass over the span."""
    weights = np.ones((1, 1), np.float32)
    ids = np.zeros((1, 1), np.int64)
    times = []
    for i in range(span + runs):
        ids[0, 0] = i % span
        started = time.perf_counter()
        node.run_experts(x, ids, weights, out=out)
        if i >= span:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    attrs, tensors = make_layout_weights("int4", args.experts, H, I)
    attrs["k"] = 1
    node = CpuQMoE(QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, H)), tensors)
    per_expert = expert_bytes(tensors, args.experts)
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    out = np.zeros((1, H), np.float32)
    print(f"node: hidden {H}, intermediate {I}, {args.experts} experts, int4 block 32, float32 scales; "
          f"{per_expert / 1e6:.2f} MB an expert; 1 token, one expert a call; medians of {args.runs} calls")
    for threads in [int(t) for t in args.threads.split(",")]:
        node.num_threads = threads
        use_threads(threads)
        cells = []
        for level, span in LEVELS:
            seconds = median_call_s(node, x, out, span or args.experts, args.runs)
            cells.append(f"{level} {seconds * 1e6:7.1f} µs = {per_expert / seconds / 1e9:5.1f} GB/s")
        print(f"{threads:3d} threads: " + "  |  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
