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

--issue (needs CUDA): instead, the host seconds to ISSUE a decode step's copies of m = 1, 4, 8 experts straight
from page-locked stored rows (the engine's registered mapping) into GPU slots 0..m-1, converted there: one
GpuQMoE.upload_expert_device per expert (the stored tensors' copies and one pack_expert launch), through the driver
(kernels.gpu.driver_calls: staging buffer, memcpy batch and launch arguments made once) with an expert's memcpys in
one cuMemcpyBatchAsync ("batch") or one cuMemcpyHtoDAsync per stored tensor ("driver"; the switch
GpuQMoE.batch_copies) against through CuPy (a pool allocation, CuPy's runtime calls and RawKernel call; the switch
GpuQMoE.driver_copies). Only the issuing calls are timed (not the engine's order-after-copies event pair). Median of
--runs batches per path, the three paths taking turns on the same experts, the device drained between batches (not
timed); before each batch slots 0..m-1 are filled with a byte pattern and evicted, after it their contents, both host
maps and the device's expert -> slot map are kept and compared byte for byte between the paths.

    python benchmarks/bench_pack_host.py --issue [--runs N] [--no-write]
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


# --issue's paths: (GpuQMoE.driver_copies, GpuQMoE.batch_copies)
PATHS = {"CuPy": (False, False), "driver": (True, False), "batch": (True, True)}


def issue_seconds(gpu, copy_stream, experts: list, path: str) -> float:
    """Host seconds to issue the copies of `experts` into slots 0..m-1 one by one, along one of PATHS."""
    gpu.driver_copies, gpu.batch_copies = PATHS[path]
    started = time.perf_counter()
    for slot, e in enumerate(experts):
        gpu.upload_expert_device(e, slot, stream=copy_stream)
    seconds = time.perf_counter() - started
    copy_stream.synchronize()
    return seconds


def clear_slots(gpu, copy_stream, m: int) -> None:
    """Slots 0..m-1 filled with a byte pattern and evicted (not timed): a path that wrote nothing cannot pass the
    comparison with the other's leftovers."""
    with copy_stream:
        for arrays in gpu.slots.values():
            for a in arrays.values():
                a[:m].view(np.uint8).fill(0xA5)
    for slot in range(m):
        gpu.evict(slot, stream=copy_stream)
    copy_stream.synchronize()


def slot_snapshot(cp, gpu, m: int) -> dict:
    """Slots 0..m-1 and the maps, on the host, after the copies finished."""
    snap = {f"{name}.{key}": cp.asnumpy(a[:m]).view(np.uint8) for name, arrays in gpu.slots.items()
            for key, a in arrays.items()}
    snap.update(slot_of=gpu.slot_of.copy(), expert_in_slot=gpu.expert_in_slot.copy(),
                slot_dev=cp.asnumpy(gpu._slot_dev))
    return snap


def assert_same_snapshot(got: dict, want: dict, what: str) -> None:
    for key, a in want.items():
        assert got[key].tobytes() == a.tobytes(), f"{what}: {key} differs"


def driver_parts(gpu, copy_stream, num_experts: int, runs: int) -> tuple[float, float, float]:
    """Per expert, median host us of the driver path's single memcpys alone, of its memcpy batch alone (the sources
    written and the one call) and of its prepared launch alone (what remains of upload_expert_device is Python around
    them). Leaves the last slot written inconsistent with the maps: run last."""
    issuer = gpu._driver_issuers[copy_stream.ptr]
    memcpy, staging, stream, batch = issuer._memcpy, issuer._staging, copy_stream.ptr, issuer.batch
    copies_s, batch_s, launch_s = [], [], []
    for i in range(runs + 1):
        e = i % num_experts
        started = time.perf_counter()
        for offset, address, row_bytes in gpu._pack_copies:
            memcpy(staging + offset, address + e * row_bytes, row_bytes, stream)
        copied = time.perf_counter()
        issuer.launch.launch()
        launched = time.perf_counter()
        copy_stream.synchronize()
        batch_started = time.perf_counter()
        for j, (_, address, row_bytes) in enumerate(gpu._pack_copies):
            batch.sources[j] = address + e * row_bytes
        batch.copy()
        batched = time.perf_counter()
        issuer.launch.launch()
        copy_stream.synchronize()
        copies_s.append(copied - started)
        batch_s.append(batched - batch_started)
        launch_s.append(launched - copied)
    return tuple(float(np.median(t[1:])) * 1e6 for t in (copies_s, batch_s, launch_s))


def bench_issue(key: str, sh: dict, runs: int) -> list[dict]:
    """--issue for one shape: host seconds through the driver (batched memcpys, single memcpys) against through
    CuPy for m = 1, 4, 8."""
    import cupy as cp

    from benchmarks.bench_qmoe_gpu import node_for
    from kernels.gpu.qmoe import GpuQMoE

    spec, tensors = node_for(key)
    registered = [a for a in tensors.values() if isinstance(a, np.ndarray) and a.ndim == 3]
    for a in registered:  # page-locked, as the engine's registered mapping: the copies are DMAs
        cp.cuda.runtime.hostRegister(a.ctypes.data, a.nbytes, 0)
    try:
        gpu = GpuQMoE(spec, tensors, num_slots=8, resident=[])
        assert gpu._pack_desc is not None, "this layout does not take pack_expert"
        copy_stream = cp.cuda.Stream(non_blocking=True)
        expert_mb = gpu._pack_bytes / 1e6
        figures, turn = [], 0
        for m in (1, 4, 8):
            times = {path: [] for path in PATHS}
            for run in range(runs + 1):  # the first: kernel loading, pool growth, the staging buffer, the batch
                experts = [(turn + j) % sh["E"] for j in range(m)]
                turn += m
                snaps = {}
                order = list(PATHS)[run % 3:] + list(PATHS)[:run % 3]  # taking turns to go first
                for path in order:
                    clear_slots(gpu, copy_stream, m)
                    times[path].append(issue_seconds(gpu, copy_stream, experts, path))
                    snaps[path] = slot_snapshot(cp, gpu, m)
                for path in ("driver", "batch"):
                    assert_same_snapshot(snaps[path], snaps["CuPy"],
                                         f"{sh['label']}, m={m}, experts {experts}: the {path} path against CuPy's")
            assert gpu.driver_copy_fallback is None, f"the driver path fell back: {gpu.driver_copy_fallback}"
            assert gpu.batch_copy_fallback is None, f"the batch memcpy fell back: {gpu.batch_copy_fallback}"
            med = {path: float(np.median(t[1:])) * 1e6 for path, t in times.items()}
            print(f"{sh['label']:45s} {expert_mb:5.2f} MB/expert  m={m}  "
                  + "   ".join(f"{path} {med[path]:7.1f} us ({med[path] / m:5.1f}/expert)" for path in PATHS)
                  + f"   x{med['CuPy'] / med['driver']:.2f} x{med['CuPy'] / med['batch']:.2f}   byte-identical")
            figures.append({"name": f"issue {m} expert copies through the driver, {sh['label']}",
                            "value": med["driver"], "unit": "us",
                            "reference": "the same copies through CuPy (GpuQMoE.driver_copies False)",
                            "reference_value": med["CuPy"], "ratio": med["CuPy"] / med["driver"],
                            "expert_mb": expert_mb, "copies_per_expert": len(gpu._pack_copies)})
            figures.append({"name": f"issue {m} expert copies through the driver, one batch memcpy per expert, "
                                    f"{sh['label']}", "value": med["batch"], "unit": "us",
                            "reference": "the same copies through the driver, one memcpy per stored tensor "
                                         "(GpuQMoE.batch_copies False)",
                            "reference_value": med["driver"], "ratio": med["driver"] / med["batch"],
                            "cupy_value": med["CuPy"], "expert_mb": expert_mb,
                            "copies_per_expert": len(gpu._pack_copies),
                            "batch_call": gpu._driver_issuers[copy_stream.ptr].batch.name})
        gpu.driver_copies = gpu.batch_copies = True
        memcpys_us, batch_us, launch_us = driver_parts(gpu, copy_stream, sh["E"], runs)
        print(f"{sh['label']:45s} driver path per expert: {len(gpu._pack_copies)} memcpys {memcpys_us:5.1f} us, "
              f"one batch of them {batch_us:5.1f} us, launch {launch_us:5.1f} us (the rest: Python around them)")
        figures.append({"name": f"driver path per expert, memcpys alone, {sh['label']}", "value": memcpys_us,
                        "unit": "us", "copies_per_expert": len(gpu._pack_copies)})
        figures.append({"name": f"driver path per expert, one batch memcpy alone, {sh['label']}", "value": batch_us,
                        "unit": "us", "reference": "the same copies one memcpy per stored tensor",
                        "reference_value": memcpys_us, "ratio": memcpys_us / batch_us,
                        "copies_per_expert": len(gpu._pack_copies)})
        figures.append({"name": f"driver path per expert, launch alone, {sh['label']}", "value": launch_us,
                        "unit": "us"})
        return figures
    finally:
        for a in registered:
            cp.cuda.runtime.hostUnregister(a.ctypes.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=41, help="timed calls of the Numba path (NumPy: a quarter)")
    ap.add_argument("--no-write", action="store_true", help="print only, write no result file")
    ap.add_argument("--issue", action="store_true", help="CUDA: host seconds to issue m expert copies (see above)")
    args = ap.parse_args()
    if args.issue:
        figures = [f for key, sh in SHAPES.items() for f in bench_issue(key, sh, args.runs)]
        if not args.no_write:
            print(f"wrote {write_result('copy-issue', figures)}")
        return
    figures, config = [], {"threads": numba.get_num_threads(), "numba": numba.__version__, "numpy": np.__version__}
    for name, sh in SHAPES.items():
        shape_figures, config[name] = bench_shape(sh, args.runs)
        figures += shape_figures
    if not args.no_write:
        print(f"wrote {write_result('pack-host', figures, config=config)}")


if __name__ == "__main__":
    main()
