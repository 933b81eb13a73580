"""Benchmark: the v5 decode forward (decode_prep, dec5 FC1, dec5 FC2) with one of its switches off and on, in one run,
at shapes A and B of bench_qmoe_gpu (int4 block 32, every expert resident), 1 token, x fp16 and fp32, the HBM copy
bandwidth measured in the same run. Switches (--switch):
  pdl: FC1 and FC2 launched plainly or with programmatic dependent launch (GpuQMoE.dec5_cfg["pdl"],
       kernels/gpu/launch_pdl.py); the default;
  rank_route: decode_prep routing one warp per token in k arg-max rounds, or by ranks counted by the whole block
              (GpuQMoE.dec_cfg["rank_route"], route.cu).

Per variant, two figures (CUDA events behind a spin kernel, bench_qmoe_gpu.Timer, median over replays):
  chain: a CUDA graph of N forwards back to back, each with its own routing row, / N (the launch gaps inside a
         forward and between forwards);
  single: one forward per graph replay, the routing row changed between replays (bench_qmoe_gpu's headline: graph
          launch latency included).
The variants alternate over --rounds rounds (off first), so drift between them shows; the outputs of both are
compared on the same inputs. % of HBM = the k routed experts' bytes (weights + scales + biases, our layout) / time /
the measured copy bandwidth (read + write counted).

    python benchmarks/bench_gpu_pdl.py [--switch pdl|rank_route] [--shapes A,B] [--dtypes float16,float32]
                                       [--launches 32] [--replays 30]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu_decode_parts import measured_start, per_launch, shape_keys  # noqa: E402
from benchmarks.bench_qmoe_gpu import SHAPES, _write, capture, hbm_figure, node_for  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402

SWITCHES = {"pdl": ("dec5_cfg", ("plain", "pdl")), "rank_route": ("dec_cfg", ("warp", "ranks"))}  # cfg, names off / on


def set_switch(m, switch: str, value: int) -> None:
    cfg = SWITCHES[switch][0]
    setattr(m, cfg, {**getattr(m, cfg), switch: value})


def variants(switch: str) -> tuple:
    """((name, value) off, (name, value) on)."""
    return tuple(zip(SWITCHES[switch][1], (0, 1)))


def time_variant(cp, m, timer, stream, x, bank, outs, n, replays) -> tuple[float, float]:
    """(chain, single) seconds per forward for m's current dec5_cfg."""

    def chain():
        for i in range(n):
            m.forward_into(x, bank[i:i + 1], outs[i])

    with stream:
        m.forward_into(x, bank[0:1], outs[0])  # sizes the workspace before any capture
        t_chain = per_launch(cp, timer, stream, chain, n, replays)
        lg = bank[0:1].copy()
        single = capture(cp, stream, lambda: m.forward_into(x, lg, outs[0]))
        t_single = timer.median(single, iters=replays * 4,
                                prep=lambda i: lg.__setitem__(Ellipsis, bank[(7 * i) % n]))[0]
    return t_chain, t_single


def add_chain_options(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark that times chains of one-token forwards in alternating rounds (this one and
    bench_gpu_dec5_grid.py)."""
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--launches", type=int, default=32)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")


def chain_start(cp, args) -> tuple:
    """measured_start for add_chain_options' arguments, its figures printed: (timer, HBM copy GB/s, details)."""
    n, replays = args.launches, args.replays
    timer, hbm, details = measured_start(cp, n, replays)
    print(f"{details['gpu']}: HBM copy {hbm:.0f} GB/s; chain of {n} forwards per graph, median of {replays} replays",
          flush=True)
    details["rounds"] = args.rounds
    return timer, hbm, details


def decode_case(cp, key: str, rng, n: int) -> tuple:
    """(GpuQMoE of shape `key` with every expert resident, the bytes its k routed experts read per token, n routing
    rows, n output rows) for a chain of n one-token forwards."""
    from kernels.gpu import GpuQMoE

    spec, tensors = node_for(key)
    m = GpuQMoE(spec, tensors)
    nbytes = spec.k * (m.fc1.slot_bytes() + m.fc2.slot_bytes())
    bank = cp.asarray((rng.standard_normal((n, spec.num_experts)) * 2.0).astype(np.float32))
    return m, nbytes, bank, cp.empty((n, 1, spec.hidden_size), cp.float32)


def outputs_agree(cp, m, switch, x, bank, n) -> float:
    """max |on - off| / max |off| over n eager forwards."""
    got = []
    for _, value in variants(switch):
        set_switch(m, switch, value)
        got.append(np.stack([m.forward_into(x, bank[i:i + 1], cp.empty((1, x.shape[1]), cp.float32)).get()
                             for i in range(n)]))
    return float(np.abs(got[1] - got[0]).max() / max(np.abs(got[0]).max(), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="pdl")
    ap.add_argument("--dtypes", default="float16,float32")
    add_chain_options(ap)
    args = ap.parse_args(argv)

    import cupy as cp

    switch = args.switch
    (off, _), (on, _) = variants(switch)
    t_start = time.perf_counter()
    n, replays = args.launches, args.replays
    timer, hbm, details = chain_start(cp, args)
    details["switch"] = switch
    figures = [hbm_figure(hbm)]
    rng = np.random.default_rng(1)
    stream = cp.cuda.Stream(non_blocking=True)
    for key in shape_keys(args.shapes):
        m, nbytes, bank, outs = decode_case(cp, key, rng, n)
        spec = m.spec
        rec = {"bytes": nbytes, "compiled_from": m.compiled_from, "pdl_available": m._pdl is not None}
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            x = cp.asarray(rng.standard_normal((1, spec.hidden_size)).astype(dtype))
            runs = {name: [] for name, _ in variants(switch)}
            for _ in range(args.rounds):
                for name, value in variants(switch):
                    set_switch(m, switch, value)
                    runs[name].append(time_variant(cp, m, timer, stream, x, bank, outs, n, replays))
                    rec.setdefault(f"kernels_{dtype}", list(m.last_decode_kernels))
            diff = outputs_agree(cp, m, switch, x, bank, n)
            print(f"\n[{key}] {SHAPES[key]['label']}, x {dtype}: {nbytes / 1e6:.1f} MB per token; {on} vs {off} "
                  f"max rel diff {diff:.1e}", flush=True)
            rec[f"{dtype}_max_rel_diff"] = diff
            for name, _ in variants(switch):
                chains = [c for c, _ in runs[name]]
                singles = [s for _, s in runs[name]]
                for label, values in (("chain", chains), ("single", singles)):
                    s = float(np.median(values))
                    gbs = nbytes / s / 1e9
                    print(f"  {name:6s} {label:6s} {s * 1e6:7.2f} us  (rounds {', '.join(f'{v * 1e6:.2f}' for v in values)})"
                          f"  {gbs:6.0f} GB/s = {100 * gbs / hbm:5.1f} % of HBM copy", flush=True)
                    rec[f"{dtype}_{name}_{label}_us"] = [v * 1e6 for v in values]
                    figures.append({"name": f"[{key}] decode 1 token, x {dtype}, {name}, {label}", "value": s * 1e6,
                                    "unit": "us", "reference": "HBM copy bandwidth (same run)",
                                    "reference_value": hbm, "ratio": gbs / hbm})
            for label, i in (("chain", 0), ("single", 1)):
                t_off = np.median([r[i] for r in runs[off]])
                t_on = np.median([r[i] for r in runs[on]])
                print(f"  {label}: {on} / {off} time {t_on / t_off:.3f}", flush=True)
        details[f"shape_{key}"] = rec
        del m
        cp.get_default_memory_pool().free_all_blocks()
    if not args.no_write:
        path = _write(figures, details, t_start, benchmark=f"gpu-decode-{switch.replace('_', '-')}")
        print(f"\nwrote {path.relative_to(ROOT)}")
    return figures


if __name__ == "__main__":
    main()
