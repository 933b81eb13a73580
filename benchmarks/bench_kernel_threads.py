"""Benchmark: the CPU expert kernels beside other busy processes, on every core against the automatic thread count
(engine/kernel_threads.py).

A Qwen3-30B-A3B-like node (shape B: hidden 2048, intermediate 768, int4 block 32; one token on `--experts` warm
experts) is called back to back through `run_experts`, as the engine calls it, for `--seconds` per configuration:

    quiet       every core, nothing else running: the reference
    all cores   every core, beside `--busy` processes that each keep one core busy (a NumPy sum, as
                benchmarks/competing_load.py's children do)
    automatic   beside the same processes, the count KernelThreads(requested=0) gives, moved between calls as the
                decoder moves it between steps

"all cores" and "automatic" take turns for `--rounds` rounds while the busy processes run. Reported per
configuration: calls a second, the mean, median and p90 of a call, and the counts "automatic" ran at; and automatic's
calls a second over all cores' (and over quiet's).

    python benchmarks/bench_kernel_threads.py [--busy 1] [--experts 8] [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.competing_load import CompetingLoad  # noqa: E402
from benchmarks.diag_cpu_fixed import node_of_shape_b  # noqa: E402
from engine.kernel_threads import KernelThreads  # noqa: E402
from engine.ort_env import cpu_threads  # noqa: E402


def calls_for(node, threads: KernelThreads, seconds: float, x, ids, weights) -> tuple[list[float], Counter]:
    """Call the node for `seconds`, the count moved between calls; each call's seconds, the counts it ran at."""
    times, counts = [], Counter()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        node.run_experts(x, ids, weights)
        times.append(time.perf_counter() - started)
        counts[node.num_threads] += 1
        threads.step_ended()
    return times, counts


def figure(name: str, times: list[float], seconds: float, counts: Counter) -> dict:
    ms = np.array(times) * 1e3
    return {"config": name, "calls_per_s": len(times) / seconds, "mean_ms": float(ms.mean()),
            "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "threads": {str(k): v for k, v in sorted(counts.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=1, help="processes that each keep one core busy")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = cpu_threads()
    node = node_of_shape_b()
    runner = SimpleNamespace(kernel=node)
    x = np.random.default_rng(0).standard_normal((1, node.spec.hidden_size)).astype(np.float32)
    ids = np.arange(args.experts, dtype=np.int64).reshape(1, -1)
    weights = np.full((1, args.experts), 1.0 / args.experts, np.float32)
    every_core = KernelThreads([runner], cores, cores=cores)
    calls_for(node, every_core, 1.0, x, ids, weights)  # compiled (or loaded from the cache) and warm
    print(f"shape B node, {args.experts} warm experts, one token; {cores} cores, {args.busy} busy processes; "
          f"{args.seconds:.0f} s a configuration and round", flush=True)
    quiet = calls_for(node, every_core, args.seconds, x, ids, weights)
    runs = {"all cores": ([], Counter()), "automatic": ([], Counter())}
    load = CompetingLoad(processes=args.busy, ms=1e3 * (args.rounds * 2 * args.seconds + 30))
    try:
        load.start()
        time.sleep(0.5)
        for _ in range(args.rounds):
            for name, threads in (("all cores", KernelThreads([runner], cores, cores=cores)),
                                  ("automatic", KernelThreads([runner], 0, cores=cores))):
                times, counts = calls_for(node, threads, args.seconds, x, ids, weights)
                runs[name][0].extend(times)
                runs[name][1].update(counts)
    finally:
        for child in load.children:
            child.kill()
        load.close()
    figures = [figure("quiet", quiet[0], args.seconds, quiet[1])]
    figures += [figure(name, times, args.rounds * args.seconds, counts) for name, (times, counts) in runs.items()]
    for f in figures:
        print(f"{f['config']:>10}: {f['calls_per_s']:7.1f} calls/s, mean {f['mean_ms']:.2f} ms, median "
              f"{f['median_ms']:.2f}, p90 {f['p90_ms']:.2f}; threads {f['threads']}", flush=True)
    by = {f["config"]: f["calls_per_s"] for f in figures}
    ratios = {"automatic_over_all_cores": by["automatic"] / by["all cores"],
              "automatic_over_quiet": by["automatic"] / by["quiet"],
              "all_cores_over_quiet": by["all cores"] / by["quiet"]}
    print("calls a second: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), flush=True)
    path = write_result("kernel_threads", figures, config=vars(args) | {"cores": cores}, ratios=ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
