"""Can a decode step's CUDA graphs be chained into one graph that the host launches once, and what does it save?

The question behind NOTES-overhead's "whole-step graph" (the thirty-eighth session): a "both" step is, per layer, a
dense segment's graph and the split launch's graph (its routing published to the host, a stop event recorded as an
event record node, a merge gated on the host's CPU part). A captured graph's launch cannot itself be captured (the
H200's driver refuses it: cudaErrorStreamCaptureUnsupported), so the step's graph would be made of the parts' own
graphs as child graph nodes (cuGraphAddChildGraphNode), chained in layer order. This probe builds such a chain from
stand-in parts with the same shape (a "dense" kernel; a child with an external event record node, a kernel that
publishes a per-layer count to page-locked memory and a kernel that waits for the host's gate, then adds the host's
part) and checks:

1. whether the driver takes a child graph that holds an event record node, and whether the chain's results are
   right (the host's gates opened layer by layer, as the engine does);
   The layers' stop events are timed events: the elapsed time between the first and the last fails unless the
   chain's event record nodes recorded them.
2. the host's time for a step of L layers: every part launched on its own (2 L graph launches interleaved with the
   host's per-layer spin, part and gate, as the engine's decode step) against one chained launch and the same
   per-layer host loop.

With `--engine-parts`, the same question of the engine's own part graphs: a writer-made model with a few layers
decodes on decode path "both" (dense part on onnxruntime-gpu), and every graph its dense segments and split launches
hold is added as a child node of one chain, which is instantiated (not launched: the host's gates are not driven).

Run on the GPU machine: `python benchmarks/diag_step_graph.py [--layers 48] [--steps 200] [--engine-parts 4]`.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.units import counted  # noqa: E402
from kernels.gpu.driver_calls import DriverCalls  # noqa: E402
from kernels.gpu.launch_pdl import CUDA_SUCCESS, libcuda  # noqa: E402

SOURCE = r"""
extern "C" __global__ void dense_like(float* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = h[i] * 0.5f + 1.0f;
}
// the routing's stand-in: the launch's number, counted on the device (replays included), to the host
extern "C" __global__ void publish(unsigned* seq, volatile unsigned* flag) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        unsigned s = seq[0] + 1;
        seq[0] = s;
        __threadfence_system();
        *flag = s;
    }
}
// the gated merge's stand-in: each block waits for the host's gate to reach this launch's number, then adds the part
extern "C" __global__ void gated(const unsigned* seq, volatile const unsigned* gate, float* h,
                                 volatile const float* part, int n) {
    if (threadIdx.x == 0) {
        unsigned want = seq[0];
        while (*gate != want) { }
    }
    __syncthreads();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] += part[i];
}
"""


def _driver():
    cuda = libcuda()
    graph_t = ctypes.c_void_p
    cuda.cuGraphCreate.argtypes = [ctypes.POINTER(graph_t), ctypes.c_uint]
    cuda.cuGraphAddChildGraphNode.argtypes = [ctypes.POINTER(ctypes.c_void_p), graph_t,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, graph_t]
    cuda.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), graph_t, ctypes.c_ulonglong]
    cuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return cuda


def _check(status: int, call: str) -> None:
    if status != CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: CUresult {status}")


class Layer:
    """One layer's parts: the dense graph, the split graph, and the page-locked block the host and kernels share."""

    def __init__(self, cp, module, calls, h, n: int, stream):
        self.n = n
        self.pinned = cp.cuda.alloc_pinned_memory(4096 + 4 * n)
        block = np.frombuffer(self.pinned, np.uint8, 4096 + 4 * n)
        block[:] = 0
        self.flag, self.gate = block[:4].view(np.uint32), block[128:132].view(np.uint32)
        self.part = block[4096:].view(np.float32)
        base = block.ctypes.data  # page-locked memory is reached at its host address under unified addressing
        self.seq = cp.zeros(1, cp.uint32)
        self.launched = 0
        self.stop = cp.cuda.Event()  # timed: elapsed time between two of them fails unless both were recorded
        grid, threads = ((n + 255) // 256,), (256,)
        dense, publish, gated = (module.get_function(name) for name in ("dense_like", "publish", "gated"))
        with stream:
            stream.begin_capture()
            dense(grid, threads, (h, np.int32(n)))
            self.dense_graph = stream.end_capture()
            stream.begin_capture()
            publish((1,), (32,), (self.seq, np.uint64(base)))
            calls.record_external(self.stop.ptr, stream.ptr)  # the event record node, as run_routed_split's graph
            gated(grid, threads, (self.seq, np.uint64(base + 128), h, np.uint64(base + 4096), np.int32(n)))
            self.split_graph = stream.end_capture()

    def host_part(self, value: float) -> None:
        """The host's work for the layer once its launch is queued: wait for the publish, write the part, open the
        gate (the engine's split_routing, CPU kernel and merge_split)."""
        self.launched += 1
        want = self.launched & 0xFFFFFFFF
        started = time.perf_counter()
        while self.flag[0] != want:
            if time.perf_counter() - started > 1.0:
                raise RuntimeError(f"publish never came: flag {int(self.flag[0])}, expected {want}")
        self.part[:] = value
        self.gate[0] = want


def chain(cuda, layers) -> ctypes.c_void_p:
    """Every layer's dense graph then split graph as child nodes, one after the other; the instantiated graph."""
    parent = ctypes.c_void_p()
    _check(cuda.cuGraphCreate(ctypes.byref(parent), 0), "cuGraphCreate")
    previous = None
    for layer in layers:
        for part in (layer.dense_graph, layer.split_graph):
            node = ctypes.c_void_p()
            deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
            _check(cuda.cuGraphAddChildGraphNode(ctypes.byref(node), parent, deps, 0 if deps is None else 1,
                                                 ctypes.c_void_p(part.graph)), "cuGraphAddChildGraphNode")
            previous = node
    executable = ctypes.c_void_p()
    _check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(executable), parent, 0), "cuGraphInstantiateWithFlags")
    return executable


def add_chain(cuda, graphs: list) -> tuple[int, str]:
    """(children added, the outcome) of chaining CuPy graphs as child nodes and instantiating the chain."""
    parent = ctypes.c_void_p()
    _check(cuda.cuGraphCreate(ctypes.byref(parent), 0), "cuGraphCreate")
    previous, added = None, 0
    for graph in graphs:
        node = ctypes.c_void_p()
        deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
        status = cuda.cuGraphAddChildGraphNode(ctypes.byref(node), parent, deps, 0 if deps is None else 1,
                                               ctypes.c_void_p(graph.graph))
        if status != CUDA_SUCCESS:
            return added, f"cuGraphAddChildGraphNode refused child {added}: CUresult {status}"
        previous, added = node, added + 1
    executable = ctypes.c_void_p()
    status = cuda.cuGraphInstantiateWithFlags(ctypes.byref(executable), parent, 0)
    return added, "instantiated" if status == CUDA_SUCCESS else f"cuGraphInstantiateWithFlags: CUresult {status}"


def engine_parts(cuda, layers: int, steps: int) -> None:
    """The engine's part graphs after `steps` decode steps on "both" at 0% resident, chained and instantiated."""
    from benchmarks.bench_offload_ab import open_model
    from engine.dense_segment import DenseSegment
    from kernels.gpu.qmoe import _EAGER

    model, prompt = open_model("qwen3-30b-a3b-like", layers, None, prefix="diag-step-graph-")
    model.offload.set_decode_path("both")
    state = model.new_state()
    token = int(model.decoder.forward(state, prompt)[-1].argmax())
    for _ in range(steps):
        token = int(model.decoder.forward(state, [token])[-1].argmax())
    dense, split = [], []
    for step in model.decoder.steps:
        if isinstance(step, DenseSegment):
            for binding in list(step.bindings._by_state.values()):
                if binding._graphs is not None:
                    dense += list(binding._graphs._graphs.values())
    for store in model.offload.stores:
        split += [graph for graph in store.gpu._graphs.values() if graph is not _EAGER]
    print(f"engine parts after {counted(steps, 'step')} on {model.offload.decode_path_in_force!r}: "
          f"{counted(len(dense), 'dense segment graph')}, {counted(len(split), 'expert launch graph')}")
    for name, graphs in (("dense segments", dense), ("expert launches", split), ("all", dense + split)):
        added, outcome = add_chain(cuda, graphs)
        print(f"  {name}: {added} of {len(graphs)} chained, {outcome}")


def expected_after(h0: np.ndarray, layers: int, steps: int) -> np.ndarray:
    h = h0.astype(np.float32).copy()
    for _ in range(steps):
        for index in range(layers):
            h = h * np.float32(0.5) + np.float32(1.0)
            h = h + np.float32(index + 1) / np.float32(64)
    return h


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--engine-parts", type=int, metavar="LAYERS", default=0,
                        help="also chain the engine's own part graphs of a model with this many layers")
    args = parser.parse_args(argv)
    import cupy as cp

    cuda, calls = _driver(), DriverCalls.from_driver()
    if args.engine_parts:
        engine_parts(cuda, args.engine_parts, 24)
    module = cp.RawModule(code=SOURCE)
    stream = cp.cuda.Stream(non_blocking=True)
    h = cp.zeros(args.hidden, cp.float32)
    layers = [Layer(cp, module, calls, h, args.hidden, stream) for _ in range(args.layers)]
    print(f"CuPy {cp.__version__}, driver {cp.cuda.runtime.driverGetVersion()}, {args.layers} layers")

    def step_apart() -> None:  # as the engine: per layer, the dense graph, the split graph, the host's part
        for index, layer in enumerate(layers):
            layer.dense_graph.launch(stream)
            layer.split_graph.launch(stream)
            layer.host_part((index + 1) / 64)

    try:
        executable = chain(cuda, layers)
    except RuntimeError as exc:
        print(f"chained graph refused: {exc}")
        executable = None

    launch_s = []  # the chained graph's launch call alone

    def step_chained() -> None:
        started = time.perf_counter()
        _check(cuda.cuGraphLaunch(executable, ctypes.c_void_p(stream.ptr)), "cuGraphLaunch")
        launch_s.append(time.perf_counter() - started)
        for index, layer in enumerate(layers):
            layer.host_part((index + 1) / 64)

    # the chain first: its stop events have been recorded by nothing else when the first check reads them
    ways = ({"chained": step_chained} if executable is not None else {}) | {"apart": step_apart}
    for name, step in ways.items():
        h.fill(0)
        stream.synchronize()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            step()
            stream.synchronize()
            times.append(time.perf_counter() - started)
        want = expected_after(np.zeros(args.hidden, np.float32), args.layers, args.steps)
        got = cp.asnumpy(h)
        error = float(np.max(np.abs(got - want)) / max(1e-30, float(np.max(np.abs(want)))))
        try:
            span = f"{cp.cuda.get_elapsed_time(layers[0].stop, layers[-1].stop) * 1e3:.1f} µs"
        except cp.cuda.runtime.CUDARuntimeError as exc:
            span = f"not recorded ({exc})"
        print(f"{name:8s} step {statistics.median(times[10:]) * 1e6:8.1f} µs median "
              f"({statistics.median(times[10:]) * 1e6 / args.layers:6.1f} a layer), relative error {error:.1e}; "
              f"first to last layer's stop event: {span}")
    if launch_s:
        print(f"the chained graph's launch call: {statistics.median(launch_s) * 1e6:.1f} µs median")


if __name__ == "__main__":
    main()
