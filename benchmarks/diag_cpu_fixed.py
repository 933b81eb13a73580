"""Diagnosis: what a CPU decode call's fixed cost is made of (issue #4 / #3).

diag_cpu_calls.py showed on the H200 machine's Xeon (16 threads, Qwen3-30B-A3B-like node) that a decode call of one
expert costs ~150 µs even when repeated at once on the same inputs ("again"), where the node benchmark's eight
experts cost 352 µs: the fixed part is in the call itself, not in waking threads. Here one node of that shape (B:
hidden 2048, intermediate 768, 128 experts, int4 block 32) is called for 1 token on u = 1, 2, 4, 8 experts at several
thread counts, and each call is taken apart (medians of --runs calls, µs):
- warm:     run_experts on the same experts again and again (weights in cache);
- cold:     run_experts on experts that rotate through all 128 (weights from DRAM, as in decode);
- kernel:   the compiled moe_gemv alone, with the arguments run_experts gave it (warm);
- python:   run_experts with moe_gemv replaced by a compiled function that takes the same arguments and does nothing
            (the wrapper's Python, group_pairs and Numba's dispatch of the kernel's arguments);
- dispatch: that do-nothing function alone;
- region:   an empty parallel region of the thread count.

With --knobs, each row is repeated for every (gemv_chunk_kb, gemv_schedule) pair given, e.g. 16:0,64:0,64:1.

    python benchmarks/diag_cpu_fixed.py [--threads 16,8,4,2] [--experts 1,2,4,8] [--runs 200] [--knobs KB:ORDER,...]
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
from kernels.cpu import kernels as compiled  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402
from kernels.qmoe_spec import QMoESpec  # noqa: E402

E, H, I = 128, 2048, 768


def median_us(call, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def compiled_helpers():
    from numba import njit, prange

    @njit(cache=False)
    def takes(*args):
        return 0

    @njit(parallel=True, cache=False)
    def region(a):
        for i in prange(a.size):
            a[i] += 1.0
    return takes, region


def node_of_shape_b(dtype=np.float32) -> CpuQMoE:
    """The node: shape B, int4 block 32, top-8 (bench_qmoe_cpu's weights); dtype float16: scales and biases in it, as
    float16 models carry them (bench_qmoe_cpu --dtype float16)."""
    attrs, tensors = make_layout_weights("int4", E, H, I)
    attrs["k"] = 8
    tensors = {k: v.astype(dtype, copy=False) if v.dtype == np.float32 else v for k, v in tensors.items()}
    return CpuQMoE(QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, H)), tensors)


def kernel_arguments(node, x: np.ndarray, experts: int) -> tuple:
    """The arguments run_experts passes moe_gemv for one token on experts 0 .. experts - 1."""
    captured = []
    real = compiled.moe_gemv
    compiled.moe_gemv = lambda *args: captured.append(args)
    try:
        node.run_experts(x, np.arange(experts, dtype=np.int64).reshape(1, experts),
                         np.full((1, experts), 1.0 / experts, np.float32))
    finally:
        compiled.moe_gemv = real
    return captured[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="16,8,4,2")
    parser.add_argument("--experts", default="1,2,4,8")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--knobs", default="", help="gemv_chunk_kb:gemv_schedule pairs (default: the node's own)")
    args = parser.parse_args()
    node = node_of_shape_b()
    takes, region = compiled_helpers()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H)).astype(np.float32)
    out = np.zeros((1, H), np.float32)
    real = compiled.moe_gemv
    print(f"node: hidden {H}, intermediate {I}, {E} experts, int4 block 32; 1 token; µs, medians of {args.runs}")
    knobs = [tuple(int(v) for v in pair.split(":")) for pair in args.knobs.split(",") if pair] or [
        (node.gemv_chunk_kb, node.gemv_schedule)]
    for threads, (chunk_kb, order) in ((t, k) for t in [int(t) for t in args.threads.split(",")] for k in knobs):
        node.num_threads = threads
        node.gemv_chunk_kb, node.gemv_schedule = chunk_kb, order
        use_threads(threads)
        lanes = np.zeros(threads)
        for u in [int(e) for e in args.experts.split(",")]:
            weights = np.full((1, u), 1.0 / u, np.float32)
            same = np.arange(u, dtype=np.int64).reshape(1, u)
            rotating = iter(np.arange(10 ** 6) % (E // u))

            def cold():
                start = next(rotating) * u
                node.run_experts(x, np.arange(start, start + u, dtype=np.int64).reshape(1, u), weights, out=out)

            arguments = kernel_arguments(node, x, u)
            compiled.moe_gemv = takes
            takes(*arguments)
            python = median_us(lambda: node.run_experts(x, same, weights, out=out), args.runs)
            compiled.moe_gemv = real
            node.run_experts(x, same, weights, out=out)
            region(lanes)
            row = {
                "warm": median_us(lambda: node.run_experts(x, same, weights, out=out), args.runs),
                "cold": median_us(cold, args.runs),
                "kernel": median_us(lambda: real(*arguments), args.runs),
                "python": python,
                "dispatch": median_us(lambda: takes(*arguments), args.runs),
                "region": median_us(lambda: region(lanes), args.runs),
            }
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
            print(f"{threads:3d} threads, chunks {chunk_kb} KB order {order}, {u} experts: {cells}", flush=True)


if __name__ == "__main__":
    main()
