"""Benchmark: our GPU QMoE kernels (kernels.gpu.GpuQMoE) against the GPU's own ceilings measured in the same run,
and against our CPU kernel (kernels.cpu.CpuQMoE) and onnxruntime's CPU QMoE on the same node.

Ceilings: HBM bandwidth = a 2 GiB device-to-device copy (bytes read + written / time); fp16 matrix throughput =
cupy.matmul of 8192^3 fp16. Shapes (int4, block 32, swiglu fusion 1, fp32 scales and activations):
  A  hidden 2880, intermediate 2880, 32 experts, top-4 (gpt-oss-20b-like, alpha 1.702, beta 1, limit 7)
  B  hidden 2048, intermediate 768, 128 experts, top-8 (Qwen3-30B-A3B-like)
Decode: 1 token, routing rotated over 256 random logit rows (different experts every launch), one forward =
routing + grouping + FC1 + FC2, captured as a CUDA graph; time = CUDA events around one replay, queued behind a
spin kernel so that host launch latency is not counted; median over many replays. Bytes = the k routed experts'
bytes in our layout (weights + scales + biases). Also the per-token time in a graph of 32 back-to-back forwards.
Prefill: 512 tokens, random routing (distinct experts counted), median of CUDA-event timings; GpuQMoE's prefill kernel
(v1w: pf_gemmw on wgmma where the layout is int4 / block 32 / no zero point, as here, and the module has wgmma), v1c
(pf_gemmc, the same on mma.sync) and the general v1 (pf_gemm) next to it, each at its fastest tile height, all
variants timed in turn. Useful FLOPs = 2 * tokens * k * (2I*H + H*I).

    python benchmarks/bench_qmoe_gpu.py [--gpu-only] [--quick] [--no-write]
    python benchmarks/bench_qmoe_gpu.py --prefill-ab [--shapes A,B] [--pf-rounds 3]   # prefill and fp16 matmul only
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, median_seconds, write_result  # noqa: E402
from kernels.qmoe_spec import QMoESpec  # noqa: E402
from kernels.reference import route as ref_route  # noqa: E402

BENCHMARK = "qmoe_gpu"

SHAPES = {
    "A": dict(E=32, H=2880, I=2880, k=4, block=32, alpha=1.702, beta=1.0, limit=7.0,
              label="hidden 2880, inter 2880, 32 experts, top-4"),
    "B": dict(E=128, H=2048, I=768, k=8, block=32, alpha=1.0, beta=0.0, limit=None,
              label="hidden 2048, inter 768, 128 experts, top-8"),
}

_SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def make_weights(E, H, I, block, seed=0, scale_dtype=np.float32):
    rng = np.random.default_rng(seed)

    def scales(n, k):
        s = rng.uniform(0.5, 1.5, size=(E, n, k // block)) * rng.choice([-1, 1], size=(E, n, k // block))
        return (s * (0.25 / np.sqrt(k))).astype(scale_dtype)

    return {
        "fc1_experts_weights": rng.integers(0, 256, size=(E, 2 * I, H // 2), dtype=np.uint8),
        "fc1_scales": scales(2 * I, H),
        "fc1_experts_bias": (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32),
        "fc2_experts_weights": rng.integers(0, 256, size=(E, H, I // 2), dtype=np.uint8),
        "fc2_scales": scales(H, I),
        "fc2_experts_bias": (rng.standard_normal((E, H)) * 0.1).astype(np.float32),
    }


def attrs_for(sh):
    a = dict(k=sh["k"], activation_type="swiglu", swiglu_fusion=1, activation_alpha=sh["alpha"],
             activation_beta=sh["beta"], normalize_routing_weights=1, expert_weight_bits=4, block_size=sh["block"],
             weights_prepacked=0)
    if sh["limit"] is not None:
        a["swiglu_limit"] = sh["limit"]
    return a


def node_for(key, seed=0):
    """(spec, tensors) of shape ``key``'s QMoE node (random weights; decode input shape: 1 token)."""
    sh = SHAPES[key]
    tensors = make_weights(sh["E"], sh["H"], sh["I"], sh["block"], seed=seed)
    return QMoESpec.from_tensors(f"bench/{key}", "QMoE", attrs_for(sh), tensors, (1, sh["H"])), tensors


class Timer:
    """CUDA-event timing of GPU work queued behind a spin kernel (host launch latency hidden)."""

    def __init__(self, cp):
        self.cp = cp
        self.spin = cp.RawKernel(_SPIN_SRC, "spin")
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()

    def once(self, fn, spin_cycles=100_000):
        cp = self.cp
        self.spin((1,), (1,), (np.int64(spin_cycles),))
        self.e0.record()
        fn()
        self.e1.record()
        self.e1.synchronize()
        return cp.cuda.get_elapsed_time(self.e0, self.e1) * 1e-3  # seconds

    def median(self, fn, iters, warmup=3, prep=None, spin_cycles=100_000):
        for i in range(warmup):
            if prep:
                prep(i)
            fn()
        ts = []
        for i in range(iters):
            if prep:
                prep(i)
            ts.append(self.once(fn, spin_cycles))
        ts = np.asarray(ts)
        return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


def measure_hbm(cp, timer, nbytes=2 << 30):
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    t, _, _ = timer.median(lambda: b.data.copy_from_device_async(a.data, nbytes), iters=10)
    del a, b
    return 2 * nbytes / t / 1e9


def hbm_figure(hbm: float) -> dict:
    """The result-file figure of the HBM copy bandwidth measured in a run (measure_hbm), against the datasheet."""
    return {"name": "HBM device-to-device copy (read + write)", "value": hbm, "unit": "GB/s",
            "reference": "H200 datasheet HBM3e", "reference_value": 4800.0, "ratio": hbm / 4800.0}


def measure_matmul(cp, timer, n=8192):
    rng = cp.random.default_rng(0)
    A = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    B = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    C = cp.empty((n, n), cp.float16)
    t, _, _ = timer.median(lambda: cp.matmul(A, B, out=C), iters=10, spin_cycles=10_000)
    return 2.0 * n ** 3 / t / 1e12


def capture(cp, stream, fn):
    """A replayable callable: the CUDA graph of fn (warmed up first), or fn itself if capture fails."""
    with stream:
        fn()
        stream.synchronize()
        try:
            stream.begin_capture()
            fn()
            g = stream.end_capture()
        except Exception as exc:  # noqa: BLE001
            print(f"graph capture failed ({exc!r}); timing eager launches", flush=True)
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001
                pass
            return fn
    return lambda: g.launch(stream)


def bench_decode(cp, m, spec, timer, rng, iters, sweep, kernel="v4"):
    """Decode timing with m.decode_kernel = kernel ("v4": dec_gemv, its launch configuration dec_cfg swept when
    ``sweep``; "v5": dec5, blocks per SM dec5_cfg["bps"] in {occupancy, 1, 2, 3, 4} and the FC2 L2 prefetch off
    tried, always)."""
    H, E = spec.hidden_size, spec.num_experts
    m.decode_kernel = kernel
    stream = cp.cuda.Stream(non_blocking=True)
    bank = cp.asarray((rng.standard_normal((256, E)) * 2.0).astype(np.float32))
    x = cp.asarray(rng.standard_normal((1, H)).astype(np.float32))
    lg = cp.empty((1, E), cp.float32)
    out = cp.empty((1, H), cp.float32)
    nbytes = spec.k * m.expert_bytes()
    results = []
    if kernel == "v5":
        attr = "dec5_cfg"
        configs = [dict(bps=b, grid=0, l2_prefetch=1) for b in (0, 1, 2, 3, 4)]
        configs.append(dict(bps=0, grid=0, l2_prefetch=0))
        sweep = True
    else:
        attr = "dec_cfg"
        configs = [m.dec_cfg.copy()]
        if sweep:
            rw = [(r, w) for r in (1, 2) for w in (1, 2, 4, 8)]
            configs = [dict(R1=r1, W1=w1, R2=r2, W2=w2, ksplit2=ks) for r1, w1 in rw for r2, w2 in rw
                       for ks in (0, 1, 2, 4)]
    with stream:
        for cfg in configs:
            setattr(m, attr, cfg)
            g = capture(cp, stream, lambda: m.forward_into(x, lg, out))
            prep = (lambda i: lg.__setitem__(Ellipsis, bank[i % 256]))
            med, p10, p90 = timer.median(g, iters=max(20, iters // 20) if sweep else iters, prep=prep)
            results.append((med, cfg))
        best = min(results, key=lambda r: r[0])[1]
        setattr(m, attr, best)
        g = capture(cp, stream, lambda: m.forward_into(x, lg, out))
        med, p10, p90 = timer.median(g, iters=iters,
                                     prep=lambda i: lg.__setitem__(Ellipsis, bank[(7 * i) % 256]))
        # 32 forwards back to back in one graph, each with its own routing row
        N = 32
        outs = cp.empty((N, 1, H), cp.float32)
        chain = capture(cp, stream, lambda: [m.forward_into(x, bank[i:i + 1], outs[i]) for i in range(N)])
        cmed, _, _ = timer.median(chain, iters=20)
    return dict(kernel=kernel, bytes=nbytes, median=med, p10=p10, p90=p90, chain_per_token=cmed / N, best_cfg=best,
                sweep=[(r[0], r[1]) for r in sorted(results, key=lambda r: r[0])[:5]])


def compare_decode(cp, m, decs, H, E, rng, key):
    """The decode kernels' outputs against the first one's at 1 and 8 tokens (max |diff| / max |first|)."""
    for T in (1, 8):
        xq = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        lq = cp.asarray((rng.standard_normal((T, E)) * 2).astype(np.float32))
        outs = {}
        for kern in decs:
            m.decode_kernel = kern
            outs[kern] = cp.asnumpy(m.forward(xq, lq)).astype(np.float64)
        names = list(outs)
        ref_o = outs[names[0]]
        for kern in names[1:]:
            rel = float(np.abs(outs[kern] - ref_o).max() / max(np.abs(ref_o).max(), 1e-30))
            decs[kern][f"max_rel_diff_vs_{names[0]}_T{T}"] = rel
            print(f"[{key}] decode {T} token(s): {kern} vs {names[0]} max rel diff {rel:.1e}", flush=True)


# GpuQMoE.prefill_kernel: its default first (pf_gemmw: wgmma; as v1c where the module has none), then pf_gemmc, then
# the general pf_gemm that the others are compared with
PF_KERNELS = ("v1w", "v1c", "v1")
PF_BMS = (32, 48, 64, 128)


def bench_prefill(cp, m, spec, timer, rng, T=512, iters=10, rounds=2):
    """Prefill at T tokens through each of PF_KERNELS at each BM of PF_BMS, the same input and routing for all; every
    variant timed in turn, ``rounds`` times (its best median counts). Returns {kernel: its fastest BM's median, p10,
    p90, bm, the kernels launched and their registers, median per BM}, flops, distinct experts and each kernel's
    largest relative difference from v1 (same BM); leaves ``m`` on its default kernel at that one's fastest BM."""
    H, E = spec.hidden_size, spec.num_experts
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    lg_h = (rng.standard_normal((T, E)) * 2.0).astype(np.float32)
    lg = cp.asarray(lg_h)
    out = cp.empty((T, H), cp.float32)
    ids, _ = ref_route(lg_h, spec)
    variants = [(kern, bm) for kern in PF_KERNELS for bm in PF_BMS]
    outs, names, regs, times = {}, {}, {}, {}
    for v in variants:  # warm-up, outputs, the kernels launched
        m.prefill_kernel, m.prefill_bm = v
        m.forward_into(x, lg, out)
        outs[v] = cp.asnumpy(out)
        names[v] = list(m.last_prefill_kernels)
        try:
            regs[v] = [int(m._f(n).num_regs) for n in names[v]]
        except Exception:  # noqa: BLE001 - a CuPy without num_regs: the timings still count
            regs[v] = None
    for _ in range(rounds):
        for v in variants:
            m.prefill_kernel, m.prefill_bm = v
            med, p10, p90 = timer.median(lambda: m.forward_into(x, lg, out), iters=iters, spin_cycles=300_000)
            if v not in times or med < times[v][0]:
                times[v] = (med, p10, p90)
    res = dict(flops=2.0 * T * spec.k * (spec.fc1_rows * H + H * spec.inter_size),
               distinct_experts=int(np.unique(ids).size))
    for kern in PF_KERNELS:
        bm = min(PF_BMS, key=lambda b: times[(kern, b)][0])
        med, p10, p90 = times[(kern, bm)]
        res[kern] = dict(median=med, p10=p10, p90=p90, bm=bm, kernels=names[(kern, bm)], regs=regs[(kern, bm)],
                         median_by_bm={b: times[(kern, b)][0] for b in PF_BMS})
    for kern in PF_KERNELS[:-1]:
        res[f"max_rel_diff_{kern}_vs_v1"] = max(
            float(np.abs(outs[(kern, b)] - outs[("v1", b)]).max() / max(np.abs(outs[("v1", b)]).max(), 1e-30))
            for b in PF_BMS)
    m.prefill_kernel, m.prefill_bm = PF_KERNELS[0], res[PF_KERNELS[0]]["bm"]  # for the comparisons that follow
    return res


def prefill_figures(key, tag, pf, tflops):
    """Print bench_prefill's result and return its figures: each kernel at its fastest BM against the fp16 matmul of
    the same run, with its speed-up over v1 (GpuQMoE's default keeps the historical figure name)."""
    figures = []
    for kern in PF_KERNELS:
        r = pf[kern]
        tf = pf["flops"] / r["median"] / 1e12
        speedup = pf["v1"]["median"] / r["median"]
        by_bm = ", ".join(f"{b}: {t * 1e3:.3f}" for b, t in r["median_by_bm"].items())
        print(f"[{key}] prefill 512 {kern}: {r['median'] * 1e3:.3f} ms (p10 {r['p10'] * 1e3:.3f}, p90 "
              f"{r['p90'] * 1e3:.3f}) = {tf:.0f} TFLOP/s = {tf / tflops:.1%} of fp16 matmul, x{speedup:.2f} vs v1 "
              f"(BM {r['bm']}, {' / '.join(r['kernels'])}, registers {r['regs']}; ms by BM {by_bm})", flush=True)
        label = "" if kern == PF_KERNELS[0] else f" ({kern} kernels)"
        figures.append({"name": f"{tag} prefill 512 tokens throughput{label}", "value": tf, "unit": "TFLOP/s",
                        "reference": "fp16 matmul 8192^3 measured in this run", "reference_value": tflops,
                        "ratio": tf / tflops, "latency_ms": r["median"] * 1e3, "prefill_kernel": kern, "bm": r["bm"],
                        "kernels": r["kernels"], "speedup_vs_v1": speedup})
    print(f"[{key}] prefill 512: {pf['distinct_experts']} experts hit; max rel diff vs v1: "
          + ", ".join(f"{k} {pf[f'max_rel_diff_{k}_vs_v1']:.1e}" for k in PF_KERNELS[:-1]), flush=True)
    return figures


def _gpu_name(cp) -> str:
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


def prefill_ab(args):
    """--prefill-ab: only bench_prefill (PF_KERNELS at 512 tokens) for --shapes, next to the fp16 matmul ceiling of
    the same run, in one process. Writes benchmarks/results/qmoe_gpu_prefill_ab-*.json (and into $OUT)."""
    import cupy as cp

    from kernels.gpu import GpuQMoE

    t_start = time.perf_counter()
    dev = cp.cuda.Device(0)
    gpu = _gpu_name(cp)
    timer = Timer(cp)
    tflops = measure_matmul(cp, timer)
    print(f"{gpu}: fp16 matmul 8192^3 {tflops:.0f} TFLOP/s", flush=True)
    figures = [{"name": "fp16 matmul 8192^3 (cupy / cuBLAS)", "value": tflops, "unit": "TFLOP/s",
                "reference": "H200 datasheet dense fp16", "reference_value": 989.0, "ratio": tflops / 989.0}]
    details = {"gpu": gpu, "compute_capability": dev.compute_capability, "cupy": cp.__version__}
    rng = np.random.default_rng(1)
    for key in [s_.strip() for s_ in args.shapes.split(",") if s_.strip()]:
        sh = SHAPES[key]
        print(f"\n[{key}] {sh['label']}, int4 block {sh['block']}: building weights ...", flush=True)
        spec, tensors = node_for(key)
        m = GpuQMoE(spec, tensors)
        pf = bench_prefill(cp, m, spec, timer, rng, rounds=args.pf_rounds)
        details[f"shape_{key}"] = {"label": sh["label"], "compiled_from": m.compiled_from, "prefill": pf}
        figures += prefill_figures(key, f"[{key}: {sh['label']}]", pf, tflops)
        del m
        cp.get_default_memory_pool().free_all_blocks()
        if not args.no_write:  # partial results survive a time limit
            _write(figures, details, t_start, benchmark=BENCHMARK + "_prefill_ab")
    if not args.no_write:
        path = _write(figures, details, t_start, benchmark=BENCHMARK + "_prefill_ab")
        print(f"wrote {path.relative_to(ROOT)}")
    return figures


def upload_host_time_locked(m, tensors) -> float:
    """upload_expert_device's host seconds with the node's large stored tensors page-locked in place
    (cudaHostRegister), as engine/offload/host_register.py leaves the experts' mapping: the copies are then DMAs the
    host only issues (from pageable rows each copy waits for the driver's staging)."""
    import cupy as cp

    rt = cp.cuda.runtime
    arrays = [a for a in tensors.values() if isinstance(a, np.ndarray) and a.nbytes >= 1 << 20]
    for a in arrays:
        rt.hostRegister(a.ctypes.data, a.nbytes, 0)
    try:
        return median_seconds(lambda: m.upload_expert_device(1, 1), 20, warmup=1)
    finally:
        cp.cuda.Device().synchronize()
        for a in arrays:
            rt.hostUnregister(a.ctypes.data)


def profile(args):
    """A few forwards of each shape between cudaProfilerStart / Stop, for ncu --profile-from-start off."""
    import cupy as cp

    from kernels.gpu import GpuQMoE

    rng = np.random.default_rng(2)
    runs = []
    for key in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        sh = SHAPES[key]
        spec, tensors = node_for(key)
        m = GpuQMoE(spec, tensors)
        for T in (1, 512):
            x = cp.asarray(rng.standard_normal((T, sh["H"])).astype(np.float32))
            lg = cp.asarray((rng.standard_normal((T, sh["E"])) * 2).astype(np.float32))
            out = cp.empty((T, sh["H"]), cp.float32)
            for kern in (("v4", "v5") if T <= m.decode_max_tokens else ("v4",)):
                m.decode_kernel = kern
                m.forward_into(x, lg, out)
                runs.append((m, x, lg, out, kern))
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    for m, x, lg, out, kern in runs:
        m.decode_kernel = kern
        m.forward_into(x, lg, out)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-only", action="store_true", help="skip the CPU and onnxruntime comparisons")
    ap.add_argument("--quick", action="store_true", help="no launch-configuration sweep, fewer runs")
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--decode-kernels", default="v4,v5",
                    help="decode kernels timed in this run (GpuQMoE.decode_kernel), comma-separated; the first is "
                         "the reference of the max-rel-diff check, v4 keeps the historical figure names")
    ap.add_argument("--profile", action="store_true",
                    help="only run a few decode / prefill forwards between cudaProfilerStart/Stop (for ncu)")
    ap.add_argument("--prefill-ab", action="store_true",
                    help="only prefill at 512 tokens: GpuQMoE's kernel (v1w), v1c and the general v1 at BM 32 / 48 / 64 / 128, "
                         "next to the fp16 matmul ceiling of the same run; writes qmoe_gpu_prefill_ab-*.json")
    ap.add_argument("--pf-rounds", type=int, default=2, help="prefill: timing rounds over all kernels and BMs")
    args = ap.parse_args(argv)
    if args.profile:
        return profile(args)
    if args.prefill_ab:
        return prefill_ab(args)

    import cupy as cp

    from kernels.gpu import GpuQMoE

    t_start = time.perf_counter()
    dev = cp.cuda.Device(0)
    gpu = _gpu_name(cp)
    timer = Timer(cp)
    hbm = measure_hbm(cp, timer)
    tflops = measure_matmul(cp, timer)
    print(f"{gpu}: HBM copy {hbm:.0f} GB/s, fp16 matmul 8192^3 {tflops:.0f} TFLOP/s", flush=True)
    figures = [
        hbm_figure(hbm),
        {"name": "fp16 matmul 8192^3 (cupy / cuBLAS)", "value": tflops, "unit": "TFLOP/s",
         "reference": "H200 datasheet dense fp16", "reference_value": 989.0, "ratio": tflops / 989.0},
    ]
    details = {"gpu": gpu, "compute_capability": dev.compute_capability, "cupy": cp.__version__}

    cpu_ctx = None
    if not args.gpu_only:
        import numba
        import onnxruntime as ort

        from kernels.cpu import CpuQMoE
        from kernels.cpu.threads import use_threads
        from tests.qmoe_oracle import make_session

        cores = os.cpu_count() or 1
        use_threads(cores)
        cpu_ctx = (CpuQMoE, make_session, cores, ort.__version__)
        details.update(cpu_threads=cores, onnxruntime=ort.__version__, numba=numba.__version__)

    rng = np.random.default_rng(1)
    for key in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        sh = SHAPES[key]
        E, H, I, k, block = sh["E"], sh["H"], sh["I"], sh["k"], sh["block"]
        attrs = attrs_for(sh)
        print(f"\n[{key}] {sh['label']}, int4 block {block}: building weights ...", flush=True)
        tensors = make_weights(E, H, I, block, seed=0)
        spec = QMoESpec.from_tensors(f"bench/{key}", "QMoE", attrs, tensors, (1, H))
        m = GpuQMoE(spec, tensors)
        details[f"shape_{key}"] = {"label": sh["label"], "expert_bytes_gpu_layout": m.expert_bytes(),
                                   "compiled_from": m.compiled_from}
        # decode: v4 and v5 kernels in the same run, and their outputs against each other (1 and 8 tokens)
        decs = {}
        for kern in [k_.strip() for k_ in args.decode_kernels.split(",") if k_.strip()]:
            try:
                d = bench_decode(cp, m, spec, timer, rng, iters=200 if args.quick else 1000, sweep=not args.quick,
                                 kernel=kern)
            except Exception as exc:  # noqa: BLE001 - report it and keep the other kernels' / prefill figures
                print(f"[{key}] decode {kern}: FAILED {exc!r}", flush=True)
                details[f"shape_{key}"][f"decode_{kern}_error"] = repr(exc)
                continue
            gbs_k = d["bytes"] / d["median"] / 1e9
            print(f"[{key}] decode 1 token {kern}: {d['median'] * 1e6:.1f} us (p10 {d['p10'] * 1e6:.1f}, p90 "
                  f"{d['p90'] * 1e6:.1f}) = {gbs_k:.0f} GB/s = {gbs_k / hbm:.0%} of HBM; 32-chain "
                  f"{d['chain_per_token'] * 1e6:.1f} us/token; cfg {d['best_cfg']}", flush=True)
            decs[kern] = d
        if len(decs) > 1:
            try:
                compare_decode(cp, m, decs, H, E, rng, key)
            except Exception as exc:  # noqa: BLE001
                print(f"[{key}] decode kernels compared: FAILED {exc!r}", flush=True)
        m.decode_kernel = "v4"
        if not decs:
            raise RuntimeError("no decode kernel could be timed")
        dec = decs.get("v4") or next(iter(decs.values()))
        gbs = dec["bytes"] / dec["median"] / 1e9
        pf = bench_prefill(cp, m, spec, timer, rng, iters=5 if args.quick else 10,
                           rounds=1 if args.quick else args.pf_rounds)
        details[f"shape_{key}"].update(decode=dec, prefill=pf)
        pageable = median_seconds(lambda: m.upload_expert_device(1, 1), 20, warmup=1)
        locked = upload_host_time_locked(m, tensors)
        print(f"[{key}] upload_expert_device host time: {locked * 1e6:.0f} us with the stored rows page-locked (as the "
              f"engine's registered mapping has them), {pageable * 1e6:.0f} us pageable", flush=True)
        details[f"shape_{key}"]["upload_host_s"] = {"page_locked": locked, "pageable": pageable}
        for kern, d in decs.items():
            details[f"shape_{key}"][f"decode_{kern}"] = d
        tag = f"[{key}: {sh['label']}]"
        figures += [
            {"name": f"{tag} decode 1 token: routed experts' weight bandwidth", "value": gbs, "unit": "GB/s",
             "reference": "HBM copy bandwidth measured in this run", "reference_value": hbm, "ratio": gbs / hbm,
             "latency_us": dec["median"] * 1e6, "bytes_read": dec["bytes"], "decode_kernel": dec["kernel"]},
            {"name": f"{tag} decode 1 token, 32 forwards in one graph: weight bandwidth",
             "value": dec["bytes"] / dec["chain_per_token"] / 1e9, "unit": "GB/s",
             "reference": "HBM copy bandwidth measured in this run", "reference_value": hbm,
             "ratio": dec["bytes"] / dec["chain_per_token"] / 1e9 / hbm, "decode_kernel": dec["kernel"]},
        ]
        for kern, d in decs.items():
            if d is dec:
                continue
            g_k = d["bytes"] / d["median"] / 1e9
            g_c = d["bytes"] / d["chain_per_token"] / 1e9
            figures += [
                {"name": f"{tag} decode 1 token ({kern} kernels): routed experts' weight bandwidth", "value": g_k,
                 "unit": "GB/s", "reference": "HBM copy bandwidth measured in this run", "reference_value": hbm,
                 "ratio": g_k / hbm, "latency_us": d["median"] * 1e6, "bytes_read": d["bytes"], "decode_kernel": kern,
                 "best_cfg": d["best_cfg"]},
                {"name": f"{tag} decode 1 token ({kern} kernels), 32 forwards in one graph: weight bandwidth",
                 "value": g_c, "unit": "GB/s", "reference": "HBM copy bandwidth measured in this run",
                 "reference_value": hbm, "ratio": g_c / hbm, "decode_kernel": kern},
            ]
        figures += prefill_figures(key, tag, pf, tflops)
        # fp16 activations (GPU only)
        x16 = cp.asarray(rng.standard_normal((1, H)).astype(np.float16))
        lg16 = cp.asarray((rng.standard_normal((1, E)) * 2).astype(np.float16))
        t16 = timer.median(lambda: m.forward(x16, lg16), iters=50)[0]
        details[f"shape_{key}"]["decode_fp16_forward_eager_us"] = t16 * 1e6

        if cpu_ctx is not None:
            CpuQMoE, make_session, cores, ort_version = cpu_ctx
            ref_name = f"onnxruntime {ort_version} CPU QMoE ({cores} threads)"
            ours_cpu = CpuQMoE(spec, tensors, num_threads=cores)
            for T, label, runs in ((1, "decode 1 token", 20), (512, "prefill 512 tokens", 3)):
                xh = rng.standard_normal((T, H)).astype(np.float32)
                lh = (rng.standard_normal((T, E)) * 2).astype(np.float32)
                print(f"[{key}] CPU / onnxruntime {label} ...", flush=True)
                sess, feeds = make_session("QMoE", attrs, tensors, xh, lh, threads=cores, spinning=True)
                t_ort = median_seconds(lambda: sess.run(None, feeds), runs, warmup=1)
                t_cpu = median_seconds(lambda: ours_cpu.forward(xh, lh), runs, warmup=1)
                xd, ld = cp.asarray(xh), cp.asarray(lh)
                outd = cp.empty((T, H), cp.float32)
                t_gpu = timer.median(lambda: m.forward_into(xd, ld, outd), iters=20)[0]
                # same numbers?
                got = cp.asnumpy(m.forward(xh, lh))
                ref = sess.run(None, feeds)[0]
                rel = float(np.abs(got - ref).max() / np.abs(ref).max())
                figures += [
                    {"name": f"{tag} {label}: GPU latency vs onnxruntime CPU", "value": t_gpu * 1e3, "unit": "ms",
                     "reference": ref_name, "reference_value": t_ort * 1e3, "ratio": t_ort / t_gpu,
                     "max_rel_diff_vs_reference": rel},
                    {"name": f"{tag} {label}: our CPU kernel vs onnxruntime CPU", "value": t_cpu * 1e3,
                     "unit": "ms", "reference": ref_name, "reference_value": t_ort * 1e3, "ratio": t_ort / t_cpu},
                ]
                print(f"[{key}] {label}: GPU {t_gpu * 1e3:.3f} ms, our CPU {t_cpu * 1e3:.2f} ms, onnxruntime "
                      f"{t_ort * 1e3:.2f} ms (GPU vs ORT rel diff {rel:.1e})", flush=True)
            del sess
        del m
        cp.get_default_memory_pool().free_all_blocks()
        if not args.no_write:  # partial results survive a time limit
            _write(figures, details, t_start)

    print()
    print(f"{'figure':86s} {'value':>10s} {'ref':>10s} {'unit':>8s} {'ratio':>7s}")
    for f in figures:
        print(f"{f['name'][:86]:86s} {f['value']:10.3f} {f['reference_value']:10.3f} {f['unit']:>8s} "
              f"{f['ratio']:7.2f}")
    if not args.no_write:
        path = _write(figures, details, t_start)
        print(f"wrote {path.relative_to(ROOT)}")
    return figures


def _write(figures, details, t_start, benchmark=BENCHMARK):
    """The result JSON under benchmarks/results/, also copied into $OUT when set (the GPU machine's output folder)."""
    details["wall_s"] = time.perf_counter() - t_start
    path = write_result(benchmark, figures, config=details)
    out = os.environ.get("OUT")
    if out:
        import shutil

        shutil.copy(path, Path(out) / path.name)
    return path


if __name__ == "__main__":
    main()
