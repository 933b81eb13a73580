"""Benchmark: the v5 decode forward (decode_prep, dec5 FC1, dec5 FC2 with PDL) under several FC1 / FC2 grids, in one
run, at shapes A and B of bench_qmoe_gpu (int4 block 32, every expert resident), 1 token, fp16 x, the HBM copy
bandwidth measured in the same run.

A configuration "b1:b2" sets GpuQMoE.dec5_cfg's bps1 / bps2 (blocks per SM of FC1 / FC2; 0 = the occupancy
calculator's figure, the default). With PDL, FC2's blocks become resident as soon as an SM has room and copy their
first ring stages' weights before they wait for FC1: an FC1 grid below the SMs' capacity leaves that room from FC1's
start, at the price of fewer FC1 warps. The configurations alternate over --rounds rounds; each one's outputs are
compared with the default's on the same inputs. Figures as bench_gpu_pdl.py's: chain (a CUDA graph of N forwards /
N) and single (one forward per replay); % of HBM = the k routed experts' bytes / time / the measured copy bandwidth.

    python benchmarks/bench_gpu_dec5_grid.py [--configs 0:0,4:3,3:4] [--shapes A,B] [--dtype float16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu_decode_parts import shape_keys  # noqa: E402
from benchmarks.bench_gpu_pdl import add_chain_options, chain_start, decode_case, time_variant  # noqa: E402
from benchmarks.bench_qmoe_gpu import SHAPES, _write, hbm_figure  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402


def parse_configs(text: str) -> list[tuple[int, int]]:
    """'0:0,4:3' -> [(0, 0), (4, 3)]; the default (0, 0) first, added if missing."""
    configs = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            b1, b2 = (int(v) for v in item.split(":"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not FC1:FC2 blocks per SM (e.g. 4:3)") from None
        if b1 < 0 or b2 < 0:
            raise SystemExit(f"--configs: {item!r} has a negative block count")
        configs.append((b1, b2))
    return [(0, 0)] + [c for c in dict.fromkeys(configs) if c != (0, 0)]


def set_grid(m, config: tuple[int, int]) -> None:
    m.dec5_cfg = {**m.dec5_cfg, "bps1": config[0], "bps2": config[1]}


def outputs_differ(cp, m, config, x, bank, n) -> float:
    """max |config - default| / max |default| over n eager forwards."""
    got = []
    for c in ((0, 0), config):
        set_grid(m, c)
        got.append(np.stack([m.forward_into(x, bank[i:i + 1], cp.empty((1, x.shape[1]), cp.float32)).get()
                             for i in range(n)]))
    return float(np.abs(got[1] - got[0]).max() / max(np.abs(got[0]).max(), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="0:0,5:2,4:3,3:4,3:5,2:5")
    ap.add_argument("--dtype", default="float16")
    add_chain_options(ap)
    args = ap.parse_args(argv)
    configs = parse_configs(args.configs)

    import cupy as cp

    t_start = time.perf_counter()
    n, replays = args.launches, args.replays
    timer, hbm, details = chain_start(cp, args)
    details.update(configs=[f"{a}:{b}" for a, b in configs], dtype=args.dtype)
    figures = [hbm_figure(hbm)]
    rng = np.random.default_rng(1)
    stream = cp.cuda.Stream(non_blocking=True)
    for key in shape_keys(args.shapes):
        m, nbytes, bank, outs = decode_case(cp, key, rng, n)
        spec = m.spec
        x = cp.asarray(rng.standard_normal((1, spec.hidden_size)).astype(args.dtype))
        runs = {c: [] for c in configs}
        for _ in range(args.rounds):
            for c in configs:
                set_grid(m, c)
                runs[c].append(time_variant(cp, m, timer, stream, x, bank, outs, n, replays))
        rec = {"bytes": nbytes, "compiled_from": m.compiled_from, "pdl": bool(m.last_decode_pdl),
               "kernels": list(m.last_decode_kernels)}
        print(f"\n[{key}] {SHAPES[key]['label']}, x {args.dtype}: {nbytes / 1e6:.1f} MB per token; PDL "
              f"{'on' if m.last_decode_pdl else 'off'}", flush=True)
        base = {label: float(np.median([r[i] for r in runs[(0, 0)]])) for i, label in ((0, "chain"), (1, "single"))}
        for c in configs:
            diff = outputs_differ(cp, m, c, x, bank, n) if c != (0, 0) else 0.0
            name = f"{c[0]}:{c[1]}"
            for i, label in ((0, "chain"), (1, "single")):
                values = [r[i] for r in runs[c]]
                s = float(np.median(values))
                gbs = nbytes / s / 1e9
                print(f"  {name:5s} {label:6s} {s * 1e6:7.2f} us (rounds {', '.join(f'{v * 1e6:.2f}' for v in values)})"
                      f"  {100 * gbs / hbm:5.1f} % of HBM copy, {s / base[label]:.3f}x the default"
                      + (f"; max rel diff {diff:.1e}" if label == "chain" and c != (0, 0) else ""), flush=True)
                rec[f"{name}_{label}_us"] = [v * 1e6 for v in values]
                figures.append({"name": f"[{key}] decode 1 token, x {args.dtype}, bps {name}, {label}",
                                "value": s * 1e6, "unit": "us", "reference": "HBM copy bandwidth (same run)",
                                "reference_value": hbm, "ratio": gbs / hbm})
            rec[f"{name}_max_rel_diff"] = diff
        details[f"shape_{key}"] = rec
        del m
        cp.get_default_memory_pool().free_all_blocks()
    if not args.no_write:
        path = _write(figures, details, t_start, benchmark="gpu-decode-dec5-grid")
        print(f"\nwrote {path.relative_to(ROOT)}")
    return figures


if __name__ == "__main__":
    main()
