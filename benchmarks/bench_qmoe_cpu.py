"""Benchmark: our CPU QMoE (kernels.cpu.CpuQMoE) against onnxruntime's CPU QMoE on the same weights.

One QMoE node: hidden 2880, intermediate 2880, 32 experts, top-4, int4 block 32, swiglu fusion 1
(gpt-oss-like alpha 1.702, beta 1, limit 7), fp32 activations. Decode (1 token) and prefill (512 tokens).
Timings are medians over alternating blocks of runs after warm-up; onnxruntime intra_op_num_threads = numba
threads = all cores. Writes benchmarks/results/<benchmark>-<date>-<host>.json and prints a table.

Inputs rotate, the same sequence for both sides: decode cycles through 64 (x, logits) pairs whose top-4 sets
are all different, every 8 consecutive ones covering all 32 experts (499 MB of weights between two uses of
an expert: more than any L3 here, so decode streams its 62 MB from DRAM as a real model's layers would);
prefill cycles through 8 pairs (each touches all 32 experts anyway). The machine's streaming read bandwidth
is measured in the same run (Numba parallel sum over a 2 GB float32 array, all threads, best of 5) and
decode's weight bytes / time is reported against it.

    python benchmarks/bench_qmoe_cpu.py [--quick] [--runs N] [--sweep]

--sweep also times our kernel's tuning knobs and the legacy per-expert path (ours only, same rotation) and
stores them under "sweep" in the JSON.

Note: our quantised prefill path uses its own dequant-GEMM micro-kernels, not NumPy's BLAS, so the
OPENBLAS_CORETYPE that the development sandbox sets does not affect these figures (the JSON records
the OpenBLAS core anyway: the float MoE op does go through BLAS).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.qmoe_spec import QMoESpec  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402
from kernels.cpu.simd import HAS_AVX512F  # noqa: E402
from benchmarks.common import ROOT, stream_read_bandwidth, write_result  # noqa: E402

BENCHMARK = "qmoe_cpu"
REFERENCE = "onnxruntime {} CPU QMoE"


def openblas_core() -> str | None:
    try:
        import ctypes
        import glob

        libs = glob.glob(str(Path(np.__file__).parent.parent / "numpy.libs" / "libscipy_openblas*.so*"))
        for lib in libs:
            h = ctypes.CDLL(lib)
            for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
                f = getattr(h, sym, None)
                if f is not None:
                    f.restype = ctypes.c_char_p
                    return f().decode()
    except Exception:
        return None
    return None


def make_weights(E, H, I, block, seed=0):
    rng = np.random.default_rng(seed)
    t = {
        "fc1_experts_weights": rng.integers(0, 256, size=(E, 2 * I, H // 2), dtype=np.uint8),
        "fc1_scales": (rng.uniform(0.5, 1.5, size=(E, 2 * I, H // block)) * rng.choice([-1, 1], size=(E, 2 * I, H // block))
                       * (0.25 / np.sqrt(H))).astype(np.float32),
        "fc1_experts_bias": (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32),
        "fc2_experts_weights": rng.integers(0, 256, size=(E, H, I // 2), dtype=np.uint8),
        "fc2_scales": (rng.uniform(0.5, 1.5, size=(E, H, I // block)) * rng.choice([-1, 1], size=(E, H, I // block))
                       * (0.25 / np.sqrt(I))).astype(np.float32),
        "fc2_experts_bias": (rng.standard_normal((E, H)) * 0.1).astype(np.float32),
    }
    return t


def time_blocks(fns: dict, runs: int, blocks: int = 3, warmup: int = 2, pause: float = 0.2) -> dict:
    """Median time per function. Each function takes the call number i and uses input i mod n (its own
    counter, so every side walks the same rotation). Runs come in alternating blocks (A x n, B x n, A x n,
    ...) with a short pause between blocks: on 2 cores, one runtime's thread pool still spinning after its
    call would otherwise slow the other's next call."""
    times = {k: [] for k in fns}
    calls = {k: 0 for k in fns}
    per_block = max(1, runs // blocks)
    for _ in range(blocks):
        for k, f in fns.items():
            for _ in range(warmup):
                f(calls[k])
                calls[k] += 1
            for _ in range(per_block):
                t0 = time.perf_counter()
                f(calls[k])
                times[k].append(time.perf_counter() - t0)
                calls[k] += 1
            time.sleep(pause)
    return {k: float(np.median(v)) for k, v in times.items()}


def decode_routings(rng, E: int, k: int, n: int = 64):
    """n router-logit rows [n, 1, E] whose top-k sets are all different; each run of E // k consecutive rows
    is one random partition of the experts (so an expert comes back only after all others ran)."""
    for _ in range(100):
        sets = []
        while len(sets) < n:
            perm = rng.permutation(E)
            sets += [np.sort(perm[i:i + k]) for i in range(0, E - E % k, k)]
        sets = sets[:n]
        if len({tuple(s) for s in sets}) == n:
            break
    logits = (rng.standard_normal((n, 1, E)) * 0.5).astype(np.float32)
    for i, st in enumerate(sets):
        logits[i, 0, st] += 4.0 + rng.standard_normal(k).astype(np.float32) * 0.5
    return logits, [tuple(int(e) for e in st) for st in sets]


def machine_details() -> dict:
    """Threads per core etc. (lscpu), Numba's threading layer."""
    info = {}
    try:
        import subprocess

        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache", "L3 cache",
                               "L1d cache", "Model name", "CPU max MHz"):
                info[key.strip()] = val.strip()
    except Exception:
        pass
    try:
        import numba

        info["numba_threading_layer"] = numba.threading_layer()
    except Exception:
        pass
    return info


SWEEP = [  # (label, T, attribute overrides of CpuQMoE)
    ("legacy per-expert path", 1, dict(batched=False)),
    ("legacy per-expert path", 512, dict(batched=False)),
    ("decode no software prefetch", 1, dict(gemv_prefetch_rows=0)),
    ("decode prefetch 2 rows", 1, dict(gemv_prefetch_rows=2)),
    ("decode prefetch 8 rows", 1, dict(gemv_prefetch_rows=8)),
    ("decode prefetch 16 rows", 1, dict(gemv_prefetch_rows=16)),
    ("decode chunks of 16 KB", 1, dict(gemv_chunk_kb=16)),
    ("decode chunks of 256 KB", 1, dict(gemv_chunk_kb=256)),
    ("decode own spans, then steal", 1, dict(gemv_schedule=1)),
    ("decode half the threads", 1, dict(num_threads=-2)),
    ("prefill kc 128", 512, dict(gemm_kc=128)),
    ("prefill rows 144", 512, dict(gemm_rows=144)),
    ("prefill half the threads", 512, dict(num_threads=-2)),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time our tuning knobs (ours only)")
    args = ap.parse_args(argv)

    import numba
    import onnxruntime as ort
    from engine.ort_env import configure_global_threads
    from tests.qmoe_oracle import make_session

    cores = os.cpu_count() or 1
    numba.set_num_threads(cores)
    print("measuring streaming read bandwidth (2 GB, all threads) ...", flush=True)
    stream_gbs = stream_read_bandwidth()
    print(f"  {stream_gbs:.1f} GB/s", flush=True)
    configure_global_threads(cores)  # onnxruntime's pool: as many threads as Numba gets
    E, H, I, K_TOP, BLOCK = 32, 2880, 2880, 4, 32
    attrs = dict(k=K_TOP, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
                 swiglu_limit=7.0, normalize_routing_weights=1, expert_weight_bits=4, block_size=BLOCK,
                 weights_prepacked=0)
    print(f"building weights: E={E} H={H} I={I} top-{K_TOP} int4 block {BLOCK} swiglu fusion 1 ...", flush=True)
    tensors = make_weights(E, H, I, BLOCK)
    spec = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs, tensors, (1, H))
    ours = CpuQMoE(spec, tensors, num_threads=cores)
    numba.set_num_threads(cores)
    ref_name = REFERENCE.format(ort.__version__)
    rng = np.random.default_rng(1)
    figures = []
    expert_weight_bytes = sum(tensors[f"fc{i}_{n}"][0].nbytes for i in (1, 2)
                              for n in ("experts_weights", "scales", "experts_bias"))
    sweep = []
    for T, label in ((1, "decode"), (512, "prefill")):
        if T == 1:
            logits_all, sets = decode_routings(rng, E, K_TOP)
            n_in = len(sets)
        else:
            n_in = 8
            logits_all = (rng.standard_normal((n_in, T, E)) * 2).astype(np.float32)
        xs = rng.standard_normal((n_in, T, H)).astype(np.float32)
        sess, _ = make_session("QMoE", attrs, tensors, xs[0], logits_all[0])
        feeds = [{"input": xs[i], "router_probs": logits_all[i]} for i in range(n_in)]
        rel = 0.0
        for i in range(min(n_in, 4)):
            ort_out = sess.run(None, feeds[i])[0]
            our_out = ours.forward(xs[i], logits_all[i])
            rel = max(rel, float(np.abs(our_out - ort_out).max() / np.abs(ort_out).max()))
        runs = args.runs or ((7 if T > 1 else 64) if args.quick else (16 if T > 1 else 256))
        med = time_blocks({"ours": lambda i: ours.forward(xs[i % n_in], logits_all[i % n_in]),
                           "ort": lambda i: sess.run(None, feeds[i % n_in])}, runs=runs)
        ratio = med["ort"] / med["ours"]
        figures.append({"name": f"{label} {T} token{'s' if T > 1 else ''} latency", "value": med["ours"] * 1e3,
                        "unit": "ms", "reference": ref_name, "reference_value": med["ort"] * 1e3,
                        "ratio": ratio, "max_rel_diff_vs_reference": rel, "inputs_rotated": n_in})
        if T == 1:
            nbytes = K_TOP * expert_weight_bytes  # every decode input routes to 4 different experts
            figures.append({"name": "decode effective weight bandwidth", "value": nbytes / med["ours"] / 1e9,
                            "unit": "GB/s", "reference": ref_name, "reference_value": nbytes / med["ort"] / 1e9,
                            "ratio": (nbytes / med["ours"]) / (nbytes / med["ort"]),
                            "bytes_read": int(nbytes)})
            figures.append({"name": "decode weight bandwidth vs measured DRAM streaming read bandwidth",
                            "value": nbytes / med["ours"] / 1e9, "unit": "GB/s",
                            "reference": f"streaming read, Numba parallel sum over 2 GB float32, {cores} threads, "
                                         "best of 5 (same run)",
                            "reference_value": stream_gbs, "ratio": (nbytes / med["ours"] / 1e9) / stream_gbs,
                            "bytes_read": int(nbytes),
                            "onnxruntime_ratio": (nbytes / med["ort"] / 1e9) / stream_gbs})
        if args.sweep:
            for name, sT, over in SWEEP:
                if sT != T:
                    continue
                m = CpuQMoE(spec, tensors, num_threads=cores)
                for key, val in over.items():
                    setattr(m, key, max(1, cores // 2) if (key == "num_threads" and val == -2) else val)
                rs = max(3, runs // 2)
                t_var = time_blocks({"v": lambda i: m.forward(xs[i % n_in], logits_all[i % n_in]),
                                     "ours": lambda i: ours.forward(xs[i % n_in], logits_all[i % n_in])},
                                    runs=rs, blocks=2, pause=0.05)
                numba.set_num_threads(cores)
                sweep.append({"variant": name, "tokens": T, "ms": t_var["v"] * 1e3, "default_ms": t_var["ours"] * 1e3,
                              "speedup_vs_default": t_var["ours"] / t_var["v"]})
                print(f"  sweep {name:28s} T={T:4d} {t_var['v'] * 1e3:9.3f} ms (default {t_var['ours'] * 1e3:.3f})",
                      flush=True)
        if T > 1:
            flops = 2.0 * T * K_TOP * (2 * I * H + H * I)
            figures.append({"name": f"{label} {T} tokens throughput", "value": flops / med["ours"] / 1e9,
                            "unit": "GFLOP/s", "reference": ref_name, "reference_value": flops / med["ort"] / 1e9,
                            "ratio": med["ort"] / med["ours"]})

    config = {"num_experts": E, "hidden_size": H, "inter_size": I, "k": K_TOP, "quant": f"int4 block {BLOCK}",
              "activation": "swiglu fusion 1", "dtype": "float32", "threads": cores,
              "numpy": np.__version__, "numba": numba.__version__, "onnxruntime": ort.__version__,
              "openblas_core": openblas_core(), "machine_details": machine_details(),
              "stream_read_gbs": stream_gbs, "int4_table_kernels": bool(HAS_AVX512F),
              "kernel": {k: getattr(ours, k) for k in ("batched", "gemv_max_rows", "gemm_kc", "gemm_rows",
                                                       "gemm_cols", "gemv_prefetch_rows", "gemv_chunk_kb",
                                                       "gemv_schedule")},
              "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}}
    print()
    print(f"{'figure':38s} {'ours':>10s} {'reference':>12s} {'unit':>8s} {'ratio':>7s}")
    for f in figures:
        print(f"{f['name'][:38]:38s} {f['value']:10.3f} {f['reference_value']:12.3f} {f['unit']:>8s} {f['ratio']:7.2f}")
    print("(ratio > 1: ours faster; the last decode line: ours / streaming read bandwidth)")
    if not args.no_write:
        extra = {"sweep": sweep} if sweep else {}
        path = write_result(BENCHMARK, figures, config=config, **extra)
        print(f"wrote {path.relative_to(ROOT)}")
    return figures


if __name__ == "__main__":
    main()
