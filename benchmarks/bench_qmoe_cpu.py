"""Benchmark: our CPU QMoE (kernels.cpu.CpuQMoE) against onnxruntime's CPU QMoE on the same weights.

One QMoE node: hidden 2880, intermediate 2880, 32 experts, top-4, int4 block 32, swiglu fusion 1
(gpt-oss-like alpha 1.702, beta 1, limit 7), fp32 activations. Decode (1 token) and prefill (512 tokens).
Timings are medians over alternating blocks of runs after warm-up; onnxruntime intra_op_num_threads = numba
threads = all cores. Writes benchmarks/results/<benchmark>-<date>-<host>.json and prints a table.

    python benchmarks/bench_qmoe_cpu.py [--quick] [--runs N]

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
from kernels.reference import route  # noqa: E402
from benchmarks.common import ROOT, write_result  # noqa: E402

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


def time_blocks(fns: dict, runs: int, blocks: int = 3, warmup: int = 2) -> dict:
    """Median time per function. Runs come in alternating blocks (A x n, B x n, A x n, ...) with a short
    pause between blocks: on 2 cores, one runtime's thread pool still spinning after its call would
    otherwise slow the other's next call."""
    times = {k: [] for k in fns}
    per_block = max(1, runs // blocks)
    for _ in range(blocks):
        for k, f in fns.items():
            for _ in range(warmup):
                f()
            for _ in range(per_block):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
            time.sleep(0.2)
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    import numba
    import onnxruntime as ort
    from engine.ort_env import configure_global_threads
    from tests.qmoe_oracle import make_session

    cores = os.cpu_count() or 1
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
    for T, label in ((1, "decode"), (512, "prefill")):
        x = rng.standard_normal((T, H)).astype(np.float32)
        logits = rng.standard_normal((T, E)).astype(np.float32) * 2
        sess, feeds = make_session("QMoE", attrs, tensors, x, logits)
        ort_out = sess.run(None, feeds)[0]
        our_out = ours.forward(x, logits)
        rel = float(np.abs(our_out - ort_out).max() / np.abs(ort_out).max())
        runs = args.runs or ((7 if T > 1 else 50) if args.quick else (15 if T > 1 else 200))
        med = time_blocks({"ours": lambda: ours.forward(x, logits),
                           "ort": lambda: sess.run(None, feeds)}, runs=runs)
        ratio = med["ort"] / med["ours"]
        figures.append({"name": f"{label} {T} token{'s' if T > 1 else ''} latency", "value": med["ours"] * 1e3,
                        "unit": "ms", "reference": ref_name, "reference_value": med["ort"] * 1e3,
                        "ratio": ratio, "max_rel_diff_vs_reference": rel})
        if T == 1:
            ids, _ = route(logits, spec)
            nbytes = len(np.unique(ids)) * expert_weight_bytes
            figures.append({"name": "decode effective weight bandwidth", "value": nbytes / med["ours"] / 1e9,
                            "unit": "GB/s", "reference": ref_name, "reference_value": nbytes / med["ort"] / 1e9,
                            "ratio": (nbytes / med["ours"]) / (nbytes / med["ort"]),
                            "bytes_read": int(nbytes)})
        if T > 1:
            flops = 2.0 * T * K_TOP * (2 * I * H + H * I)
            figures.append({"name": f"{label} {T} tokens throughput", "value": flops / med["ours"] / 1e9,
                            "unit": "GFLOP/s", "reference": ref_name, "reference_value": flops / med["ort"] / 1e9,
                            "ratio": med["ort"] / med["ours"]})

    config = {"num_experts": E, "hidden_size": H, "inter_size": I, "k": K_TOP, "quant": f"int4 block {BLOCK}",
              "activation": "swiglu fusion 1", "dtype": "float32", "threads": cores,
              "numpy": np.__version__, "numba": numba.__version__, "onnxruntime": ort.__version__,
              "openblas_core": openblas_core(),
              "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}}
    print()
    print(f"{'figure':38s} {'ours':>10s} {'onnxruntime':>12s} {'unit':>8s} {'ratio':>7s}")
    for f in figures:
        print(f"{f['name']:38s} {f['value']:10.3f} {f['reference_value']:12.3f} {f['unit']:>8s} {f['ratio']:7.2f}")
    print("(ratio > 1: ours faster)")
    if not args.no_write:
        path = write_result(BENCHMARK, figures, config=config)
        print(f"wrote {path.relative_to(ROOT)}")
    return figures


if __name__ == "__main__":
    main()
