"""Benchmark: our CPU QMoE (kernels.cpu.CpuQMoE) against onnxruntime's CPU QMoE on the same weights.

One QMoE node: hidden 2880, intermediate 2880, 32 experts, top-4, int4 block 32, swiglu fusion 1
(gpt-oss-like alpha 1.702, beta 1, limit 7), fp32 activations. Decode (1 token) and prefill (512 tokens).
Timings are medians over alternating blocks of runs after warm-up; onnxruntime intra_op_num_threads = numba
threads = all cores. Writes benchmarks/results/<benchmark>-<date>-<host>.json and prints a table.

Inputs rotate, the same sequence for both sides: decode cycles through 64 (x, logits) pairs whose top-4 sets
are all different, every 8 consecutive ones covering all 32 experts (499 MB of weights between two uses of
an expert: more than any L3 here, so decode streams its 62 MB from DRAM as a real model's layers would);
prefill cycles through 8 pairs (each touches all 32 experts anyway). The machine's streaming read bandwidth
is measured in the same run (Numba parallel sum over a 2 GB float32 array, all threads, best of 5), before and
after the decode timings, and decode's weight bytes / time is reported against the larger of the two: on the H200
machine the streaming read moved 82-140 GB/s between processes minutes apart (RESULTS.md, "Forty-seventh session"),
so one measurement can miss what the machine did while the kernel ran.

    python benchmarks/bench_qmoe_cpu.py [--quick] [--runs N] [--sweep] [--layout int4|mxfp4|nvfp4|int2|int2b16|int3]
                                        [--shape A|B] [--routing rotate|cold] [--no-prefill] [--no-generic]

--shape picks the node: A (default, gpt-oss-20b-like, above) or B (Qwen3-30B-A3B-like: hidden 2048, intermediate
768, 128 experts, top-8; 2.96 MB an int4 expert, 23.7 MB a decode token). --routing cold: decode inputs take
their top-k sets as consecutive windows of one fixed random order of all experts, cyclically, so every expert comes
back only after all the others (B: 15 calls = 355 MB in between, A: 7 calls = 436 MB); the default rotation's
random partitions (all sets different) can bring an expert back in the next call (B: 21 MB in between, which the
Xeon's 300 MiB L3 still holds). The JSON records the shortest reuse distance (calls in between) either way.

--layout (default int4) picks the expert weight layout of the same node: mxfp4 (E2M1, e8m0 block-32 scales,
global scales), nvfp4 (E2M1 K-packed, e4m3 block-16 scales, global scales), int2 (block 32, float scales), int2b16
(int2 block 16, float scales; also timed against our int2 block-32 path on int2 block-32 weights), int3
(bit stream, block 32, positive float scales; onnxruntime 1.32 runs int3 only with fp16 / bf16 activations, so its
side gets the same codes with fp16 activations, scales and biases, which the fp32 ones here are rounded to).
Every run also times, in the same alternating blocks: kernels.cpu.generic's GenericQMoE on the same weights
(the path these layouts took before they had fast kernels) and, for the other layouts, our int4 fast path on
int4 weights of the same node; onnxruntime where its CPU QMoE runs the layout (not MXFP4 in 1.32). Results of
other layouts go to benchmarks/results/qmoe-cpu-<layout>-<date>-<host>.json.

--dtype float16 makes the node what fp16 models carry: fp16 activations, scales and biases, on both sides; our fast
path on the float32 node with the same codes is timed beside it (results: ...-shapeX-ROUTING-float16.json).

--sweep also times our kernel's tuning knobs and the legacy per-expert path (ours only, same rotation) and
stores them under "sweep" in the JSON.

Note: our quantised prefill path uses its own dequant-GEMM micro-kernels, not NumPy's BLAS, so the
OPENBLAS_CORETYPE that the development sandbox sets does not affect these figures (the JSON records
the OpenBLAS core anyway: the float MoE op does go through BLAS).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  the engine's OpenMP wait default (engine/__init__.py), set before Numba's runtime loads
from kernels.qmoe_spec import QMoESpec  # noqa: E402
from kernels.cpu import CpuQMoE  # noqa: E402
from kernels.cpu.simd import HAS_AVX512F  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402
from benchmarks.common import ROOT, stream_read_bandwidth, write_result  # noqa: E402
from engine.host_load import HostLoadMeter  # noqa: E402

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


def make_layout_weights(layout, E, H, I, seed=0):
    """(attrs, tensors) of the benchmark node in the given layout: uniform random codes, scales sized so that
    outputs stay O(1), biases; built from random bytes (the layout cases of the tests would need GBs here)."""
    attrs = dict(k=4, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0,
                 swiglu_limit=7.0, normalize_routing_weights=1)
    if layout == "int4":
        return dict(attrs, expert_weight_bits=4, block_size=32, weights_prepacked=0), make_weights(E, H, I, 32, seed)
    import ml_dtypes

    rng = np.random.default_rng(seed)
    t = {}
    for p, n, k in (("fc1", 2 * I, H), ("fc2", H, I)):
        if layout == "int3":  # 8 codes per 3 bytes; scales / biases exactly representable in fp16
            t[f"{p}_experts_weights"] = rng.integers(0, 256, size=(E, n, k * 3 // 8), dtype=np.uint8)
            t[f"{p}_scales"] = (rng.uniform(0.5, 1.5, size=(E, n, k // 32)) * (0.5 / np.sqrt(k))
                                ).astype(np.float16).astype(np.float32)
        elif layout in INT2_BLOCKS:
            nb = k // INT2_BLOCKS[layout]
            t[f"{p}_experts_weights"] = rng.integers(0, 256, size=(E, n, k // 4), dtype=np.uint8)
            t[f"{p}_scales"] = (rng.uniform(0.5, 1.5, size=(E, n, nb)) * rng.choice([-1, 1], size=(E, n, nb))
                                * (0.5 / np.sqrt(k))).astype(np.float32)
        else:
            blk = 32 if layout == "mxfp4" else 16
            t[f"{p}_experts_weights"] = rng.integers(0, 256, size=(E, n, k // 2), dtype=np.uint8)
            if layout == "mxfp4":  # e8m0 2^(e - 127) around 2^-1.5 (x global 1/64 x E2M1 ~ 1/sqrt(K))
                codes = rng.integers(125, 128, size=(E, n, k // blk), dtype=np.uint8)
                t[f"{p}_scales"] = codes.view(ml_dtypes.float8_e8m0fnu)
            else:  # e4m3 exponent field 5: 0.25 .. 0.47, random sign
                codes = ((5 << 3) | rng.integers(0, 8, size=(E, n, k // blk)) |
                         (rng.integers(0, 2, size=(E, n, k // blk)) << 7)).astype(np.uint8)
                t[f"{p}_scales"] = codes.view(ml_dtypes.float8_e4m3fn)
            t[f"{p}_global_scale"] = np.full(E, 1 / 64 * 16 / np.sqrt(k) * (0.5 if layout == "nvfp4" else 1.0),
                                             np.float32)
        t[f"{p}_experts_bias"] = (rng.standard_normal((E, n)) * 0.1).astype(np.float16).astype(np.float32)
    if layout in INT2_BLOCKS or layout == "int3":
        attrs.update(expert_weight_bits=int(layout[3]), block_size=INT2_BLOCKS.get(layout, 32), weights_prepacked=0)
    else:
        attrs.update(quant_type="fp4" if layout == "mxfp4" else "nvfp4", expert_weight_bits=4)
        if layout == "nvfp4":
            attrs["weights_prepacked"] = 1  # K-packed: the layout onnxruntime's CPU kernel reads
    return attrs, t


def time_blocks(fns: dict, runs: int, blocks: int = 3, warmup: int = 2, pause: float = 0.2,
                warm_s: float = 0.1) -> dict:
    """Median time per function. Each function takes the call number i and uses input i mod n (its own
    counter, so every side walks the same rotation). Runs come in alternating blocks (A x n, B x n, A x n,
    ...) with a short pause between blocks: on 2 cores, one runtime's thread pool still spinning after its
    call would otherwise slow the other's next call. Each block starts with at least `warmup` untimed calls
    lasting at least warm_s seconds: on the dev VM, decode calls in the ~50 ms after a 0.2 s pause ran 1.6x
    slower (shape B: 1.6 vs 1.0 ms), so 2 warm-up calls left whole decode blocks in that state."""
    times = {k: [] for k in fns}
    calls = {k: 0 for k in fns}
    per_block = max(1, runs // blocks)
    for _ in range(blocks):
        for k, f in fns.items():
            n, t_end = 0, time.perf_counter() + warm_s
            while n < warmup or time.perf_counter() < t_end:
                f(calls[k])
                calls[k] += 1
                n += 1
            for _ in range(per_block):
                t0 = time.perf_counter()
                f(calls[k])
                times[k].append(time.perf_counter() - t0)
                calls[k] += 1
            time.sleep(pause)
    return {k: float(np.median(v)) for k, v in times.items()}


def decode_routings(rng, E: int, k: int, n: int = 64, cold: bool = False):
    """n router-logit rows [n, 1, E]; each run of E // k consecutive rows is a partition of the experts.
    Default: random partitions whose top-k sets are all different. cold: consecutive windows of k of one fixed
    random order (the same partition every pass; n a multiple of E // k), so an expert comes back only after
    E // k - 1 other calls."""
    if cold:
        order = rng.permutation(E)
        sets = [np.sort(order[(np.arange(k) + i * k) % E]) for i in range(n)]
    for _ in range(0 if cold else 100):
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


@dataclass
class ColdDecodeNode:
    """The int4 block-32 node of a benchmark shape with a cold decode routing (decode_routings cold): what
    bench_expert_backing, bench_host_contention and bench_cpu_gap time in their own ways."""
    spec: QMoESpec
    tensors: dict
    logits: np.ndarray  # [n, 1, E] router logits, one decode call each
    xs: np.ndarray      # [n, 1, H] activations
    nbytes: int         # weight bytes one call reads (top-k experts, float32 scales and biases as built)


def cold_decode_node(shape: str) -> ColdDecodeNode:
    E, H, I, K = SHAPES[shape]
    attrs, tensors = make_layout_weights("int4", E, H, I)
    attrs["k"] = K
    spec = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs, tensors, (1, H))
    logits, xs = cold_decode_inputs(E, H, K)
    return ColdDecodeNode(spec, tensors, logits, xs, K * spec.expert_bytes(scale_bytes=4, bias_bytes=4))


def cold_decode_inputs(E: int, H: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """The router logits [n, 1, E] of a cold decode routing (decode_routings cold) over E experts, top-K, and
    activations [n, 1, H], one decode call each (cold_decode_node's, and bench_offload's calibration on a model's)."""
    rng = np.random.default_rng(1)
    logits, _ = decode_routings(rng, E, K, cold=True)
    return logits, rng.standard_normal((len(logits), 1, H)).astype(np.float32)


def min_reuse_calls(sets) -> int:
    """Fewest calls between two uses of one expert in the cyclic walk through sets (0: an expert used twice in a
    row)."""
    last, best, n = {}, len(sets), len(sets)
    for i in range(2 * n):
        for e in sets[i % n]:
            if e in last:
                best = min(best, i - last[e] - 1)
            last[e] = i
    return best


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
    ("decode chunks of 32 KB", 1, dict(gemv_chunk_kb=32)),
    ("decode chunks of 128 KB", 1, dict(gemv_chunk_kb=128)),
    ("decode chunks of 256 KB", 1, dict(gemv_chunk_kb=256)),
    ("decode one shared counter", 1, dict(gemv_schedule=0)),
    ("decode own spans, then steal", 1, dict(gemv_schedule=1)),
    ("decode half the threads", 1, dict(num_threads=-2)),
    ("decode 12 threads", 1, dict(num_threads=12)),  # at most the machine's: a memory-bound read may need fewer
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
    ap.add_argument("--sweep-only", action="append", default=[], metavar="TEXT",
                    help="sweep only the variants whose label contains TEXT (repeatable)")
    ap.add_argument("--layout", choices=LAYOUTS, default="int4", help="expert weight layout of the node")
    ap.add_argument("--no-prefill", action="store_true", help="decode only")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="A", help="node shape (see the module docstring)")
    ap.add_argument("--routing", choices=("rotate", "cold"), default="rotate", help="decode routing sequence")
    ap.add_argument("--no-generic", action="store_true", help="do not time kernels.cpu.generic (slow to compile)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="the node's activations, scales and biases (float16: as fp16 models carry them, on both "
                         "sides; our fast path on the float32 node is timed beside it)")
    args = ap.parse_args(argv)

    import numba
    import onnxruntime as ort
    from kernels.cpu.generic import GenericQMoE
    from tests.qmoe_oracle import make_session

    cores = os.cpu_count() or 1
    use_threads(cores)
    print("measuring streaming read bandwidth (2 GB, all threads) ...", flush=True)
    stream_before = stream_read_bandwidth()
    print(f"  {stream_before:.1f} GB/s", flush=True)
    stream_after = None
    host_load_decode = {}  # HostLoad.as_dict() of the decode timings
    E, H, I, K_TOP = SHAPES[args.shape]
    layout = args.layout
    attrs, tensors = make_layout_weights(layout, E, H, I)
    attrs["k"] = K_TOP
    half = args.dtype == "float16"
    act = np.float16 if half else np.float32
    print(f"building weights: shape {args.shape}: E={E} H={H} I={I} top-{K_TOP} {layout} swiglu fusion 1, "
          f"{args.dtype} ...", flush=True)
    float32_tensors = tensors
    if half:
        tensors = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    spec = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs, tensors, (1, H))
    ours = CpuQMoE(spec, tensors, num_threads=cores)
    assert ours._delegate is None, "the layout did not get the fast path"
    sides = {"ours": ours.forward}
    if not args.no_generic:
        sides["generic"] = _wrap(spec, GenericQMoE(spec, tensors, num_threads=cores)).forward
    compare_bytes = {}  # our fast path on other layouts of the same node: side -> bytes of one expert
    if half:  # the same codes with float32 scales, biases and activations
        spec_32 = QMoESpec.from_tensors("bench/QMoE", "QMoE", attrs, float32_tensors, (1, H))
        float32_node = CpuQMoE(spec_32, float32_tensors, num_threads=cores)
        sides["float32"] = lambda x, lg: float32_node.forward(x.astype(np.float32), lg.astype(np.float32))
        compare_bytes["float32"] = spec_32.expert_bytes(scale_bytes=4, bias_bytes=4)
    for other in ("int4", "int2") if layout == "int2b16" else ("int4",) if layout != "int4" else ():
        a_o, t_o = make_layout_weights(other, E, H, I)
        a_o["k"] = K_TOP
        spec_o = QMoESpec.from_tensors("bench/QMoE", "QMoE", a_o, t_o, (1, H))
        sides[other] = CpuQMoE(spec_o, t_o, num_threads=cores).forward
        compare_bytes[other] = spec_o.expert_bytes(scale_bytes=4, bias_bytes=4)
    use_threads(cores)
    ort_half = layout == "int3" or half
    ort_name = REFERENCE.format(ort.__version__) + (", fp16 activations / scales / biases" if ort_half else "")
    rng = np.random.default_rng(1)
    figures = []
    expert_bytes = spec.expert_bytes(scale_bytes=2 if half else 4, bias_bytes=2 if half else 4)  # as built here
    sweep = []
    ort_error = None
    reuse = None
    for T, label in ((1, "decode"), (512, "prefill")):
        if T > 1 and args.no_prefill:
            continue
        if T == 1:
            logits_all, sets = decode_routings(rng, E, K_TOP, cold=args.routing == "cold")
            n_in = len(sets)
            reuse = min_reuse_calls(sets)
        else:
            n_in = 8
            logits_all = (rng.standard_normal((n_in, T, E)) * 2).astype(np.float32)
        xs = rng.standard_normal((n_in, T, H)).astype(act)
        logits_all = logits_all.astype(act)
        fns = {k: (lambda f: (lambda i: f(xs[i % n_in], logits_all[i % n_in])))(f) for k, f in sides.items()}
        rel = {}
        ref_out = [ours.forward(xs[i], logits_all[i]) for i in range(min(n_in, 2))]
        try:
            if ort_half:  # onnxruntime: "QMoE INT3 requires FP16 or BF16 activations"; --dtype float16
                t16 = tensors if half else {k: v.astype(np.float16) if v.dtype == np.float32 else v
                                            for k, v in tensors.items()}
                sess, _ = make_session("QMoE", attrs, t16, xs[0].astype(np.float16), logits_all[0].astype(np.float16),
                                        threads=cores, spinning=True)
                feeds = [{"input": xs[i].astype(np.float16), "router_probs": logits_all[i].astype(np.float16)}
                         for i in range(n_in)]
            else:
                sess, _ = make_session("QMoE", attrs, tensors, xs[0], logits_all[0], threads=cores, spinning=True)
                feeds = [{"input": xs[i], "router_probs": logits_all[i]} for i in range(n_in)]
            fns["ort"] = lambda i: sess.run(None, feeds[i % n_in])
            rel["ort"] = max(float(np.abs(ref_out[i] - sess.run(None, feeds[i])[0]).max() / np.abs(ref_out[i]).max())
                             for i in range(len(ref_out)))
        except Exception as exc:  # onnxruntime's CPU QMoE does not run this layout
            ort_error = str(exc).splitlines()[0][:300]
        for i, ro in enumerate(ref_out if "generic" in sides else ()):
            g = sides["generic"](xs[i], logits_all[i])
            rel["generic"] = max(rel.get("generic", 0.0), float(np.abs(ro - g).max() / np.abs(g).max()))
        runs = args.runs or ((7 if T > 1 else 64) if args.quick else (16 if T > 1 else 256))
        slow = {"generic"} if T > 1 else set()  # the generic prefill (seconds a call): its own, shorter blocks
        meter = HostLoadMeter()
        med = time_blocks({k: f for k, f in fns.items() if k not in slow}, runs=runs)
        load = meter.read()  # (the generic sides' own timings below are not decode figures)
        for k in slow:
            med[k] = time_blocks({k: fns[k]}, runs=2, blocks=1, warmup=1)[k]
        use_threads(cores)
        print(f"  {label}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items()), flush=True)
        names = {"generic": "kernels.cpu.generic GenericQMoE, same weights",
                 "float32": "our fast path, the same codes with float32 scales, biases and activations",
                 "int4": "our int4 fast path, int4 block-32 weights of the same node",
                 "int2": "our int2 fast path, int2 block-32 weights of the same node", "ort": ort_name}
        for k in ("generic", "float32", "int4", "int2", "ort"):
            if k not in med:
                continue
            fig = {"name": f"{label} {T} token{'s' if T > 1 else ''} latency" + ("" if k == "ort" else f" vs {k}"),
                   "value": med["ours"] * 1e3, "unit": "ms", "reference": names[k],
                   "reference_value": med[k] * 1e3, "ratio": med[k] / med["ours"], "inputs_rotated": n_in}
            if k in rel:
                fig["max_rel_diff_vs_reference"] = rel[k]
            figures.append(fig)
        if T == 1:
            stream_after = stream_read_bandwidth()
            stream_gbs = max(stream_before, stream_after)
            print(f"  streaming read after the decode timings: {stream_after:.1f} GB/s; the reference: "
                  f"{stream_gbs:.1f}", flush=True)
            print(f"  host during the decode timings: {load.describe()}", flush=True)
            host_load_decode = load.as_dict()
            nbytes = K_TOP * expert_bytes  # every decode input routes to K_TOP different experts
            figures.append({"name": "decode weight bandwidth vs measured DRAM streaming read bandwidth",
                            "value": nbytes / med["ours"] / 1e9, "unit": "GB/s",
                            "reference": f"streaming read, Numba parallel sum over 2 GB float32, {cores} threads, "
                                         "best of 5, the larger of the measurements before and after the decode "
                                         "timings (same run)",
                            "reference_value": stream_gbs, "ratio": (nbytes / med["ours"] / 1e9) / stream_gbs,
                            "bytes_read": int(nbytes),
                            **{f"{k}_ratio": (b / med[k] / 1e9) / stream_gbs
                               for k, b in (("generic", nbytes), ("ort", nbytes),
                                            *((k, K_TOP * b) for k, b in compare_bytes.items()))
                               if k in med}, **host_load_decode})
            print(f"  decode reads {nbytes / 1e6:.1f} MB: ours {nbytes / med['ours'] / 1e9:.1f} GB/s = "
                  f"{nbytes / med['ours'] / 1e9 / stream_gbs:.0%} of the {stream_gbs:.1f} GB/s streaming read"
                  + (f", onnxruntime {nbytes / med['ort'] / 1e9 / stream_gbs:.0%}" if "ort" in med else ""),
                  flush=True)
        if args.sweep:
            for name, sT, over in SWEEP:
                if sT != T or args.sweep_only and not any(w in name for w in args.sweep_only):
                    continue
                m = CpuQMoE(spec, tensors, num_threads=cores)
                for key, val in over.items():
                    setattr(m, key, max(1, cores // 2) if (key == "num_threads" and val == -2) else val)
                rs = max(3, runs // 2)
                t_var = time_blocks({"v": lambda i: m.forward(xs[i % n_in], logits_all[i % n_in]),
                                     "ours": lambda i: ours.forward(xs[i % n_in], logits_all[i % n_in])},
                                    runs=rs, blocks=2, pause=0.05)
                use_threads(cores)
                sweep.append({"variant": name, "tokens": T, "ms": t_var["v"] * 1e3, "default_ms": t_var["ours"] * 1e3,
                              "speedup_vs_default": t_var["ours"] / t_var["v"]})
                print(f"  sweep {name:28s} T={T:4d} {t_var['v'] * 1e3:9.3f} ms (default {t_var['ours'] * 1e3:.3f})",
                      flush=True)
        if T > 1:
            flops = 2.0 * T * K_TOP * (2 * I * H + H * I)
            figures.append({"name": f"{label} {T} tokens throughput", "value": flops / med["ours"] / 1e9,
                            "unit": "GFLOP/s", "reference": "the sides above, same order",
                            "reference_value": float("nan"), "ratio": float("nan"),
                            **{f"{k}_gflops": flops / med[k] / 1e9 for k in med if k != "ours"}})

    config = {"shape": args.shape, "decode_routing": args.routing, "decode_min_reuse_calls": reuse,
              "num_experts": E, "hidden_size": H, "inter_size": I, "k": K_TOP, "layout": layout,
              "quant": spec.layout_summary(), "expert_bytes": expert_bytes,
              "activation": "swiglu fusion 1", "dtype": args.dtype, "threads": cores,
              "numpy": np.__version__, "numba": numba.__version__, "onnxruntime": ort.__version__,
              "onnxruntime_refused": ort_error,
              "openblas_core": openblas_core(), "machine_details": machine_details(),
              "stream_read_gbs_before": stream_before, "stream_read_gbs_after": stream_after, **host_load_decode,
              "int4_table_kernels": bool(HAS_AVX512F),
              "kernel": {k: getattr(ours, k) for k in ("batched", "gemv_max_rows", "gemm_kc", "gemm_rows",
                                                       "gemm_cols", "gemv_prefetch_rows", "gemv_chunk_kb",
                                                       "gemv_schedule")},
              "decode_order": ours.decode_order(cores),
              "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}}
    print()
    print(f"{'figure':50s} {'ours':>10s} {'reference':>12s} {'unit':>8s} {'ratio':>7s}")
    for f in figures:
        print(f"{f['name'][:50]:50s} {f['value']:10.3f} {f['reference_value']:12.3f} {f['unit']:>8s} {f['ratio']:7.2f}")
    print("(ratio > 1: ours faster; the last decode line: ours / streaming read bandwidth)")
    if ort_error:
        print(f"onnxruntime refused the layout: {ort_error}")
    if not args.no_write:
        extra = {"sweep": sweep} if sweep else {}
        name = BENCHMARK if layout == "int4" else f"qmoe-cpu-{layout}"
        if args.shape != "A" or args.routing != "rotate" or half:
            name = f"qmoe-cpu-{layout}-shape{args.shape}-{args.routing}" + ("-float16" if half else "")
        path = write_result(name, figures, config=config, **extra)
        print(f"wrote {path.relative_to(ROOT)}")
    return figures


def _wrap(spec, delegate):
    """A CpuQMoE shell whose experts run in the given delegate (routing stays CpuQMoE's)."""
    m = CpuQMoE.__new__(CpuQMoE)
    m.spec, m.num_threads, m._delegate = spec, None, delegate
    return m


LAYOUTS = ("int4", "mxfp4", "nvfp4", "int2", "int2b16", "int3")
SHAPES = {"A": (32, 2880, 2880, 4), "B": (128, 2048, 768, 8)}  # experts, hidden, intermediate, top-k
INT2_BLOCKS = {"int2": 32, "int2b16": 16}  # int2 layouts: block size


if __name__ == "__main__":
    main()
