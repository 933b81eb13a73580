"""Benchmark (issue 4, before an executor thread is wired into the engine): can a second Python thread compute a
decode layer's CPU share while the engine's thread does its own per-layer work, or does the GIL serialise them?

A "both" layer whose experts are small is bound by the host (RESULTS.md, thirtieth session: Qwen3-30B-A3B-like at 0%,
~200 µs of the host's Python a layer plus ~175 µs of CPU kernel, one after the other). An executor thread would run
the CPU kernel beside the host's Python; the CPU kernel's Numba code releases the GIL, its Python prelude
(CpuQMoE.run_experts: routing's pairs sorted and grouped) does not, and the host's loop holds the GIL until the
interpreter's switch interval makes it let go (sys.setswitchinterval: 5 ms by default).

Per layer here the host's thread runs `--host-us` of pure Python (the worst case: it never releases the GIL by itself)
and the CPU kernel computes `--experts` of shape B's experts (Qwen3-30B-A3B-like, int4 block 32) for one token. The
next layer starts when both are done, as the next layer's routing needs this layer's merge. Rows, µs a layer:
  serial        both on the host's thread, one after the other (what a "both" layer does now)
  threaded S    the kernel on a worker thread (a queue, one job a layer), the host's loop on the main one, with the
                switch interval S
  threaded, host nogil   the host's work as compiled code that releases the GIL, as long: what is left without
                the GIL (a core shared with the kernel's threads, memory)
  ideal         max(host, kernel), from their times alone
The CPU kernel gets `--threads` threads (default: the cores less one, the host's).

    python benchmarks/bench_gil_handoff.py [--host-us 200] [--experts 3] [--layers 48] [--steps 20] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401 - the engine's OpenMP wait (GOMP_SPINCOUNT), set before Numba's runtime starts
from benchmarks.bench_qmoe_gpu import node_for  # noqa: E402
from benchmarks.common import write_result  # noqa: E402

SWITCH_INTERVALS = (5e-3, 1e-3, 2e-4, 5e-5, 2e-5)


@njit(nogil=True, cache=True)
def _spin(count: int) -> float:
    acc = 0.0
    for i in range(count):
        acc = acc * 0.999999 + i
    return acc


class NogilHost:
    """The host's work as compiled code that releases the GIL, timed like host_work: what the worker's thread meets
    from the host's core alone (a shared core, memory), without the GIL."""

    def __init__(self, seconds: float):
        count = 1 << 16
        while True:
            started = time.perf_counter()
            _spin(count)
            took = time.perf_counter() - started
            if took > 0.02:
                break
            count *= 2
        self.count = max(1, int(count * seconds / took))

    def __call__(self, _seconds: float) -> None:
        _spin(self.count)


def host_work(seconds: float) -> None:
    """Pure Python for `seconds` (the decoder's and the node's bookkeeping at its worst: no call releases the GIL)."""
    clock, until, spins = time.perf_counter, time.perf_counter() + seconds, 0
    while clock() < until:
        spins += 1


class Layers:
    """One token's CPU share per layer: expert ids rotating over the node's experts, as cold pairs do."""

    def __init__(self, kernel, spec, experts: int):
        rng = np.random.default_rng(3)
        self.kernel, self.k, self.experts = kernel, spec.k, experts
        self.num_experts = spec.num_experts
        self.x = rng.standard_normal((1, spec.hidden_size)).astype(np.float16)
        self.w = np.full((1, spec.k), 1.0 / spec.k, np.float32)
        self.out = np.zeros((1, spec.hidden_size), np.float32)

    def run(self, layer: int) -> None:
        ids = np.full((1, self.k), -1)
        ids[0, :self.experts] = (np.arange(self.experts) * 11 + layer * 5) % self.num_experts
        self.out.fill(0)
        self.kernel.run_experts(self.x, ids, self.w, out=self.out)


def serial(layers: Layers, n: int, host_s: float) -> float:
    started = time.perf_counter()
    for layer in range(n):
        layers.run(layer)
        host_work(host_s)
    return time.perf_counter() - started


class Worker:
    """A thread that runs each queued layer's CPU share and counts it done."""

    def __init__(self, layers: Layers):
        self.layers, self.jobs, self.done = layers, queue.SimpleQueue(), threading.Semaphore(0)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            layer = self.jobs.get()
            if layer is None:
                return
            self.layers.run(layer)
            self.done.release()

    def step(self, n: int, host_s: float, host=host_work) -> float:
        started = time.perf_counter()
        for layer in range(n):
            self.jobs.put(layer)
            host(host_s)
            self.done.acquire()
        return time.perf_counter() - started

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def alone(run, repeats: int = 200) -> float:
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times[10:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-us", type=float, default=200.0, help="the host's own Python a layer, µs")
    ap.add_argument("--experts", type=int, default=3, help="experts the CPU computes a layer (one token)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of --layers layers per row")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from kernels.cpu import CpuQMoE

    spec, tensors = node_for("B")
    layers = Layers(CpuQMoE(spec, tensors, num_threads=args.threads), spec, args.experts)
    host_s = args.host_us * 1e-6
    kernel_s = alone(layers.run)
    host_alone_s = alone(lambda _i: host_work(host_s))
    ideal_us = max(kernel_s, host_alone_s) * 1e6
    n = args.layers

    def per_layer_us(run) -> float:
        run()  # warm-up step
        return statistics.median(run() for _ in range(args.steps)) / n * 1e6

    rows = {"serial": per_layer_us(lambda: serial(layers, n, host_s))}
    before = sys.getswitchinterval()
    worker = Worker(layers)
    try:
        for interval in SWITCH_INTERVALS:
            sys.setswitchinterval(interval)
            rows[f"threaded {interval * 1e6:.0f} µs"] = per_layer_us(lambda: worker.step(n, host_s))
        sys.setswitchinterval(before)
        nogil_host = NogilHost(host_s)
        rows["threaded, host nogil"] = per_layer_us(lambda: worker.step(n, host_s, nogil_host))
    finally:
        sys.setswitchinterval(before)
        worker.stop()
    print(f"shape B, {args.experts} experts a layer on {args.threads} threads: kernel {kernel_s * 1e6:.0f} µs, "
          f"host {host_alone_s * 1e6:.0f} µs, ideal {ideal_us:.0f} µs a layer")
    for name, us in rows.items():
        print(f"  {name:22s} {us:7.0f} µs a layer   ideal / this {ideal_us / us:.2f}   serial / this "
              f"{rows['serial'] / us:.2f}")
    figures = [{"name": f"{name}, µs a layer", "value": us, "unit": "µs", "reference": "max(host, kernel) alone",
                "reference_value": ideal_us, "ratio": ideal_us / us} for name, us in rows.items()]
    if not args.no_write:
        path = write_result("gil-handoff", figures, config={
            "host_us": args.host_us, "experts": args.experts, "layers": n, "steps": args.steps,
            "threads": args.threads, "kernel_us": kernel_s * 1e6, "host_alone_us": host_alone_s * 1e6})
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
