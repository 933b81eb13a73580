"""Benchmark: does the memory the experts live in change the CPU decode kernel's speed?

In the offload engine the CPU expert kernels read experts from the memory-mapped weight file (page-cache pages of
4 KiB); `bench_qmoe_cpu.py` reads NumPy arrays (anonymous memory, which NumPy advises for transparent huge pages).
On the H200 machine the engine's kernels read 1.4-2x slower than the node benchmark's. This benchmark times the
same decode node (kernels.cpu.CpuQMoE, int4 block 32, cold routing as bench_qmoe_cpu --routing cold) with the same
weight bytes in each backing, in alternating blocks of one process:

    numpy      the arrays as NumPy made them (what bench_qmoe_cpu reads)
    anon-4k    anonymous mmap, MADV_NOHUGEPAGE (4 KiB pages)
    anon-thp   anonymous mmap, MADV_HUGEPAGE (2 MiB pages where the kernel grants them)
    file       a file written to --dir, mapped read-only and read once (what the engine reads)
    file-thp   the same file mapped again, MADV_HUGEPAGE + MADV_COLLAPSE (read-only file THP, where the kernel
               has CONFIG_READ_ONLY_THP_FOR_FS; the JSON says whether the collapse succeeded)

and reports each as GB/s of weights read, against the streaming read bandwidth measured in the same run and against
the numpy backing. The huge-page share of each mapping is read from /proc/self/smaps.

    python benchmarks/bench_expert_backing.py [--shape A|B] [--runs N] [--dir DIR]
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_cpu import SHAPES, cold_decode_node, time_blocks  # noqa: E402
from benchmarks.common import stream_read_bandwidth, write_result  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402

MADV_COLLAPSE = 25  # linux/mman.h (6.1+); not in Python's mmap module
BIG = ("fc1_experts_weights", "fc1_scales", "fc2_experts_weights", "fc2_scales")


def _layout(tensors: dict) -> tuple[list[tuple[str, int]], int]:
    """(name, offset) of each big tensor in one buffer, 2 MiB aligned, and the buffer's size."""
    offsets, pos = [], 0
    for name in BIG:
        offsets.append((name, pos))
        pos += -(-tensors[name].nbytes // (2 << 20)) * (2 << 20)
    return offsets, pos


def _views(buf, tensors: dict, offsets) -> dict:
    out = dict(tensors)
    for name, off in offsets:
        a = tensors[name]
        out[name] = np.frombuffer(buf, a.dtype, a.size, off).reshape(a.shape)
    return out


def _anonymous(tensors: dict, huge: bool):
    offsets, size = _layout(tensors)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    for name, off in offsets:
        mm[off:off + tensors[name].nbytes] = tensors[name].tobytes()
    return mm, _views(mm, tensors, offsets)


def _write_file(tensors: dict, folder: str) -> tuple[str, list]:
    offsets, size = _layout(tensors)
    fd, path = tempfile.mkstemp(suffix=".experts", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.truncate(size)
        for name, off in offsets:
            f.seek(off)
            f.write(tensors[name].tobytes())
    return path, offsets


def _mapped(path: str, tensors: dict, offsets, huge: bool):
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    note = None
    if huge:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            mm.madvise(MADV_COLLAPSE)
            note = "collapsed"
        except OSError as exc:
            note = f"MADV_COLLAPSE refused: {exc.strerror}"
    np.frombuffer(mm, np.uint8)[:: 4096].sum()  # every page read once: in the page cache and mapped
    return mm, _views(mm, tensors, offsets), note


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(SHAPES), default="A")
    ap.add_argument("--runs", type=int, default=48)
    ap.add_argument("--dir", default=None, help="folder for the weight file (default: the temporary folder)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    from kernels.cpu.threads import use_threads

    cores = os.cpu_count() or 1
    use_threads(cores)
    stream = stream_read_bandwidth()
    E, H, I, K = SHAPES[args.shape]
    node = cold_decode_node(args.shape)
    spec, tensors, logits, xs = node.spec, node.tensors, node.logits, node.xs
    print(f"shape {args.shape}: E={E} H={H} I={I} top-{K}, streaming read {stream:.1f} GB/s, {cores} threads",
          flush=True)
    keep, kinds, notes, shares = [], {}, {}, {}
    kinds["numpy"] = tensors
    for name, huge in (("anon-4k", False), ("anon-thp", True)):
        mm, t = _anonymous(tensors, huge)
        keep.append(mm)
        kinds[name] = t
    path, offsets = _write_file(tensors, args.dir or tempfile.gettempdir())
    try:
        for name, huge in (("file", False), ("file-thp", True)):
            mm, t, note = _mapped(path, tensors, offsets, huge)
            keep.append(mm)
            kinds[name] = t
            notes[name] = note
        for name, t in kinds.items():
            shares[name] = _huge_share_of(t["fc1_experts_weights"])
        kernels = {name: CpuQMoE(spec, t, num_threads=cores) for name, t in kinds.items()}
        n = len(logits)
        ref = kernels["numpy"].forward(xs[0], logits[0])
        for name, k in kernels.items():
            assert np.array_equal(k.forward(xs[0], logits[0]), ref), f"{name}: output differs from numpy backing"
        fns = {name: (lambda k: (lambda i: k.forward(xs[i % n], logits[i % n])))(k) for name, k in kernels.items()}
        med = time_blocks(fns, runs=args.runs, blocks=4)
    finally:
        os.unlink(path)
    nbytes = node.nbytes
    figures = []
    print(f"{'backing':10s} {'ms':>7s} {'GB/s':>7s} {'of stream':>9s} {'vs numpy':>9s} {'huge pages':>10s}")
    for name, t in med.items():
        gbs = nbytes / t / 1e9
        share = shares[name]
        print(f"{name:10s} {t * 1e3:7.3f} {gbs:7.1f} {gbs / stream:9.0%} {med['numpy'] / t:9.2f} "
              f"{'-' if share is None else f'{share:.0%}':>10s}" + (f"  ({notes[name]})" if notes.get(name) else ""))
        figures.append({"name": f"decode 1 token, weights in {name} memory", "value": gbs, "unit": "GB/s",
                        "reference": "streaming read, Numba parallel sum over 2 GB float32, all threads (same run)",
                        "reference_value": stream, "ratio": gbs / stream, "latency_ms": t * 1e3,
                        "vs_numpy_backing": med["numpy"] / t, "huge_page_share": share,
                        "note": notes.get(name)})
    config = {"shape": args.shape, "threads": cores, "bytes_read": int(nbytes), "routing": "cold",
              "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
              "file_dir": args.dir or tempfile.gettempdir(), "kernel": os.uname().release}
    if not args.no_write:
        print("wrote", write_result(f"expert-backing-shape{args.shape}", figures, config=config))
    return figures


def _huge_share_of(a: np.ndarray) -> float | None:
    """Fraction of the resident bytes in huge pages over the mappings that hold `a`, from /proc/self/smaps (NumPy's
    and the kernel's huge-page advice split one allocation into several mappings)."""
    start, end = a.ctypes.data, a.ctypes.data + a.nbytes
    rss = huge = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1])
            elif inside and head in ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:"):
                huge += int(line.split()[1])
    return huge / rss if rss else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    main()
