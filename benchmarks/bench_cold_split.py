"""Benchmark (issue 4, before wiring it into the engine): one decode layer whose cold experts the GPU reads from the
host tier while the CPU computes some of them at once (route_split + the decode kernels, kernels/gpu/published.py),
against the GPU reading them all (the tier alone, run_routed), in the same process.

Per shape (bench_qmoe_gpu.py's A and B, int4 block 32), at 0 / 25 / 50% of the experts in GPU slots, one fp16 token,
routing rotated over 256 random logit rows (uniform: the worst case for the slots). One timed step is what a layer's
expert node costs the engine's critical path without its dense part: the launch, the host waiting for the published
routing, the CPU kernel on the CPU's pairs, the CPU's part copied over and added on the device, and a stream
synchronisation (the next layer's dense part needs the sum). Rows:
  tier        run_routed, then the synchronisation
  split n     run_routed_split with the CPU taking up to n of a token's cold pairs
  split model the table cpu_take_table makes from this run's rates (what the engine would use)
Also the publish latency (launch to the flag seen, the CPU taking nothing) and the CPU kernel alone. The CPU kernel's
threads wait between calls as in the engine (its GOMP_SPINCOUNT, engine/__init__.py): with libgomp's default they fell
asleep between steps and every step paid to wake them (RESULTS.md, twenty-ninth session).

    python benchmarks/bench_cold_split.py [--shapes A,B] [--iters 150] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401 - the engine's OpenMP wait (GOMP_SPINCOUNT), set before Numba's runtime starts
from benchmarks.bench_qmoe_gpu import SHAPES, node_for  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from kernels.cold_split import cpu_take_table  # noqa: E402


def step_times(cp, run, iters, bank, lg, stream):
    """Median and p90 seconds of run(i) over `iters` steps (3 warm-up steps), logits row i set before each."""
    times = []
    for i in range(iters + 3):
        lg.set(bank[(7 * i) % 256][None], stream=stream)
        stream.synchronize()
        started = time.perf_counter()
        run()
        stream.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - started)
    return float(np.median(times)), float(np.percentile(times, 90))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    import cupy as cp

    from kernels.cpu import CpuQMoE
    from kernels.gpu import GpuQMoE
    from kernels.gpu.published import PublishedRouting

    figures = []
    for key in args.shapes.split(","):
        spec, tensors = node_for(key)
        E, H, k = spec.num_experts, spec.hidden_size, spec.k
        cpu = CpuQMoE(spec, tensors, num_threads=os.cpu_count())
        rng = np.random.default_rng(1)
        bank = (rng.standard_normal((256, E)) * 2.0).astype(np.float32)
        x = rng.standard_normal((1, H)).astype(np.float16)
        # the CPU kernel alone on n cold experts (rates for the model table)
        cpu_s = {}
        for n in (1, 2, 4, k):
            out = np.zeros((1, H), np.float32)
            ts = []
            for i in range(40):
                ids = np.full((1, k), -1)
                ids[0, :n] = (np.arange(n) * 7 + i * 3) % E
                t0 = time.perf_counter()
                cpu.run_experts(x, ids, np.full((1, k), 0.1, np.float32), out=out)
                ts.append(time.perf_counter() - t0)
            cpu_s[n] = float(np.median(ts[5:]))
        slope = (cpu_s[k] - cpu_s[1]) / (k - 1)
        fixed = max(cpu_s[1] - slope, 0.0)
        print(f"[{key}] {SHAPES[key]['label']}: CPU kernel " +
              ", ".join(f"{n} experts {t * 1e6:.0f} µs" for n, t in cpu_s.items()) +
              f" (fit {fixed * 1e6:.0f} µs + {slope * 1e6:.0f} µs an expert)", flush=True)
        stream = cp.cuda.Stream(non_blocking=True)
        for frac in (0.0, 0.25, 0.5):
            S = max(1, round(frac * E))
            m = GpuQMoE(spec, tensors, num_slots=S, resident=list(range(round(frac * E))), host_tier=True)
            pub = PublishedRouting(cp, 1, k, H, np.float16)
            with stream:
                x_dev = cp.asarray(x)
                lg = cp.empty((1, E), cp.float32)
                out32 = cp.empty((1, H), cp.float32)
                cpu_part = np.zeros((1, H), np.float32)
                waits = []

                def tier():
                    m.run_routed(x_dev, lg, out32)

                def split():
                    m.run_routed_split(x_dev, lg, out32, pub)
                    waits.append(pub.wait(stream))
                    on_cpu = pub.on_cpu.astype(bool)
                    if on_cpu.any():
                        cpu_part.fill(0.0)
                        cpu.run_experts(pub.x, np.where(on_cpu, pub.ids, -1), pub.w, out=cpu_part)
                        out32.__iadd__(cp.asarray(cpu_part))

                t_tier, p90_tier = step_times(cp, tier, args.iters, bank, lg, stream)
                # the tier's time an expert from its step (the cold experts' share of it)
                cold_avg = k * (1 - S / E) if frac else k
                model = cpu_take_table(k, slope, fixed, t_tier / cold_avg)
                rows = [("tier", t_tier, p90_tier, None)]
                for n in list(range(0, k + 1, max(1, k // 4))) + ["model"]:
                    table = model if n == "model" else np.minimum(np.arange(k + 1), n)
                    pub.set_cpu_take(table, stream)
                    waits.clear()
                    t, p90 = step_times(cp, split, args.iters, bank, lg, stream)
                    rows.append((f"split {n}", t, p90, float(np.median(waits))))
                print(f"    {frac:4.0%} resident (model table {model.tolist()}):", flush=True)
                for name, t, p90, wait in rows:
                    extra = "" if wait is None else f", wait for the routing {wait * 1e6:.1f} µs"
                    print(f"      {name:12s} {t * 1e6:8.1f} µs (p90 {p90 * 1e6:.1f}) = {t_tier / t:.2f}x the tier"
                          f"{extra}", flush=True)
                    figures.append({"name": f"shape {key}, {frac:.0%} resident, {name}", "value": t * 1e6,
                                    "unit": "µs a layer", "reference": "tier alone", "reference_value": t_tier * 1e6,
                                    "ratio": t_tier / t, "wait_us": None if wait is None else wait * 1e6,
                                    "table": model.tolist() if name == "split model" else None})
            del m
            cp.get_default_memory_pool().free_all_blocks()
    if not args.no_write:
        print(f"wrote {write_result('cold-split', figures)}")


if __name__ == "__main__":
    main()
