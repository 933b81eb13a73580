"""Benchmark: how the CPU decode kernel scales with threads, with the experts in DRAM (cold) and in cache (hot).

The question it answers: is the CPU decode kernel (kernels.cpu.CpuQMoE, int4 block 32, one token) limited by
DRAM bandwidth or by its own instructions? For each thread count it times the same node
- cold: a routing sequence in which every expert comes back only after all the others (bench_qmoe_cpu's cold
  routing; more bytes between two uses than the caches hold),
- hot: one routing repeated, so the token's experts stay in the caches (shape A: 62 MB, B: 24 MB),
and the streaming read (the engine's Numba parallel sum) on the same number of threads. A kernel that runs no
faster hot than cold is not waiting on DRAM; one whose cold rate stops at the stream's is.

    python benchmarks/bench_cpu_scaling.py [--shape A|B] [--threads 1,2,4,8,16] [--calls 60]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: F401  (sets the OpenMP wait policy the engine's kernels run under)


def _median_call_s(kernel, xs, logits, calls: int, hot: bool) -> float:
    import numpy as np

    times = []
    for i in range(calls):
        j = 0 if hot else i % len(xs)
        started = time.perf_counter()
        kernel.forward(xs[j], logits[j])
        times.append(time.perf_counter() - started)
    return float(np.median(times[calls // 4:]))


def cold_call_s(kernel, xs, logits, calls: int) -> float:
    """Median seconds of `kernel`'s decode call on a cold routing (xs, logits: bench_qmoe_cpu.cold_decode_inputs),
    after one call that compiles and warms it (bench_offload's calibration times a model's experts so)."""
    kernel.forward(xs[0], logits[0])
    return _median_call_s(kernel, xs, logits, calls, hot=False)


def measure(shape: str, threads: list[int], calls: int) -> list[dict]:
    from benchmarks.bench_qmoe_cpu import cold_decode_node
    from engine.offload.host_bandwidth import stream_read_bandwidth
    from kernels.cpu import CpuQMoE
    from kernels.cpu.threads import use_threads

    node = cold_decode_node(shape)
    rows = []
    for n in threads:
        use_threads(n)
        stream = stream_read_bandwidth(1 << 30, 3)
        kernel = CpuQMoE(node.spec, node.tensors, num_threads=n)
        cold = cold_call_s(kernel, node.xs, node.logits, calls)
        hot = _median_call_s(kernel, node.xs, node.logits, calls, hot=True)
        rows.append({"threads": n, "stream_gbs": stream / 1e9, "cold_ms": cold * 1e3, "hot_ms": hot * 1e3,
                     "cold_gbs": node.nbytes / cold / 1e9, "hot_gbs": node.nbytes / hot / 1e9})
        r = rows[-1]
        print(f"{n:3d} threads: stream {r['stream_gbs']:6.1f} GB/s | cold {r['cold_ms']:7.3f} ms = "
              f"{r['cold_gbs']:6.1f} GB/s ({r['cold_gbs'] / r['stream_gbs']:4.0%} of stream) | hot {r['hot_ms']:7.3f} ms"
              f" = {r['hot_gbs']:6.1f} GB/s ({r['hot_gbs'] / r['cold_gbs']:.2f}x cold)", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="A", choices=("A", "B"))
    ap.add_argument("--threads", default="")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    ncpu = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({t for t in (1, 2, 4, 8, 12, 16, ncpu) if t <= ncpu}))
    rows = measure(args.shape, threads, args.calls)
    if not args.no_write:
        from benchmarks.bench_qmoe_cpu import machine_details
        from benchmarks.common import write_result

        figures = [{"name": f"CPU decode, shape {args.shape}, {r['threads']} threads, cold routing",
                    "value": r["cold_gbs"], "unit": "GB/s", "reference": "streaming read, same threads",
                    "reference_value": r["stream_gbs"], "ratio": r["cold_gbs"] / r["stream_gbs"],
                    "hot_gbs": r["hot_gbs"], "cold_ms": r["cold_ms"], "hot_ms": r["hot_ms"]} for r in rows]
        print(write_result(f"cpu-scaling-shape{args.shape}", figures, details=machine_details()))


if __name__ == "__main__":
    main()
