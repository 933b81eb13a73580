"""Benchmark: do the CPU's expert reads and the GPU's copies over PCIe share the host's memory bandwidth?

anchors.md bounds a decode step's misses by (1 - h)·W_act / (B_dram + B_pcie): the CPU computing some misses while
others are copied to the GPU, each at its full rate. But a copy over PCIe reads host memory too. This benchmark
measures each reader alone and both at once, in one process:

    cpu stream   a Numba parallel sum over 2 GB (the engine's B_dram measurement), all threads
    cpu kernel   the CPU decode kernel (kernels.cpu.CpuQMoE, int4 block 32, cold routing) at shape A or B
    pcie         host -> device copies from page-locked memory (1 GiB each, back to back on one stream); with
                 --gpu-reads kernel, a kernel reading the same page-locked GiB over PCIe instead (zero-copy, as the
                 decode kernels read the host tier: bench_zero_copy.py's read_all), back to back

For "both", the copies are queued first (enough for ~0.6 s) and the CPU reader runs call after call while they are in
flight; only the CPU calls that ended before the last copy count, and the copies' rate is their bytes over their
CUDA-event time. Reported: each rate alone, each rate while sharing, and the shared sum against B_dram + B_pcie
(what the anchors' bound adds).

    python benchmarks/bench_host_contention.py [--shape A|B] [--gpu-reads copy|kernel] [--threads N] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_cpu import SHAPES, cold_decode_node  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from engine.offload.host_bandwidth import _kernel as stream_kernel  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402

COPY_BYTES = 1 << 30


class Copier:
    """Back-to-back host -> device copies of one page-locked GiB on a stream of their own."""

    def __init__(self, cp):
        self.cp = cp
        self.host = cp.cuda.alloc_pinned_memory(COPY_BYTES)
        np.frombuffer(self.host, np.uint8, COPY_BYTES)[:] = 1
        self.device = cp.empty(COPY_BYTES, cp.uint8)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def start(self, count: int):
        """Queue `count` copies; returns (start event, end event)."""
        rt = self.cp.cuda.runtime
        begin = self.stream.record()
        for _ in range(count):
            rt.memcpyAsync(self.device.data.ptr, self.host.ptr, COPY_BYTES, rt.memcpyHostToDevice, self.stream.ptr)
        return begin, self.stream.record()

    def rate_alone(self, count: int = 8) -> float:
        self.start(1)[1].synchronize()  # warm
        begin, end = self.start(count)
        end.synchronize()
        return count * COPY_BYTES / (self.cp.cuda.get_elapsed_time(begin, end) * 1e-3)


class KernelReader(Copier):
    """Back-to-back launches of a kernel that reads the page-locked GiB over PCIe (zero-copy), on a stream of their
    own: the GPU's reads of the host tier, where Copier is the copy engine's."""

    def __init__(self, cp):
        from benchmarks.bench_zero_copy import _READ_SRC

        super().__init__(cp)
        self.src = cp.ndarray((COPY_BYTES // 16, 4), cp.uint32, cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(self.host.ptr, COPY_BYTES, self.host), 0))
        self.sink = cp.zeros(1, cp.uint32)
        self.read_all = cp.RawKernel(_READ_SRC, "read_all")
        self.blocks = cp.cuda.Device().attributes["MultiProcessorCount"] * 8

    def start(self, count: int):
        begin = self.stream.record()
        with self.stream:
            for _ in range(count):
                self.read_all((self.blocks,), (256,), (self.src, np.int64(COPY_BYTES // 16), self.sink))
        return begin, self.stream.record()


def cpu_rate_alone(call, nbytes: int, seconds: float = 0.5) -> float:
    call()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        done += 1
    return done * nbytes / (time.perf_counter() - started)


def shared_rates(copier: Copier, call, nbytes: int, copies: int) -> tuple[float, float, int]:
    """(CPU bytes/s, copy bytes/s, CPU calls counted) with both running: CPU calls that ended while copies were
    still in flight."""
    begin, end = copier.start(copies)
    begin.synchronize()
    done, started, finished = 0, time.perf_counter(), None
    while True:
        call()
        if end.done:
            break
        done += 1
        finished = time.perf_counter()
    end.synchronize()
    copy_rate = copies * COPY_BYTES / (copier.cp.cuda.get_elapsed_time(begin, end) * 1e-3)
    cpu_rate = done * nbytes / (finished - started) if done else float("nan")
    return cpu_rate, copy_rate, done


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(SHAPES), default="A")
    ap.add_argument("--gpu-reads", choices=("copy", "kernel"), default="copy",
                    help="the GPU's reader of host memory: the copy engine, or a kernel reading it over PCIe")
    ap.add_argument("--threads", type=int, help="the CPU readers' threads (default: every core)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    import cupy as cp
    from kernels.cpu.threads import use_threads

    cores = args.threads or os.cpu_count() or 1
    use_threads(cores)
    psum = stream_kernel()
    big = np.ones(int(2e9) // 4, np.float32)

    node = cold_decode_node(args.shape)
    kernel = CpuQMoE(node.spec, node.tensors, num_threads=cores)
    calls = {"n": 0}

    def decode_call():
        i = calls["n"] % len(node.logits)
        calls["n"] += 1
        kernel.forward(node.xs[i], node.logits[i])

    readers = {"cpu stream (Numba parallel sum, 2 GB)": (lambda: psum(big), big.nbytes),
               f"cpu decode kernel, shape {args.shape} cold routing": (decode_call, node.nbytes)}
    copier = (KernelReader if args.gpu_reads == "kernel" else Copier)(cp)
    pcie = copier.rate_alone()
    copies = max(4, int(0.6 * pcie / COPY_BYTES))
    print(f"shape {args.shape}, {cores} threads; pcie alone {pcie / 1e9:.1f} GB/s; {copies} GiB copied per shared run",
          flush=True)
    figures = []
    for name, (call, nbytes) in readers.items():
        alone = cpu_rate_alone(call, nbytes)
        runs = [shared_rates(copier, call, nbytes, copies) for _ in range(3)]
        cpu_shared = float(np.median([r[0] for r in runs]))
        copy_shared = float(np.median([r[1] for r in runs]))
        pcie_again = copier.rate_alone()
        total = cpu_shared + copy_shared
        print(f"{name}: alone {alone / 1e9:.1f} GB/s; with copies {cpu_shared / 1e9:.1f} GB/s "
              f"({cpu_shared / alone:.0%}), copies {copy_shared / 1e9:.1f} GB/s ({copy_shared / pcie:.0%} of alone, "
              f"{pcie_again / 1e9:.1f} alone after); sum {total / 1e9:.1f} GB/s = {total / (alone + pcie):.0%} of "
              f"alone + pcie alone; {min(r[2] for r in runs)}+ calls per run", flush=True)
        figures += [
            {"name": f"{name} while copies run", "value": cpu_shared / 1e9, "unit": "GB/s",
             "reference": "the same reader alone (same run)", "reference_value": alone / 1e9,
             "ratio": cpu_shared / alone},
            {"name": f"host->device copies while {name} runs", "value": copy_shared / 1e9, "unit": "GB/s",
             "reference": "the copies alone (same run)", "reference_value": pcie / 1e9, "ratio": copy_shared / pcie},
            {"name": f"{name} + copies, both running", "value": total / 1e9, "unit": "GB/s",
             "reference": "each alone, summed (what B_dram + B_pcie assumes)", "reference_value": (alone + pcie) / 1e9,
             "ratio": total / (alone + pcie)},
        ]
    if not args.no_write:
        tag = "" if args.gpu_reads == "copy" else "-kernel-reads"
        print("wrote", write_result(f"host-contention-shape{args.shape}{tag}-{cores}t", figures,
                                    config={"shape": args.shape, "threads": cores, "copy_bytes": COPY_BYTES,
                                            "gpu_reads": args.gpu_reads}))
    return figures


if __name__ == "__main__":
    main()
