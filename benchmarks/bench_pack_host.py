"""Benchmark: one expert packed into the GPU kernels' layout on the host (GpuQMoE.pack_expert, the offload engine's
swap path): the Numba kernels of kernels.gpu.pack_host against the NumPy reference (kernels.gpu.layout.raw_sources +
layout.pack with xp=numpy, what pack_expert ran before). Needs no GPU.

Shapes (bench_qmoe_gpu's weights: int4 block 32, swiglu fusion 1 = interleaved, fp32 scales and biases, no zero
points; the fp16 copy of block scales "h" included):
  A  hidden 2880, intermediate 2880, 32 experts (gpt-oss-20b-like)
  B  hidden 2048, intermediate 768, 128 experts, top-8 (Qwen3-30B-A3B-like)
Each timed call packs the next expert (round robin), so the stored rows are not cache-hot; median of --runs calls
(after one warm-up call that also compiles or loads the Numba kernels). MB/s = packed bytes written per second.
Both paths' outputs are compared byte for byte first.

    python benchmarks/bench_pack_host.py [--runs N] [--no-write]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_gpu import SHAPES, attrs_for, make_weights  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from kernels.gpu import layout  # noqa: E402
from kernels.gpu.pack_host import pack_expert_host  # noqa: E402
from kernels.qmoe_spec import QMoESpec  # noqa: E402

REFERENCE = "NumPy layout.raw_sources + layout.pack (pack_expert before kernels.gpu.pack_host)"


def numpy_pack(spec, tensors, fc1, fc2, e: int) -> dict:
    es = np.asarray([e], dtype=np.int64)
    out = {}
    for p in (fc1, fc2):
        packed = layout.pack(p, *layout.raw_sources(spec, tensors, p, es, xp=np), xp=np)
        out[p.name] = {k: np.ascontiguousarray(v[0]) for k, v in packed.items()}
    return out


def median_ms(pack, num_experts: int, runs: int) -> float:
    pack(0)
    times = []
    for i in range(runs):
        started = time.perf_counter()
        pack((i + 1) % num_experts)
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def assert_identical(got: dict, want: dict) -> None:
    for proj, arrays in want.items():
        assert list(got[proj]) == list(arrays), (proj, list(got[proj]), list(arrays))
        for key, a in arrays.items():
            b = got[proj][key]
            assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (proj, key)


def bench_shape(sh: dict, runs: int) -> tuple[list[dict], dict]:
    tensors = make_weights(sh["E"], sh["H"], sh["I"], sh["block"])
    spec = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs_for(sh), tensors, (1, sh["H"]))
    fc1, fc2 = layout.make_layouts(spec, tensors)
    for e in (0, sh["E"] - 1):
        assert_identical(pack_expert_host(spec, tensors, fc1, fc2, e), numpy_pack(spec, tensors, fc1, fc2, e))
    packed_mb = (fc1.device_bytes() + fc2.device_bytes()) / 1e6
    fast = median_ms(lambda e: pack_expert_host(spec, tensors, fc1, fc2, e), sh["E"], runs)
    ref = median_ms(lambda e: numpy_pack(spec, tensors, fc1, fc2, e), sh["E"], max(5, runs // 4))
    label = sh["label"]
    print(f"{label:45s} {packed_mb:6.2f} MB packed   NumPy {ref:8.2f} ms ({packed_mb / ref * 1e3:7.0f} MB/s)   "
          f"Numba {fast:7.2f} ms ({packed_mb / fast * 1e3:7.0f} MB/s)   x{ref / fast:.1f}")
    figures = [
        {"name": f"pack one expert on the host, {label}", "value": fast, "unit": "ms", "reference": REFERENCE,
         "reference_value": ref, "ratio": ref / fast, "packed_mb": packed_mb},
        {"name": f"pack one expert on the host, throughput, {label}", "value": packed_mb / fast * 1e3,
         "unit": "MB/s", "reference": REFERENCE, "reference_value": packed_mb / ref * 1e3, "ratio": ref / fast},
    ]
    return figures, {"layout": f"int4 block {sh['block']}, swiglu fusion 1, fp32 scales, biases, no zero points",
                     "packed_mb": packed_mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=41, help="timed calls of the Numba path (NumPy: a quarter)")
    ap.add_argument("--no-write", action="store_true", help="print only, write no result file")
    args = ap.parse_args()
    figures, config = [], {"threads": numba.get_num_threads(), "numba": numba.__version__, "numpy": np.__version__}
    for name, sh in SHAPES.items():
        shape_figures, config[name] = bench_shape(sh, args.runs)
        figures += shape_figures
    if not args.no_write:
        print(f"wrote {write_result('pack-host', figures, config=config)}")


if __name__ == "__main__":
    main()
