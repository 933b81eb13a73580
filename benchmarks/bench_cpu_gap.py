"""Benchmark: the CPU decode kernel called back to back, against called with a pause between calls (as in the engine).

In the offload engine the CPU expert kernels read experts 1.4-2x slower than the node benchmarks, which call the
kernel back to back, and bench_expert_backing ruled out the pages the experts live in. In the engine each call
follows a few hundred µs of other work (the dense part on the GPU, Python), during which Numba's OpenMP threads wait:
passively (futex sleep) since the engine sets OMP_WAIT_POLICY=PASSIVE (engine/__init__.py), so each call wakes them,
and cores left idle may drop into deeper sleep states. This benchmark times the same node (kernels.cpu.CpuQMoE, int4
block 32, cold routing) with no pause, a sleeping pause and a busy pause between calls, each under OpenMP wait
policies set before the OpenMP runtime loads (one child process each), and reports GB/s of weights read against the
streaming read bandwidth measured in the same child.

    python benchmarks/bench_cpu_gap.py [--shape A|B] [--gap-us 400] [--policies PASSIVE,ACTIVE,spin200k]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLICIES = {  # name -> environment set before the OpenMP runtime loads
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "spin200k": {"GOMP_SPINCOUNT": "200000"},
    "spin1M": {"GOMP_SPINCOUNT": "1000000"},
    "spin3M": {"GOMP_SPINCOUNT": "3000000"},
    "spin30M": {"GOMP_SPINCOUNT": "30000000"},
}


def child(shape: str, gap_s: float, calls: int) -> dict:
    import numpy as np

    from benchmarks.bench_qmoe_cpu import cold_decode_node
    from benchmarks.common import stream_read_bandwidth
    from kernels.cpu import CpuQMoE

    stream = stream_read_bandwidth() * 1e9
    node = cold_decode_node(shape)
    kernel = CpuQMoE(node.spec, node.tensors, num_threads=os.cpu_count())
    logits, xs, nbytes = node.logits, node.xs, node.nbytes

    def pause(kind):
        if kind == "sleep":
            time.sleep(gap_s)
        elif kind == "busy":
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass

    result = {}
    for kind in ("none", "sleep", "busy", "none"):
        times = []
        for i in range(calls):
            pause(kind)
            started = time.perf_counter()
            kernel.forward(xs[i % len(xs)], logits[i % len(xs)])
            times.append(time.perf_counter() - started)
        result[kind] = float(np.median(times[4:]))  # the last "none" overwrites the first: warm
    return {"stream": stream, "bytes": nbytes, "median_s": result}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="A")
    ap.add_argument("--gap-us", type=float, default=400.0)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.shape, args.gap_us * 1e-6, args.calls)))
        return None
    from benchmarks.common import write_result

    figures = []
    for name in args.policies.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(POLICIES[name])
        out = subprocess.run([sys.executable, __file__, "--child", "--shape", args.shape, "--gap-us",
                              str(args.gap_us), "--calls", str(args.calls)], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: child failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        line = []
        for kind, t in r["median_s"].items():
            gbs = r["bytes"] / t
            line.append(f"{kind} {t * 1e3:.3f} ms {gbs / 1e9:.1f} GB/s ({gbs / r['stream']:.0%})")
            figures.append({"name": f"decode 1 token, shape {args.shape}, OpenMP {name}, pause {kind} "
                                    f"{args.gap_us:.0f} us", "value": gbs / 1e9, "unit": "GB/s",
                            "reference": "streaming read (same child process)", "reference_value": r["stream"] / 1e9,
                            "ratio": gbs / r["stream"], "latency_ms": t * 1e3})
        print(f"{name:9s} stream {r['stream'] / 1e9:.1f} GB/s | " + " | ".join(line), flush=True)
    if not args.no_write and figures:
        print("wrote", write_result(f"cpu-gap-shape{args.shape}", figures,
                                    config={"gap_us": args.gap_us, "calls": args.calls, "threads": os.cpu_count()}))
    return figures


if __name__ == "__main__":
    main()
