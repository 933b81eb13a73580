"""Diagnosis (GPU machine's Xeon): is the host's work slower right after a CPU decode kernel because the kernel's
expert rows went through the calling thread's caches? (issue #4)

Inside the engine the host's work between the kernels (Python bookkeeping, onnxruntime's runs of the dense segments)
ran 1.5-2x slower at 0% resident, where a CPU kernel runs at every layer, than at 100%, where none does; threads
spinning or sleeping did not explain it (NOTES-overhead.md, twelfth session). The calling thread takes its share of
the kernel's chunks, so ~1/threads of the experts' bytes (1.3 MB of a shape-B layer on 16 threads) passes through its
core's L1 and L2 and replaces the host's working set there.

Here a host workload is timed right after each of three things, in rounds that alternate them:
- gap:     a Python busy wait as long as the kernel takes (no memory traffic: what the host work costs warm);
- kernel:  the decode kernel on 8 cold experts of shape B (hidden 2048, intermediate 768, int4 block 32), the
           calling thread taking its share of the chunks;
- read:    the busy gap, then the calling thread alone reading 4 MB (more than its core's 2 MB L2) with NumPy: what
           a caller's share of expert rows does to its caches, without the other threads' traffic.
The workload is what a decode layer's host path does: route() and classify_pairs on the router logits, the miss
policy's cost model, a few small NumPy operations, and an onnxruntime CPU session run of a small graph (a 1 x 2048 by
2048 x 128 MatMul and a Softmax: onnxruntime's host-side code). Printed: the medians of the workload's µs after each,
and of the kernel's own µs. Reading it: kernel ≈ read > gap says the caller's caches; kernel > read ≈ gap says the
other threads' traffic or the region's end (L3, memory, the threads' spinning).
On the H200 machine's Xeon (RESULTS.md, nineteenth session) the host work took 16-34 µs more after the kernel than
after the gap; a variant whose calling thread took no chunk brought that back to the gap's figure but cost the kernel
2-4%, and made no difference in the engine (it was removed).

Before the host work, each case also times `alu`: a compiled chain of dependent scalar multiply-adds that touches no
memory. Its time moves only with the core's clock and with what shares the core: slower after the kernel than after
the gap says the calling core runs slower after it (an AVX-512 frequency licence kept for a while after the kernel's
512-bit FMAs, or OpenMP workers spinning on the core's sibling thread); run it again with OMP_WAIT_POLICY=PASSIVE
(no spinning workers) to tell those two apart. Equal `alu`, slower host work: the caches.

    python benchmarks/diag_host_after_kernel.py [--threads 16] [--rounds 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  the engine's OpenMP wait default, set before Numba's runtime loads
from numba import njit  # noqa: E402
from benchmarks.diag_cpu_fixed import E, H, node_of_shape_b  # noqa: E402
from engine.offload.devices import Bandwidths  # noqa: E402
from engine.offload.miss_policy import choose, miss_costs  # noqa: E402
from engine.offload.step_pairs import classify_pairs  # noqa: E402
from kernels.cpu.routing import route  # noqa: E402
from kernels.cpu.threads import use_threads  # noqa: E402


@njit(cache=False)
def _alu_chain(n: int) -> float:
    """n dependent multiply-adds on one float, no memory: its time follows the core's clock."""
    a = 1.0
    for _ in range(n):
        a = a * 1.0000001 + 1e-9
    return a


def small_session():
    """An onnxruntime CPU session of MatMul [1, 2048] x [2048, 128] then Softmax, and its feed."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(1).standard_normal((H, E)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Softmax", ["z"], ["p"], axis=-1)], "router",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, H])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, E])], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    node = node_of_shape_b()
    node.num_threads = args.threads
    use_threads(args.threads)
    spec = node.spec
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    out = np.zeros((1, H), np.float32)
    weights = np.full((1, 8), 0.125, np.float32)
    slot_of = np.full(E, -1, np.int32)
    counts = np.zeros(2 * E, np.int64)
    bandwidths = Bandwidths(pcie=55e9, hbm=4.2e12, cpu=84e9)
    session = small_session()
    feed = {"x": x}
    rotating = iter(np.arange(10 ** 7) % (E // 8))
    scratch = np.ones(1 << 20, np.float32)  # 4 MB

    def kernel():
        start = next(rotating) * 8
        node.run_experts(x, np.arange(start, start + 8, dtype=np.int64).reshape(1, 8), weights, out=out)

    def alu() -> float:
        started = time.perf_counter()
        _alu_chain(4000)
        return time.perf_counter() - started

    def host_work() -> float:
        started = time.perf_counter()
        ids, _w = route(logits, spec)
        _resident, _cold, _hits, missed, _n, _experts, tokens = classify_pairs(ids, slot_of, counts, True)
        choose(miss_costs(bandwidths, 2_661_376, tokens.tolist(), 0.0), 2)
        out.fill(0.0)
        np.copyto(out, x)
        session.run(None, feed)
        return time.perf_counter() - started

    def busy(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    for _ in range(20):  # compiled and warm
        kernel()
        alu()
        host_work()
    after = {"gap": [], "kernel": [], "read": []}
    alu_after = {case: [] for case in after}
    kernel_s = []
    for _ in range(args.rounds):
        for case in ("kernel", "gap", "read"):
            if case == "kernel":
                started = time.perf_counter()
                kernel()
                kernel_s.append(time.perf_counter() - started)
            else:
                busy(statistics.median(kernel_s))
                if case == "read":
                    scratch.sum()
            alu_after[case].append(alu())
            after[case].append(host_work())
    print(f"{args.threads} threads, shape B, 8 cold experts; medians of {args.rounds} rounds, µs")
    print("host work right after: "
          + "  ".join(f"{case} {statistics.median(v) * 1e6:7.1f}" for case, v in after.items()))
    print("alu right after:       "
          + "  ".join(f"{case} {statistics.median(v) * 1e6:7.1f}" for case, v in alu_after.items()))
    print(f"the kernel itself:     {statistics.median(kernel_s) * 1e6:7.1f}")


if __name__ == "__main__":
    main()
