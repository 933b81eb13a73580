"""Diagnosis: does the CPU decode kernel run slower as loaded from Numba's cache than as compiled in this process?

On the dev VM the same call of moe_gemv spread 1.3-1.5x between processes (NOTES-cpu-kernels.md, "Forty-fifth" and
"Forty-sixth session"). Here the cached moe_gemv and two copies of its source compiled in this process (cache off) are
called on the same arguments, those run_experts gives them (Qwen3-30B-A3B-like node, one token, warm experts),
alternating in rounds of --calls calls. Per thread count and expert count it prints the median of each round's
median, and the cached kernel's time over the copies' (> 1: the cached one is slower). Run it in several processes:
what differs between them is the point.

    python benchmarks/diag_cached_kernel.py [--threads 1,16] [--experts 1,8] [--rounds 6] [--calls 60]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_seconds  # noqa: E402
from benchmarks.diag_cpu_fixed import kernel_arguments, node_of_shape_b  # noqa: E402
from kernels.cpu import kernels as compiled  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402


def compiled_here(name: str = "moe_gemv"):
    """A kernel's own source (moe_gemv's unless named) compiled in this process, not cached (the module's names around
    it)."""
    source = inspect.getsource(getattr(compiled, name))
    if "cache=True" not in source:
        raise SystemExit(f"diag_cached_kernel: {name} is no longer cached (cache=True); nothing to compare")
    namespace = dict(vars(compiled))
    exec(compile(source.replace("cache=True", "cache=False", 1), f"<{name} compiled here>", "exec"), namespace)
    return namespace[name]


def interleaved_medians(kernels: dict, arguments: tuple, rounds: int, calls: int) -> dict:
    """Per kernel, µs: the median over `rounds` rounds of its median call of `calls`, the kernels taking turns in each
    round on the same arguments."""
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            times[name].append(median_seconds(lambda kernel=kernel: kernel(*arguments), calls, 2))
    return {name: statistics.median(seconds) * 1e6 for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--experts", default="1,8")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    node = node_of_shape_b()
    x = np.random.default_rng(0).standard_normal((1, node.spec.hidden_size)).astype(np.float32)
    kernels = {"cached": compiled.moe_gemv, "here 1": compiled_here(), "here 2": compiled_here()}
    print(f"moe_gemv, one token at shape B, warm; µs, median of {args.rounds} rounds' medians of {args.calls} calls")
    for threads in [int(t) for t in args.threads.split(",")]:
        node.num_threads = threads
        use_threads(threads)
        for experts in [int(e) for e in args.experts.split(",")]:
            medians = interleaved_medians(kernels, kernel_arguments(node, x, experts), args.rounds, args.calls)
            here = statistics.median([medians["here 1"], medians["here 2"]])
            print(f"{threads:3d} threads, {experts} experts: " + "  ".join(f"{name} {m:7.1f}" for name, m in
                                                                         medians.items())
                  + f"  |  cached / here {medians['cached'] / here:.3f}", flush=True)


if __name__ == "__main__":
    main()
