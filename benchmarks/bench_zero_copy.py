"""Benchmark (issue 4, a question before a design): how fast does our GPU decode kernel compute experts whose weights
stay in page-locked host memory, read by the GPU over PCIe during the kernel (zero-copy), against the same kernel on
HBM slots and against PCIe's own copy bandwidth measured in the same run?

Why it matters: a hybrid layer today waits for the dense part, takes its inputs to the host, routes, computes the
cold experts on the CPU and merges them on the GPU: ~300 µs a layer of host work besides the CPU kernel (RESULTS.md).
If the GPU can read a cold expert from host memory at close to PCIe's bandwidth, a layer with cold experts needs no
host round trip at all, as with every expert resident.

Per shape (bench_qmoe_gpu.py's A and B, int4 block 32), one token, routing rotated over 256 random logit rows, one
forward = routing + FC1 + FC2 as a CUDA graph, timed with CUDA events behind a spin kernel (bench_qmoe_gpu.Timer):
  hbm     every expert in HBM slots (GpuQMoE as the engine builds it)
  mapped  the slots' weights, scales and biases moved to page-locked host memory (cudaHostAlloc; with unified
          addressing the device reads it through the same pointer): every byte the kernel reads comes over PCIe
  tier    GpuQMoE(host_tier=True) with 0%, 25% and 50% of the experts in GPU slots: the others read from their
          host rows (kernels/gpu/host_tier.py), in one launch with the resident ones; outputs checked against hbm
  cold c  the tier at 25% with exactly c of a token's k pairs cold (c = 0, 1, 2, 4, k): what a launch costs for few
          cold experts, as realistic routing gives at high hit rates, next to a pinned copy of the same bytes
  cpu     our CPU kernel (CpuQMoE, every core) on the same node and routing rows, one token a call, timed on the host
Bytes = the k routed experts' bytes. References in the same process: a 1 GiB pinned host-to-device cudaMemcpy
(B_pcie) and a plain kernel that reads 1 GiB of the same kind of host memory with 16-byte loads (zero-copy ceiling).

    python benchmarks/bench_zero_copy.py [--shapes A,B] [--iters 200] [--no-write]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_gpu import SHAPES, Timer, capture, node_for  # noqa: E402
from benchmarks.common import write_result  # noqa: E402

_READ_SRC = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ src, long long n, unsigned int* out) {
    unsigned int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads; practically never written
}
"""


def host_mapped(cp, arr):
    """A CuPy array with arr's contents in page-locked host memory that kernels read over PCIe."""
    pinned = cp.cuda.alloc_pinned_memory(arr.nbytes)
    mem = cp.cuda.UnownedMemory(pinned.ptr, arr.nbytes, pinned)
    out = cp.ndarray(arr.shape, arr.dtype, cp.cuda.MemoryPointer(mem, 0))
    out[...] = arr
    return out


def pcie_references(cp, timer, nbytes=1 << 30):
    """(pinned H2D copy GB/s, zero-copy kernel read GB/s), each the median of 10."""
    host = cp.cuda.alloc_pinned_memory(nbytes)
    np.frombuffer(host, np.uint8, nbytes)[:] = 7
    dev = cp.empty(nbytes, cp.uint8)
    t_copy, _, _ = timer.median(lambda: dev.data.copy_from_host_async(ctypes.c_void_p(host.ptr), nbytes), iters=10, spin_cycles=10_000)
    src = cp.ndarray((nbytes // 16, 4), cp.uint32, cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(host.ptr, nbytes, host), 0))
    sink = cp.zeros(1, cp.uint32)
    read_all = cp.RawKernel(_READ_SRC, "read_all")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    t_read, _, _ = timer.median(lambda: read_all((sms * 8,), (256,), (src, np.int64(nbytes // 16), sink)), iters=10,
                                spin_cycles=10_000)
    return nbytes / t_copy / 1e9, nbytes / t_read / 1e9


def decode_time(cp, m, timer, rng, iters, bank=None):
    """Median / p10 / p90 seconds of one routed decode forward (CUDA graph), routing rotated over 256 rows of router
    logits (`bank`, float32 [256, E]; random where None)."""
    spec = m.spec
    H, E = spec.hidden_size, spec.num_experts
    stream = cp.cuda.Stream(non_blocking=True)
    if bank is None:
        bank = (rng.standard_normal((256, E)) * 2.0).astype(np.float32)
    bank = cp.asarray(bank)
    x = cp.asarray(rng.standard_normal((1, H)).astype(np.float32))
    lg = cp.empty((1, E), cp.float32)
    out = cp.empty((1, H), cp.float32)
    with stream:
        g = capture(cp, stream, lambda: m.forward_into(x, lg, out))
        res = timer.median(g, iters=iters, prep=lambda i: lg.__setitem__(Ellipsis, bank[(7 * i) % 256]))
        g()
        stream.synchronize()
    return res, out


def cpu_time(spec, tensors, runs=60):
    """Median seconds of our CPU kernel on one token, every core, routing rotated over 256 rows (experts vary)."""
    from kernels.cpu import CpuQMoE

    cpu = CpuQMoE(spec, tensors, num_threads=os.cpu_count())
    rng = np.random.default_rng(2)
    bank = (rng.standard_normal((256, spec.num_experts)) * 2.0).astype(np.float32)
    x = rng.standard_normal((1, spec.hidden_size)).astype(np.float32)
    for i in range(3):
        cpu.forward(x, bank[i:i + 1])
    ts = []
    for i in range(runs):
        row = bank[(7 * i) % 256][None]
        t0 = time.perf_counter()
        cpu.forward(x, row)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def tier_rows(cp, GpuQMoE, spec, tensors, timer, iters, out_hbm, nbytes, key):
    """The host tier at 0 / 25 / 50% of the experts in GPU slots: (printed lines, figures)."""
    E = spec.num_experts
    lines, figures = [], []
    for frac in (0.0, 0.25, 0.5):
        S = max(1, round(frac * E))
        m = GpuQMoE(spec, tensors, num_slots=S, resident=list(range(round(frac * E))), host_tier=True)
        (t, p10, p90), out = decode_time(cp, m, timer, np.random.default_rng(1), iters)
        diff = float(cp.abs(out - out_hbm).max() / cp.abs(out_hbm).max())
        lines.append(f"    tier {frac:4.0%} {t * 1e6:8.1f} µs (p10 {p10 * 1e6:.1f}, p90 {p90 * 1e6:.1f}) = "
                     f"{nbytes / t / 1e9:7.1f} GB/s of routed bytes; output vs hbm: max diff {diff:.1e}")
        figures.append({"name": f"decode, shape {key}, host tier, {frac:.0%} of experts in GPU slots",
                        "value": nbytes / t / 1e9, "unit": "GB/s", "median_us": t * 1e6, "max_diff_vs_hbm": diff})
        del m
        cp.get_default_memory_pool().free_all_blocks()
    return lines, figures


def cold_bank(rng, num_experts: int, k: int, resident: int, cold: int, rows: int = 256) -> np.ndarray:
    """Router logits (float32 [rows, num_experts]) whose top k hold exactly `cold` experts in no slot (experts
    >= `resident`) and k - cold resident ones, different ones in every row: the chosen experts' logits stand far
    above the others'."""
    bank = rng.standard_normal((rows, num_experts)).astype(np.float32)
    for row in bank:
        hot = rng.choice(resident, k - cold, replace=False)
        far = resident + rng.choice(num_experts - resident, cold, replace=False)
        row[np.concatenate([hot, far])] = 20.0 + rng.random(k).astype(np.float32)
    return bank


def cold_count_rows(cp, GpuQMoE, spec, tensors, timer, iters, key):
    """The host tier at 25% of the experts in GPU slots with exactly c of a token's k pairs cold, c = 0, 1, 2, 4, ...,
    k: what one launch costs for few cold experts (realistic routing at high hit rates), next to a pinned copy of the
    same bytes (what staging them into HBM first would take): (printed lines, figures)."""
    E, k = spec.num_experts, spec.k
    S = max(1, E // 4)
    m = GpuQMoE(spec, tensors, num_slots=S, resident=list(range(S)), host_tier=True)
    expert_bytes = m.expert_bytes()
    host = cp.cuda.alloc_pinned_memory(k * expert_bytes)
    dev = cp.empty(k * expert_bytes, cp.uint8)
    lines, figures, base = [], [], None
    for c in sorted({0, 1, 2, 4, k} & set(range(k + 1))):
        bank = cold_bank(np.random.default_rng(3), E, k, S, c)
        (t, p10, p90), _ = decode_time(cp, m, timer, np.random.default_rng(1), iters, bank=bank)
        base = t if c == 0 else base
        nbytes = c * expert_bytes
        t_copy = timer.median(lambda: dev.data.copy_from_host_async(ctypes.c_void_p(host.ptr), nbytes), iters=20,
                              spin_cycles=10_000)[0] if c else 0.0
        extra = t - base
        rate = nbytes / extra / 1e9 if c and extra > 0 else None
        lines.append(f"    {c} cold of {k}: {t * 1e6:7.1f} µs (p10 {p10 * 1e6:.1f}, p90 {p90 * 1e6:.1f}), "
                     f"{extra * 1e6:+6.1f} over none cold"
                     + (f" = {rate:5.1f} GB/s of the cold bytes; a pinned copy of them {t_copy * 1e6:6.1f} µs"
                        if rate else ""))
        figures.append({"name": f"decode, shape {key}, host tier at 25% in slots, {c} of {k} pairs cold",
                        "value": t * 1e6, "unit": "µs", "reference": "the same launch with no pair cold",
                        "reference_value": base * 1e6, "cold_bytes": nbytes, "cold_gb_per_s": rate,
                        "pinned_copy_us": t_copy * 1e6})
    del m
    cp.get_default_memory_pool().free_all_blocks()
    return lines, figures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    import cupy as cp

    from kernels.gpu import GpuQMoE

    timer = Timer(cp)
    b_copy, b_read = pcie_references(cp, timer)
    print(f"PCIe: pinned H2D copy {b_copy:.1f} GB/s, zero-copy kernel read {b_read:.1f} GB/s", flush=True)
    figures = [{"name": "pinned host-to-device copy (B_pcie)", "value": b_copy, "unit": "GB/s"},
               {"name": "zero-copy kernel read of pinned host memory", "value": b_read, "unit": "GB/s",
                "reference": "pinned host-to-device copy", "reference_value": b_copy, "ratio": b_read / b_copy}]
    for key in args.shapes.split(","):
        spec, tensors = node_for(key)
        m = GpuQMoE(spec, tensors)
        nbytes = spec.k * m.expert_bytes()
        rng = np.random.default_rng(1)
        (t_hbm, p10h, p90h), out_hbm = decode_time(cp, m, timer, rng, args.iters)
        # the same module with every slot's bytes in host memory (fresh graphs: the captured ones hold the old ones)
        for proj in m.slots.values():
            for name in list(proj):
                proj[name] = host_mapped(cp, proj[name])
        m._graphs.clear()
        m._graph_seen.clear()
        cp.get_default_memory_pool().free_all_blocks()
        rng = np.random.default_rng(1)
        (t_map, p10m, p90m), out_map = decode_time(cp, m, timer, rng, args.iters)
        # FC2 adds pairs into the output with atomics, in no fixed order: equal up to rounding
        diff = float(cp.abs(out_map - out_hbm).max() / cp.abs(out_hbm).max())
        print(f"[{key}] {SHAPES[key]['label']}: {nbytes / 1e6:.2f} MB a token\n"
              f"    hbm    {t_hbm * 1e6:8.1f} µs (p10 {p10h * 1e6:.1f}, p90 {p90h * 1e6:.1f}) = "
              f"{nbytes / t_hbm / 1e9:7.1f} GB/s\n"
              f"    mapped {t_map * 1e6:8.1f} µs (p10 {p10m * 1e6:.1f}, p90 {p90m * 1e6:.1f}) = "
              f"{nbytes / t_map / 1e9:7.1f} GB/s = {nbytes / t_map / 1e9 / b_copy:.2f} of the pinned copy, "
              f"{nbytes / t_map / 1e9 / b_read:.2f} of the zero-copy read; output vs hbm: max diff {diff:.1e} of max |out|", flush=True)
        figures.append({"name": f"decode, shape {key}, weights in HBM", "value": nbytes / t_hbm / 1e9,
                        "unit": "GB/s", "median_us": t_hbm * 1e6})
        figures.append({"name": f"decode, shape {key}, weights in host memory (zero-copy)",
                        "value": nbytes / t_map / 1e9, "unit": "GB/s", "median_us": t_map * 1e6,
                        "reference": "pinned host-to-device copy", "reference_value": b_copy,
                        "ratio": nbytes / t_map / 1e9 / b_copy, "max_diff_vs_hbm": diff})
        del m
        cp.get_default_memory_pool().free_all_blocks()
        lines, tier_figures = tier_rows(cp, GpuQMoE, spec, tensors, timer, args.iters, out_hbm, nbytes, key)
        t_cpu = cpu_time(spec, tensors)
        print("\n".join(lines), flush=True)
        lines, cold_figures = cold_count_rows(cp, GpuQMoE, spec, tensors, timer, args.iters, key)
        print("\n".join(lines), flush=True)
        figures += cold_figures
        print(f"    cpu      {t_cpu * 1e6:8.1f} µs = {nbytes / t_cpu / 1e9:7.1f} GB/s (our CPU kernel, "
              f"{os.cpu_count()} threads)", flush=True)
        figures += tier_figures
        figures.append({"name": f"decode, shape {key}, our CPU kernel (one token a call)",
                        "value": nbytes / t_cpu / 1e9, "unit": "GB/s", "median_us": t_cpu * 1e6})
    if not args.no_write:
        print(f"wrote {write_result('zero-copy', figures)}")


if __name__ == "__main__":
    main()
