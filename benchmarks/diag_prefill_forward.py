"""Where one prefill forward's GPU time goes (issue 3): GpuQMoE's default prefill at one of bench_qmoe_gpu's shapes,
its kernels seen by a profiler, or the whole forward timed by CUDA events.

After two warm-up forwards, one forward runs between cudaProfilerStart and cudaProfilerStop, so a profiler started
with profiling off sees exactly that forward's kernels, however many it launches (preparation, FC1, FC2):

    ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        python benchmarks/diag_prefill_forward.py --shape B
    python benchmarks/diag_prefill_forward.py --shape B --time     # the forward's median by CUDA events

--pairs-given does the same with the routed pairs given (run_experts, as the engine's prefill waves call it), so the
preparation only ranks and groups them: against the routed forward, the routing's share.

benchmarks/gpu_prefill_breakdown.sh runs both at shapes B and A on the GPU machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_qmoe_gpu import SHAPES, Timer, node_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="B")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--time", action="store_true", help="time the forward by CUDA events (no profiler range)")
    parser.add_argument("--pairs-given", action="store_true",
                        help="the routed pairs given (run_experts, as the engine's prefill waves): the preparation "
                             "only groups them, so its routing's share shows against the routed forward")
    args = parser.parse_args()

    import cupy as cp
    import cupyx.profiler

    from kernels.gpu import GpuQMoE

    rng = np.random.default_rng(3)
    spec, tensors = node_for(args.shape)
    m = GpuQMoE(spec, tensors)
    x = cp.asarray(rng.standard_normal((args.tokens, spec.hidden_size)).astype(np.float32))
    logits = cp.asarray((rng.standard_normal((args.tokens, spec.num_experts)) * 2).astype(np.float32))
    out = cp.empty((args.tokens, spec.hidden_size), cp.float32)
    if args.pairs_given:
        ids, w = m.route(logits)

        def forward():
            m.run_experts(x, ids, w, out=out)
    else:
        def forward():
            m.forward_into(x, logits, out)
    for _ in range(2):  # workspaces, kernel loading
        forward()
    cp.cuda.Device().synchronize()
    if args.time:
        med, p10, p90 = Timer(cp).median(forward, iters=20, spin_cycles=300_000)
        what = "pairs given" if args.pairs_given else "forward"
        print(f"[{args.shape}] {args.tokens} tokens: {what} {med * 1e6:.1f} µs (p10 {p10 * 1e6:.1f}, p90 "
              f"{p90 * 1e6:.1f}); prefill kernels {' / '.join(m.last_prefill_kernels)}", flush=True)
        return
    with cupyx.profiler.profile():  # cudaProfilerStart / Stop
        forward()
        cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
