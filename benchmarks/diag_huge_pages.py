"""Diagnosis: does the CPU decode kernel read its experts faster from 2 MB pages than from 4 KB pages (issue #3 / #4)?

The kernel reads each cold expert once a call, as one stream per thread of 64 KB chunks; every 4 KB page of a stream
costs a translation, and a core's hardware prefetchers stop at a 4 KB boundary. The node benchmark's experts are
NumPy arrays (4 KB pages unless the kernel's transparent huge pages are "always"), the engine's are the model file's
page-cache pages. Here one node of Qwen3-30B-A3B's shape (hidden 2048, intermediate 768, top-8, int4 block 32,
float32 scales) is built twice over copies of the same tensors: one in private anonymous memory advised
MADV_NOHUGEPAGE (4 KB pages), one advised MADV_HUGEPAGE (2 MB pages where the kernel gives them: the count is
printed). Cold calls (one token, eight experts a call, a fixed random order of all experts: each comes back after
E / 8 - 1 other calls) alternate between the two nodes in rounds; each round's median call, and the ratio of the
2 MB node's to the 4 KB node's, per thread count.

    python benchmarks/diag_huge_pages.py [--threads 1,16] [--experts 256] [--rounds 8] [--calls 64]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  the engine's OpenMP wait default, set before Numba's runtime loads
from benchmarks.bench_qmoe_cpu import make_layout_weights  # noqa: E402
from benchmarks.common import median_seconds  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402
from kernels.qmoe_spec import QMoESpec  # noqa: E402

H, I, TOP_K = 2048, 768, 8
HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "absent"."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def in_pages(a: np.ndarray, huge: bool, keep: list) -> np.ndarray:
    """A copy of `a` in a private anonymous mapping aligned at 2 MB, advised MADV_HUGEPAGE (huge) or
    MADV_NOHUGEPAGE before its first touch; the mapping is appended to `keep`, which must outlive the copy."""
    mapping = mmap.mmap(-1, a.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(mapping)
    raw = np.frombuffer(mapping, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    advice = mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE
    mapping.madvise(advice, start, (len(mapping) - start) // mmap.PAGESIZE * mmap.PAGESIZE)
    copy = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    copy[...] = a
    return copy


def huge_page_bytes(arrays) -> int:
    """Bytes of the arrays' mappings that /proc/self/smaps reports in anonymous huge pages."""
    starts = [a.ctypes.data for a in arrays]
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = any(low <= s < high for s in starts)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def cold_ids(order: np.ndarray, call: int) -> np.ndarray:
    """The experts of cold call number `call`: window `call` of TOP_K experts of the fixed order, cyclically."""
    return order[(np.arange(TOP_K) + call * TOP_K) % order.size].reshape(1, TOP_K).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=64)
    args = parser.parse_args()
    attrs, tensors = make_layout_weights("int4", args.experts, H, I)
    attrs["k"] = TOP_K
    spec = QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, H))
    keep: list = []
    copies = {name: {key: in_pages(a, huge, keep) if isinstance(a, np.ndarray) and a.nbytes >= HUGE_PAGE else a
                     for key, a in tensors.items()} for name, huge in (("4 KB", False), ("2 MB", True))}
    del tensors
    nodes = {name: CpuQMoE(spec, copy) for name, copy in copies.items()}
    big = {name: [a for a in copy.values() if isinstance(a, np.ndarray) and a.nbytes >= HUGE_PAGE]
           for name, copy in copies.items()}
    call_bytes = TOP_K * sum(a[0].nbytes for a in big["4 KB"])
    print(f"node: hidden {H}, intermediate {I}, {args.experts} experts, top-{TOP_K}, int4 block 32, float32 scales; "
          f"{call_bytes / 1e6:.1f} MB a call; transparent huge pages: {thp_mode()}; in huge pages: "
          + ", ".join(f"{name} copy {huge_page_bytes(arrays) / 2**20:.0f} of "
                      f"{sum(a.nbytes for a in arrays) / 2**20:.0f} MiB" for name, arrays in big.items()))
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    weights = np.full((1, TOP_K), 1.0 / TOP_K, np.float32)
    order = np.random.default_rng(1).permutation(args.experts)
    for threads in [int(t) for t in args.threads.split(",")]:
        use_threads(threads)
        medians = {name: [] for name in nodes}
        call = 0
        for _ in range(args.rounds):
            for name, node in nodes.items():
                def one_call(node=node):
                    nonlocal call
                    node.run_experts(x, cold_ids(order, call), weights)
                    call += 1
                medians[name].append(median_seconds(one_call, args.calls, warmup=4))
        ratios = [huge / small for huge, small in zip(medians["2 MB"], medians["4 KB"])]
        cells = [f"{name} {statistics.median(m) * 1e6:7.1f} µs = {call_bytes / statistics.median(m) / 1e9:5.1f} GB/s"
                 for name, m in medians.items()]
        print(f"{threads:3d} threads: " + "  |  ".join(cells) + f"  |  2 MB / 4 KB per round: median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
