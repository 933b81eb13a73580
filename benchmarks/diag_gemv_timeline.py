"""Diagnosis: a timeline of one CPU decode call inside moe_gemv, per thread (issue #4 / #3).

diag_cpu_fixed.py showed on the H200 machine's Xeon that moe_gemv on one expert of the Qwen3-30B-A3B-like node costs
~95 µs at 16 threads where its 2.96 MB at the threads' own rate would take ~35: a fixed ~60 µs appears between 4 and
8 threads. Here moe_gemv's own source, with cycle-counter stamps added (STAMPS, traced_source), is compiled and called
on the arguments
the real run_experts passes, and per call it records: the prologue (before the parallel region), each thread's
arrival in the region, the end of its FC1 share, the end of its FC2 share (which includes waiting for FC1 to finish),
and the epilogue (the reduction). Printed: medians over --runs calls of each phase's first and last thread, µs from
the call's start.

    python benchmarks/diag_gemv_timeline.py [--threads 16,8,4] [--experts 1,2,8] [--runs 300]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.diag_cpu_fixed import kernel_arguments, node_of_shape_b  # noqa: E402
from kernels.cpu import kernels as compiled  # noqa: E402
from kernels.cpu.host_parts import cycles, read_cycles as now_cycles  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402


# Where traced_gemv stamps stamps[row, column]: [0] the call (start, region start, end), [1 + th] thread th (arrival,
# FC1 done, FC2 done): (a line of moe_gemv's source, the stamp, inserted before that line or after it); the call's
# end is stamped after its last line.
STAMPS = (("    Kb1 = w1.shape[2]\n", "stamps[0, 0]", "before"),
          ("    for th_loop in prange(nth):\n", "stamps[0, 1]", "before"),
          ("        _gemv_fc1_thread(", "stamps[th + 1, 0]", "before"),
          ("        _gemv_fc2_thread(", "stamps[th + 1, 1]", "before"),
          ("zs[th, 2 * nb1 + nb2:], vics[th])\n", "stamps[th + 1, 2]", "after"))


def traced_source() -> str:
    """moe_gemv's source with the STAMPS added (a new argument `stamps` last), named traced_gemv, not cached. Fails
    by name when moe_gemv no longer has an anchor line."""
    source = inspect.getsource(compiled.moe_gemv)
    for anchor, target, where in STAMPS:
        if anchor not in source:
            raise SystemExit(f"diag_gemv_timeline: moe_gemv no longer has the line {anchor.strip()!r}; update STAMPS")
        at = source.index(anchor)
        if where == "after":  # the anchor ends a call in the prange body
            at += len(anchor)
            indent = "        "
        else:
            indent = anchor[:len(anchor) - len(anchor.lstrip())]
        source = source[:at] + f"{indent}{target} = cycles()\n" + source[at:]
    source += "    stamps[0, 2] = cycles()\n"  # after the reduction, moe_gemv's last statement
    source = source.replace("def moe_gemv(", "def traced_gemv(", 1).replace("do_reduce, nth):", "do_reduce, nth, stamps):", 1)
    return source.replace("cache=True", "cache=False", 1)

def compile_traced():
    """traced_gemv, compiled in a namespace holding what moe_gemv's module holds, and cycles."""
    namespace = dict(vars(compiled), cycles=cycles)
    exec(compile(traced_source(), "<traced moe_gemv>", "exec"), namespace)
    return namespace["traced_gemv"]

def cycles_per_us() -> float:
    now_cycles()  # compiled before the clock starts
    started, c0 = time.perf_counter(), now_cycles()
    time.sleep(0.2)
    return (now_cycles() - c0) / ((time.perf_counter() - started) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="16,8,4")
    parser.add_argument("--experts", default="1,2,8")
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    node = node_of_shape_b()
    rate = cycles_per_us()
    H = node.spec.hidden_size
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    traced_gemv = compile_traced()
    print(f"µs from the call's start, medians of {args.runs} calls (time-stamp counter: {rate:.0f} per µs)")
    for threads in [int(t) for t in args.threads.split(",")]:
        node.num_threads = threads
        use_threads(threads)
        for u in [int(e) for e in args.experts.split(",")]:
            arguments = kernel_arguments(node, x, u)
            stamps = np.zeros((threads + 1, 3), np.int64)
            rows = []
            for _ in range(args.runs + 5):
                traced_gemv(*arguments, stamps)
                call, per_thread = stamps[0], stamps[1:] - stamps[0, 0]
                rows.append([call[1] - call[0], per_thread[:, 0].min(), per_thread[:, 0].max(),
                             per_thread[:, 1].min(), per_thread[:, 1].max(), per_thread[:, 2].min(),
                             per_thread[:, 2].max(), call[2] - call[0]])
            m = np.median(np.array(rows[5:], np.float64), axis=0) / rate
            print(f"{threads:3d} threads, {u} experts: prologue {m[0]:6.1f}  arrive {m[1]:6.1f}-{m[2]:6.1f}  "
                  f"FC1 done {m[3]:6.1f}-{m[4]:6.1f}  FC2 done {m[5]:6.1f}-{m[6]:6.1f}  end {m[7]:6.1f}", flush=True)


if __name__ == "__main__":
    main()
