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

With `--model SHAPE` a whole decode instead of the node: a writer-made model of bench_offload's shape with `--layers`
layers, all on the CPU (LoadedModel without offload), greedy decode steps in place of the calls (each round from a
fresh state); the count set through the decoder's KernelThreads, as the engine sets it. `--side-by-side` decodes two
such models at once on two threads (a side-by-side chat answered at once; their counts share the cores), the figures
summed over both.

    python benchmarks/bench_kernel_threads.py [--busy 1] [--experts 8] [--seconds 5] [--rounds 3]
        [--model qwen3-30b-a3b-like --layers 4 --folder DIR [--side-by-side]]
"""

from __future__ import annotations

import argparse
import sys
import threading
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


class NodeCalls:
    """The shape-B node's calls, as the engine makes them (run_experts), under a KernelThreads of its own."""

    def __init__(self, experts: int):
        self.node = node_of_shape_b()
        self.runner = SimpleNamespace(kernel=self.node)
        self.x = np.random.default_rng(0).standard_normal((1, self.node.spec.hidden_size)).astype(np.float32)
        self.ids = np.arange(experts, dtype=np.int64).reshape(1, -1)
        self.weights = np.full((1, experts), 1.0 / experts, np.float32)
        self.threads = None

    def start(self, requested: int, cores: int) -> None:
        self.threads = KernelThreads([self.runner], requested, cores=cores)

    def one(self) -> int:
        """A call; the count it ran at (moved after it, as at a step's end)."""
        self.node.run_experts(self.x, self.ids, self.weights)
        self.threads.step_ended()
        return self.node.num_threads


class DecodeSteps:
    """Greedy decode steps of a writer-made model on the CPU, under the decoder's own KernelThreads."""

    def __init__(self, shape: str, layers: int, folder: str | None):
        from benchmarks.bench_offload import shape_spec
        from benchmarks.common import model_folder, written_model
        from engine.generation import LoadedModel

        self.model = LoadedModel.open(written_model(model_folder(folder, "bench-kernel-threads-"),
                                                    shape_spec(shape, layers)))
        self.model.wait_until_settled()
        self.state = self.token = None

    def start(self, requested: int, cores: int) -> None:
        self.model.decoder.kernel_threads.request(requested)  # (the rounds alternate: automatic starts afresh)
        self.state = self.model.new_state()
        self.token = int(self.model.decoder.forward(self.state, [1, 2, 3, 4])[-1].argmax())

    def one(self) -> int:
        """A decode step; the count it ran at (the decoder moves it at the step's end)."""
        threads = self.model.decoder.kernel_threads.in_force
        self.token = int(self.model.decoder.forward(self.state, [self.token])[-1].argmax())
        return threads


def calls_at_once(works: list, requested: int, cores: int, seconds: float) -> tuple[list[float], Counter]:
    """calls_for of every work at once, one thread each (one work: on this thread); their calls together."""
    results: list = [None] * len(works)

    def run(i: int) -> None:
        results[i] = calls_for(works[i], requested, cores, seconds)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(works))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    times, counts = [], Counter()
    for work_times, work_counts in results:
        times.extend(work_times)
        counts.update(work_counts)
    return times, counts


def calls_for(work, requested: int, cores: int, seconds: float) -> tuple[list[float], Counter]:
    """`work`'s calls for `seconds` at `requested` threads (0: automatic); each call's seconds, the counts it ran at."""
    work.start(requested, cores)
    times, counts = [], Counter()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        threads = work.one()
        times.append(time.perf_counter() - started)
        counts[threads] += 1
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
    parser.add_argument("--model", help="a whole decode of this bench_offload shape instead of the node")
    parser.add_argument("--layers", type=int, default=4, help="the model's layers (--model)")
    parser.add_argument("--folder", help="where the model is written and kept (--model; default: a temporary one)")
    parser.add_argument("--side-by-side", action="store_true", help="two models decoding at once (--model)")
    args = parser.parse_args()
    cores = cpu_threads()
    if args.model:
        works = [DecodeSteps(args.model, args.layers, args.folder) for _ in range(2 if args.side_by_side else 1)]
        what = (f"{args.model} with {args.layers} layers, greedy decode steps on the CPU"
                + (", two models at once" if args.side_by_side else ""))
    else:
        works, what = [NodeCalls(args.experts)], f"shape B node, {args.experts} warm experts, one token"
    calls_at_once(works, cores, cores, 1.0)  # compiled (or loaded from the cache) and warm
    print(f"{what}; {cores} cores, {args.busy} busy processes; {args.seconds:.0f} s a configuration and round",
          flush=True)
    quiet = calls_at_once(works, cores, cores, args.seconds)
    runs = {"all cores": ([], Counter()), "automatic": ([], Counter())}
    load = CompetingLoad(processes=args.busy, ms=1e3 * (args.rounds * 2 * args.seconds + 30))
    try:
        load.start()
        time.sleep(0.5)
        for _ in range(args.rounds):
            for name, requested in (("all cores", cores), ("automatic", 0)):
                times, counts = calls_at_once(works, requested, cores, args.seconds)
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
    path = write_result("kernel_threads", figures, config=vars(args) | {"cores": cores, "what": what}, ratios=ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
