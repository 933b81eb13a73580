"""The CPU expert kernel in an engine-like thread, with and without an OpenMP pool left on another thread (issue 4).

The app decodes on its engine thread. Any Numba parallel call made on another thread that lives on (the GUI's) makes
GNU OpenMP keep a second pool of threads, and while the pools' threads outnumber the cores every waiting thread
sleeps after 100 spins instead of GOMP_SPINCOUNT's, so each kernel call pays to wake its threads. Until the
twenty-fourth session the budget panel opened a CudaDevice on the GUI thread to ask whether CUDA was there, and the
device's host bandwidth probe (a Numba parallel sum) left exactly such a pool (app/gui/budget_panel.cuda_status).

Each variant runs in a fresh process (OpenMP's state is per process), alternating, `--rounds` times: a thread
computes a decode-sized QMoE node (CpuQMoE.forward, 1 token) `--calls` times with `--gap-us` of busy host work
between calls (a decode step's other work between layers); "beside" first runs the engine's host bandwidth probe
on the main thread, which stays alive; "released" does the same, then gives that pool back
(kernels/cpu/omp_pool.release_pool, as the decoder and the host-part worker do when the other takes over). Reported:
the median µs a call of each and their ratios to "alone".

    python benchmarks/bench_pool_beside.py [--rounds 3] [--calls 400] [--gap-us 500] [--no-write]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402

SHAPE = dict(E=64, H=512, I=256, k=8)
VARIANTS = ("alone", "beside", "released")  # small enough that a call's fixed cost shows, as at 25-50% resident


def _timed_calls(fn, calls: int, gap_s: float) -> float:
    """Median seconds of fn() over `calls` calls with `gap_s` of busy work between them (the first eighth left out)."""
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
        busy = time.perf_counter()
        while time.perf_counter() - busy < gap_s:
            pass
    return float(np.median(seconds[calls // 8:]))


def one_process(variant: str, calls: int, gap_s: float) -> tuple[float, float]:
    """Median seconds of a kernel call and of a nearly empty parallel loop in a second thread (this process's
    variant: "alone", "beside" or "released")."""
    import engine  # noqa: F401 - the engine's OpenMP settings (GOMP_SPINCOUNT), as in the app
    from numba import njit, prange

    from engine.offload.host_bandwidth import stream_read_bandwidth
    from kernels.cpu import CpuQMoE
    from kernels.cpu.omp_pool import release_pool
    from kernels.qmoe_spec import QMoESpec
    from tests.qmoe_oracle import make_case

    @njit(parallel=True)
    def small(a):
        s = 0.0
        for i in prange(a.size):
            s += a[i]
        return s

    if variant != "alone":
        stream_read_bandwidth(64 << 20)  # what opening a CudaDevice ran on the calling thread
    if variant == "released" and not release_pool():
        raise SystemExit("no OpenMP pool to give back: Numba's threading layer is not GNU OpenMP here")
    attrs, tensors, x, logits = make_case(seed=1, bits=4, block_size=32, T=1, activation="swiglu", swiglu_fusion=1,
                                          **SHAPE)
    spec = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs, tensors, x.shape)
    a = np.ones(4096)
    result: list[float] = []

    def engine_thread() -> None:
        kernel = CpuQMoE(spec, tensors)
        result.append(_timed_calls(lambda: kernel.forward(x, logits), calls, gap_s))
        result.append(_timed_calls(lambda: small(a), calls, gap_s))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    return result[0], result[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--gap-us", type=float, default=500.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.variant:
        print(*one_process(args.variant, args.calls, args.gap_us * 1e-6))
        return
    what = {"kernel": "CPU kernel call (decode-sized QMoE node)", "region": "nearly empty parallel loop"}
    medians = {(w, v): [] for w in what for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--variant", variant, "--calls", str(args.calls),
                                  "--gap-us", str(args.gap_us)], capture_output=True, text=True, check=True)
            for w, value in zip(what, out.stdout.split()[-2:]):
                medians[(w, variant)].append(float(value))
    figures = []
    for w, label in what.items():
        alone, beside, released = (statistics.median(medians[(w, v)]) for v in VARIANTS)
        for variant in VARIANTS:
            print(f"{w} {variant:8s}: " + ", ".join(f"{v * 1e6:.1f}" for v in medians[(w, variant)]) + " µs a call")
        print(f"{w} beside / alone: {beside / alone:.2f}, released / alone: {released / alone:.2f}")
        rounds = {v: medians[(w, v)] for v in VARIANTS}
        figures.append({"name": f"{label} in the engine thread, another thread's OpenMP pool alive", "unit": "s",
                        "value": beside, "reference": "no other pool (the same, alone)", "reference_value": alone,
                        "ratio": beside / alone, "rounds": rounds})
        figures.append({"name": f"{label} in the engine thread, another thread's OpenMP pool given back", "unit": "s",
                        "value": released, "reference": "no other pool (the same, alone)", "reference_value": alone,
                        "ratio": released / alone, "rounds": rounds})
    if not args.no_write:
        print(f"wrote {write_result('pool-beside', figures, shape=SHAPE, gap_us=args.gap_us, calls=args.calls)}")


if __name__ == "__main__":
    main()
