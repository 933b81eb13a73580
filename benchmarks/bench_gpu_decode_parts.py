"""Benchmark: where the time of one GPU decode forward (v5 kernels: decode_prep, dec5 FC1, dec5 FC2) goes.

Shapes A and B of bench_qmoe_gpu (its weights, spec and HBM copy measurement; int4 block 32, swiglu fusion 1, every
expert resident), 1 token. Every figure is a CUDA graph of N back-to-back launches, timed with CUDA events behind a
spin kernel (bench_qmoe_gpu.Timer), median over replays, divided by N:
  (a) the whole forward (GpuQMoE.forward_into), launch i with its own routing row; also one forward per graph with
      the row changed between replays, bench_qmoe_gpu's headline figure (graph launch latency included);
  (b) decode_prep alone (routing + grouping, x to bf16 hi / lo, output zeroed), the launches recorded in (a)'s
      forwards;
  (c) FC1 alone (dec5 mode 0) and (d) FC2 alone (dec5 mode 1): the recorded launch of a full forward, its routing
      tables (tiles, num_tiles, pair_tok, pair_w) swapped for copies taken after forward i ("rotated": other experts
      at every launch, as in (a)) or after forward 0 at every launch ("same": the experts' bytes stay in L2 where
      they fit: B's FC1 ~15 MB; A's FC1 ~41 MB of the 50 MB L2). "same" against "rotated" says how much of a stage is
      waiting on HBM rather than latency, ramp and tail;
  (e) an empty kernel: one 32-thread block, and FC1's grid, block and shared memory: the per-launch floor in a graph.
Repeating FC1 alone is legal, so no differences of graphs are taken: every launch covers each (tile, row tile,
k-tile) unit once, so each split-K counter reaches KT and the completing warp resets it and reads the scratch back
with atomicExch(.., 0) (decode5.cu, flush): the scratch and counters are zero after each launch, as the workspace
assumes. FC2 only reads the workspace (tiles, activation rows FC1 left) and adds into the output.
Bytes = the k routed experts' bytes of the stage's projection in our layout (weights + scales + biases; the biases
are < 0.1%); forward = both. With l2_prefetch 1 FC1 also prefetches FC2's bytes into L2 (counted in FC1's time)
and FC2 alone then reads HBM where the forward's FC2 may read L2: both settings are timed.

With ``--dtype float16`` x is fp16 (an fp16 model's dense part on the GPU): both decode paths are timed, the fp16
kernels (dec5h_*, dec5_cfg f16 = 1, GpuQMoE's default for fp16 x) and the bf16 hi / lo ones (f16 = 0).

    python benchmarks/bench_gpu_decode_parts.py [--shapes A,B] [--launches 50] [--replays 20] [--no-write]
    python benchmarks/bench_gpu_decode_parts.py --dtype float16 ...   # fp16 x: dec5h against dec5
    NCU=1 python benchmarks/bench_gpu_decode_parts.py ...   # also prints the ncu command line of --eager-once
    python benchmarks/bench_gpu_decode_parts.py --eager-once   # eager forwards only, for that ncu command
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_gpu import (SHAPES, Timer, _gpu_name, _write, capture, hbm_figure,  # noqa: E402
                                       measure_hbm, node_for)
from benchmarks.common import ROOT  # noqa: E402

BENCHMARK = "gpu-decode-parts"
KERNELS_PER_FORWARD = 3  # decode_prep, dec5 FC1, dec5 FC2 (checked against the recorded launches)
NCU_KERNELS = "^(decode_prep|dec5h?_)"
ROUTE_TABLES = ("tiles", "num_tiles", "pair_tok", "pair_w")  # what decode_prep writes and FC1 / FC2 read per routing

_EMPTY_SRC = r'extern "C" __global__ void empty_kernel() { }'


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch of GpuQMoE: replayable with the same arguments."""

    name: str
    fn: object
    grid: tuple
    block: tuple
    args: tuple
    kw: dict

    def __call__(self):
        self.fn(self.grid, self.block, self.args, **self.kw)

    def swapped(self, arrays: dict) -> "Launch":
        """This launch with the arguments that are keys of ``arrays`` (by id) replaced by their values."""
        return replace(self, args=tuple(arrays.get(id(a), a) for a in self.args))


class _Logged:
    """Stands in for a CuPy kernel function: keeps each launch (a Launch), runs it; attributes pass through."""

    def __init__(self, name, fn, log):
        self.__dict__.update(name=name, fn=fn, log=log)

    def __getattr__(self, attr):
        return getattr(self.fn, attr)

    def __setattr__(self, attr, value):
        setattr(self.fn, attr, value)

    def __call__(self, grid, block, args, **kw):
        self.log.append(Launch(self.name, self.fn, tuple(grid), tuple(block), tuple(args), dict(kw)))
        return self.fn(grid, block, args, **kw)


@contextlib.contextmanager
def recorded(m):
    """The kernel launches GpuQMoE ``m`` makes inside, in order (every launch looks its function up through m._f).
    Inside, FC1 and FC2 are launched plainly (dec5_cfg pdl 0): a programmatic dependent launch goes to the driver
    with the function's handle, past the stand-in that records."""
    log: list[Launch] = []
    real, cfg = m._f, m.dec5_cfg
    m._f = lambda name: _Logged(name, real(name), log)
    m.dec5_cfg = {**cfg, "pdl": 0}
    try:
        yield log
    finally:
        del m._f  # the class's method again
        m.dec5_cfg = cfg


def check_forward(log: list[Launch]) -> None:
    names = [r.name for r in log]
    if len(names) != KERNELS_PER_FORWARD or names[0] != "decode_prep" or not all(
            n.startswith(("dec5_", "dec5h_")) and n.endswith(f"_{mode}") for n, mode in zip(names[1:], (0, 1))):
        raise RuntimeError(f"a decode forward launched {names}, not decode_prep + dec5 FC1 + dec5 FC2")


def route_tables(ws) -> dict:
    """Copies of the workspace's routing tables, keyed by the id of the array each stands in for."""
    return {id(getattr(ws, n)): getattr(ws, n).copy() for n in ROUTE_TABLES}


def stage_launches(m, x, bank, outs, n):
    """(forward launches, FC1 / FC2 per routing row) from n eager forwards, forward i with routing row i."""
    forwards, fc1, fc2 = [], [], []
    for i in range(n):
        with recorded(m) as log:
            m.forward_into(x, bank[i:i + 1], outs[i])
        check_forward(log)
        tables = route_tables(m._ws)
        if not all(any(a is b for b in log[1].args) for a in (getattr(m._ws, t) for t in ROUTE_TABLES)):
            raise RuntimeError("FC1's arguments do not hold the workspace's routing tables: cannot swap them")
        forwards.append(log)
        fc1.append(log[1].swapped(tables))
        fc2.append(log[2].swapped(tables))
    return forwards, fc1, fc2


def per_launch(cp, timer, stream, fn, n, replays):
    """Seconds per launch: the median replay of fn's graph (n launches) / n."""
    return timer.median(capture(cp, stream, fn), iters=replays)[0] / n


def time_parts(cp, m, timer, stream, rng, n, replays, l2_prefetch, dtype=np.float32, f16=1) -> dict:
    """Seconds per launch of (a)-(d) for one dec5 configuration (x of ``dtype``; ``f16``: dec5_cfg's, the fp16
    kernels for fp16 x or not), and FC1's recorded launch (for (e))."""
    spec = m.spec
    H, E = spec.hidden_size, spec.num_experts
    m.dec5_cfg = dict(m.dec5_cfg, l2_prefetch=l2_prefetch, f16=f16)
    bank = cp.asarray((rng.standard_normal((n, E)) * 2.0).astype(np.float32))
    x = cp.asarray(rng.standard_normal((1, H)).astype(dtype))
    outs = cp.empty((n, 1, H), cp.float32)
    t = {}
    with stream:
        m.forward_into(x, bank[0:1], outs[0])  # sizes the workspace and sets the kernels' attributes
        forwards, fc1, fc2 = stage_launches(m, x, bank, outs, n)
        prep = [log[0] for log in forwards]
        t["forward"] = per_launch(cp, timer, stream, lambda: [m.forward_into(x, bank[i:i + 1], outs[i])
                                                              for i in range(n)], n, replays)
        lg = bank[0:1].copy()  # routed as any row while capture() warms up
        g1 = capture(cp, stream, lambda: m.forward_into(x, lg, outs[0]))
        t["forward_1"] = timer.median(g1, iters=replays * 5, prep=lambda i: lg.__setitem__(Ellipsis, bank[i % n]))[0]
        t["prep"] = per_launch(cp, timer, stream, lambda: [p() for p in prep], n, replays)
        for name, stage in (("fc1", fc1), ("fc2", fc2)):
            t[name] = per_launch(cp, timer, stream, lambda: [f() for f in stage], n, replays)
            t[name + "_same"] = per_launch(cp, timer, stream, lambda: [stage[0]() for _ in range(n)], n, replays)
        stream.synchronize()
    return {"seconds": t, "fc1_launch": forwards[0][1]}


def time_empty(cp, timer, stream, fc1: Launch, n, replays) -> dict:
    """Seconds per launch of an empty kernel in a graph: 1 block of 32, and FC1's grid / block / shared memory."""
    k = cp.RawKernel(_EMPTY_SRC, "empty_kernel")
    smem = int(fc1.kw.get("shared_mem", 0))
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    with stream:
        one = per_launch(cp, timer, stream, lambda: [k((1,), (32,), ()) for _ in range(n)], n, replays)
        grid = per_launch(cp, timer, stream, lambda: [k(fc1.grid, fc1.block, (), shared_mem=smem) for _ in range(n)],
                          n, replays)
    return {"empty_1": one, "empty_fc1_grid": grid, "fc1_grid": list(fc1.grid), "fc1_block": list(fc1.block),
            "fc1_smem": smem}


def stage_rows(t: dict, empty: dict, fc1_bytes: int, fc2_bytes: int, n: int) -> list[tuple]:
    """(key, label, seconds, bytes or None) per figure of one configuration."""
    return [
        ("forward_1", "(a) forward, 1 per graph (bench_qmoe_gpu)", t["forward_1"], fc1_bytes + fc2_bytes),
        ("forward", f"(a) forward, {n} per graph", t["forward"], fc1_bytes + fc2_bytes),
        ("prep", "(b) decode_prep", t["prep"], None),
        ("fc1", "(c) FC1, routing rotated", t["fc1"], fc1_bytes),
        ("fc1_same", "(c) FC1, same routing (L2-warm)", t["fc1_same"], fc1_bytes),
        ("fc2", "(d) FC2, routing rotated", t["fc2"], fc2_bytes),
        ("fc2_same", "(d) FC2, same routing (L2-warm)", t["fc2_same"], fc2_bytes),
        ("empty_1", "(e) empty kernel, 1 x 32 threads", empty["empty_1"], None),
        ("empty_fc1_grid", f"(e) empty kernel, FC1's grid {empty['fc1_grid'][0]} x {empty['fc1_block'][0]}, "
                           f"{empty['fc1_smem']} B smem", empty["empty_fc1_grid"], None),
    ]


def report(rows, hbm) -> tuple[list[str], dict]:
    """Printed lines and the JSON record of one configuration's rows."""
    lines = [f"  {'stage':58s} {'us':>7s} {'MB read':>8s} {'GB/s':>7s} {'% HBM':>6s}"]
    rec = {}
    for k, label, s, nbytes in rows:
        gbs = nbytes / s / 1e9 if nbytes else None
        rec[k] = {"us": s * 1e6, "bytes": nbytes, "gb_s": gbs, "hbm_ratio": gbs / hbm if gbs else None}
        tail = f" {nbytes / 1e6:8.2f} {gbs:7.0f} {gbs / hbm:6.0%}" if nbytes else ""
        lines.append(f"  {label:58s} {s * 1e6:7.2f}{tail}")
    t = {k: s for k, _, s, _ in rows}
    for variant, fc in (("rotated", ("fc1", "fc2")), ("same routing", ("fc1_same", "fc2_same"))):
        total = t["prep"] + t[fc[0]] + t[fc[1]]
        rec[f"sum_{variant.replace(' ', '_')}_us"] = total * 1e6
        lines.append(f"  (b)+(c)+(d), {variant}: {total * 1e6:.2f} us vs (a) {t['forward'] * 1e6:.2f} us per forward "
                     f"in a graph ((a) - sum {(t['forward'] - total) * 1e6:+.2f} us)")
    return lines, rec


def figures_for(key, pf, rec, hbm, variant: str = "") -> list[dict]:
    tag = f"[{key}: {SHAPES[key]['label']}, l2_prefetch {pf}{variant}]"
    fwd = rec["forward"]["us"]
    out = []
    for k, r in rec.items():
        if not isinstance(r, dict):
            continue
        if r["bytes"]:
            out.append({"name": f"{tag} {k}: routed experts' bandwidth", "value": r["gb_s"], "unit": "GB/s",
                        "reference": "HBM copy bandwidth measured in this run", "reference_value": hbm,
                        "ratio": r["hbm_ratio"], "latency_us": r["us"], "bytes_read": r["bytes"]})
        else:
            out.append({"name": f"{tag} {k}: time per launch", "value": r["us"], "unit": "us",
                        "reference": "decode forward per launch in a graph, same run", "reference_value": fwd,
                        "ratio": r["us"] / fwd})
    s = rec["sum_rotated_us"]
    out.append({"name": f"{tag} prep + FC1 + FC2 alone (rotated) vs forward", "value": s, "unit": "us",
                "reference": "decode forward per launch in a graph, same run", "reference_value": fwd,
                "ratio": s / fwd})
    return out


def prefetch_values(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def measured_start(cp, launches: int, replays: int):
    """What a GPU decode benchmark measures before its figures: (its timer, the HBM copy bandwidth in GB/s, the result's
    details: GPU, CuPy, bandwidth, launches per graph, replays)."""
    timer = Timer(cp)
    hbm = measure_hbm(cp, timer)
    return timer, hbm, {"gpu": _gpu_name(cp), "cupy": cp.__version__, "hbm_copy_gb_s": hbm,
                        "launches_per_graph": launches, "replays": replays}


def shape_keys(text: str) -> list[str]:
    keys = [s.strip() for s in text.split(",") if s.strip()]
    bad = [k for k in keys if k not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {bad}; known: {sorted(SHAPES)}")
    return keys


def ncu_command(args) -> str:
    """The ncu command line that profiles one launch of each decode kernel per shape of ``--eager-once``: its
    warm-up forwards' launches skipped, the one profiled forward per shape counted."""
    keys = shape_keys(args.shapes)
    skip = KERNELS_PER_FORWARD * args.ncu_warmup * len(keys)
    count = KERNELS_PER_FORWARD * len(keys)
    script = str(Path(__file__).resolve().relative_to(ROOT))
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{NCU_KERNELS}", "--launch-skip", str(skip),
           "--launch-count", str(count), "--section", "SpeedOfLight", "--section", "Occupancy", "--section",
           "LaunchStats", sys.executable, script, "--eager-once", "--shapes", ",".join(keys),
           "--l2-prefetch", str(prefetch_values(args.l2_prefetch)[0]), "--ncu-warmup", str(args.ncu_warmup),
           "--dtype", args.dtype]
    return shlex.join(cmd)


def eager_once(args) -> None:
    """Per shape ``--ncu-warmup`` eager forwards, then one more per shape back to back (the launches ncu_command
    profiles, in shape order); no timing. Prints the launches, so that the skip / count can be checked."""
    import cupy as cp

    from kernels.gpu import GpuQMoE

    rng = np.random.default_rng(3)
    runs, seen = [], 0
    for key in shape_keys(args.shapes):
        spec, tensors = node_for(key)
        m = GpuQMoE(spec, tensors)
        m.dec5_cfg = dict(m.dec5_cfg, l2_prefetch=prefetch_values(args.l2_prefetch)[0])
        H, E = spec.hidden_size, spec.num_experts
        x = cp.asarray(rng.standard_normal((1, H)).astype(args.dtype))
        bank = cp.asarray((rng.standard_normal((args.ncu_warmup + 1, E)) * 2.0).astype(np.float32))
        out = cp.empty((1, H), cp.float32)
        for i in range(args.ncu_warmup):
            with recorded(m) as log:
                m.forward_into(x, bank[i:i + 1], out)
            check_forward(log)
            seen += len(log)
        runs.append((key, m, x, bank[args.ncu_warmup:], out))
    cp.cuda.Device().synchronize()
    for key, m, x, lg, out in runs:
        with recorded(m) as log:
            m.forward_into(x, lg, out)
        check_forward(log)
        print(f"[{key}] profiled launches {seen + 1}-{seen + len(log)} of the decode kernels: "
              + ", ".join(f"{r.name} grid {r.grid[0]} x {r.block[0]}" for r in log), flush=True)
        seen += len(log)
    cp.cuda.Device().synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description="Where one GPU decode forward's time goes: decode_prep, FC1, FC2 "
                                             "alone, the whole forward and an empty launch, as CUDA graphs.")
    ap.add_argument("--shapes", default="A,B", help="bench_qmoe_gpu shapes, comma-separated (default A,B)")
    ap.add_argument("--launches", type=int, default=50, help="launches per CUDA graph (default 50)")
    ap.add_argument("--replays", type=int, default=20, help="timed replays per graph, median taken (default 20)")
    ap.add_argument("--l2-prefetch", default="1,0",
                    help="dec5_cfg l2_prefetch settings timed, comma-separated (default 1,0; the first is "
                         "GpuQMoE's default and the one --eager-once runs)")
    ap.add_argument("--eager-once", action="store_true",
                    help="no timing: warm-up forwards, then one eager forward per shape (wrap in the ncu command "
                         "NCU=1 prints)")
    ap.add_argument("--ncu-warmup", type=int, default=2, help="--eager-once: warm-up forwards per shape (default 2)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="x's dtype (default float32); float16 times both decode paths (dec5h and dec5)")
    ap.add_argument("--no-write", action="store_true", help="no result JSON")
    args = ap.parse_args(argv)
    if args.launches < 1 or args.replays < 1 or args.ncu_warmup < 0:
        ap.error("--launches and --replays must be >= 1, --ncu-warmup >= 0")
    if os.environ.get("NCU") == "1":
        print(f"ncu command (one launch of each decode kernel per shape):\n  {ncu_command(args)}", flush=True)
    if args.eager_once:
        return eager_once(args)
    return run(args)


def run(args):
    import cupy as cp

    from kernels.gpu import GpuQMoE

    t_start = time.perf_counter()
    n, replays = args.launches, args.replays
    timer, hbm, details = measured_start(cp, n, replays)
    print(f"{details['gpu']}: HBM copy {hbm:.0f} GB/s; {n} launches per graph, median of {replays} replays", flush=True)
    details["x_dtype"] = args.dtype
    dtype = np.dtype(args.dtype)
    # fp16 x: the fp16 kernels (dec5_cfg f16 = 1) and the bf16 hi / lo ones (0); fp32 x takes the latter either way
    f16_values = (1, 0) if dtype == np.float16 else (1,)
    figures = [hbm_figure(hbm)]
    rng = np.random.default_rng(1)
    stream = cp.cuda.Stream(non_blocking=True)
    for key in shape_keys(args.shapes):
        spec, tensors = node_for(key)
        m = GpuQMoE(spec, tensors)
        fc1_bytes, fc2_bytes = spec.k * m.fc1.slot_bytes(), spec.k * m.fc2.slot_bytes()
        details[f"shape_{key}"] = shape_rec = {"label": SHAPES[key]["label"], "fc1_bytes": fc1_bytes,
                                               "fc2_bytes": fc2_bytes, "compiled_from": m.compiled_from}
        empty = None
        for pf in prefetch_values(args.l2_prefetch):
            for f16 in f16_values:
                parts = time_parts(cp, m, timer, stream, rng, n, replays, pf, dtype, f16)
                if empty is None:  # the floor depends on FC1's grid only, the same for both settings
                    empty = time_empty(cp, timer, stream, parts["fc1_launch"], n, replays)
                    shape_rec["empty"] = dict(empty)
                lines, rec = report(stage_rows(parts["seconds"], empty, fc1_bytes, fc2_bytes, n), hbm)
                variant = f", x {args.dtype}" + (f", f16 {f16}" if dtype == np.float16 else "")
                print(f"\n[{key}] {SHAPES[key]['label']}, l2_prefetch {pf}{variant}, {parts['fc1_launch'].name} "
                      f"grid {parts['fc1_launch'].grid[0]}:", flush=True)
                print("\n".join(lines), flush=True)
                suffix = f"_{args.dtype}_f16_{f16}" if dtype == np.float16 else ""
                shape_rec[f"l2_prefetch_{pf}{suffix}"] = rec
                figures += figures_for(key, pf, rec, hbm, variant if dtype == np.float16 else "")
        del m
        cp.get_default_memory_pool().free_all_blocks()
        if not args.no_write:  # partial results survive a time limit
            _write(figures, details, t_start, benchmark=BENCHMARK)
    if not args.no_write:
        path = _write(figures, details, t_start, benchmark=BENCHMARK)
        print(f"\nwrote {path.relative_to(ROOT)}")
    return figures


if __name__ == "__main__":
    main()
