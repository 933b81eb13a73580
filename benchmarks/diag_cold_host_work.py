"""Diagnosis: what the engine thread's small host calls cost once the expert streams have been through the caches.

A decode step's host work between its layers' launches (the attention mask's lengths in an onnxruntime session on
the host, placement's rebalance at the step's end) took far longer inside a loaded engine than alone: the mask's
segment ~140 µs a step on the H100 machine's Xeon (RESULTS.md, sixty-second session) against ~8 µs timed alone on the
dev VM, the rebalance ~2.4x its time alone (sixtieth session). This times the same kinds of call on one pinned CPU:
back to back; after a 1 ms sleep; after this thread read --mbytes of other memory (its caches evicted); and after
threads on every other CPU read them (the shared last-level cache evicted, as the host-part worker's kernel threads
do while the engine thread waits). Wall time and the thread's CPU time: a call whose CPU time is its wall time ran,
slowly, on its core.

    python benchmarks/diag_cold_host_work.py [--mbytes 256] [--rounds 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from engine.offload.placement import LayerSlots, make_policy  # noqa: E402
from engine.offload.traces import uniform_trace  # noqa: E402


def mask_lengths_session() -> tuple[ort.InferenceSession, dict]:
    """genai's attn_mask_subgraph (ReduceSum - 1 -> seqlens_k, Shape[1] -> total_sequence_length) in a session of one
    thread, as the engine runs it on the host (engine/partition.py HOST_MASK_OPS), and a decode step's feed."""
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("ReduceSum", ["mask", "axis"], ["sum"], keepdims=0),
             helper.make_node("Sub", ["sum", "one"], ["sub"]),
             helper.make_node("Cast", ["sub"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["mask"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["total"], axis=0),
             helper.make_node("Cast", ["total"], ["total_sequence_length"], to=TensorProto.INT32)]
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("mask", TensorProto.INT64, [1, None])],
                              [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
                               helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
                              [one, axis])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, {"mask": np.ones((1, 300), np.int64)}


def placement_rebalance(layers: int = 48):
    """A Qwen3-30B-A3B-like placement (128 experts, top-8, half resident) under uniform routing: its rebalance."""
    trace = uniform_trace(400, layers, 128, 8, seed=3)
    policy = make_policy("adaptive", [LayerSlots(128, 64) for _ in range(layers)])
    for layer in range(layers):
        policy.observe(layer, trace[0, layer])
    policy.initial()
    step = [1]

    def rebalance():
        routing = trace[step[0] % len(trace) or 1]
        step[0] += 1
        for layer in range(layers):
            policy.observe(layer, routing[layer])
        started, cpu = time.perf_counter(), time.thread_time()
        policy.rebalance()
        return time.perf_counter() - started, time.thread_time() - cpu
    for _ in range(200):  # the judge settled (paused, as under random weights)
        rebalance()
    return rebalance


def streamed_by_others(blocks: list[np.ndarray], cpus: list[int]) -> None:
    """Each of `cpus` reads its block (a thread pinned there; NumPy's sum leaves the GIL)."""
    def read(block, cpu):
        os.sched_setaffinity(0, {cpu})
        block.sum(dtype=np.uint64)
    threads = [threading.Thread(target=read, args=(block, cpu)) for block, cpu in zip(blocks, cpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    here, others = cpus[0], cpus[1:]
    os.sched_setaffinity(0, {here})
    memory = np.ones(args.mbytes << 20, np.uint8)
    blocks = np.array_split(memory, max(1, len(others)))
    session, feed = mask_lengths_session()

    def mask_run():
        started, cpu = time.perf_counter(), time.thread_time()
        session.run(None, feed)
        return time.perf_counter() - started, time.thread_time() - cpu
    calls = {"mask's lengths (onnxruntime, one thread)": mask_run, "placement's rebalance (48 layers)":
             placement_rebalance()}
    before = {"back to back": lambda: None, "after 1 ms asleep": lambda: time.sleep(0.001),
              f"after this thread read {args.mbytes} MB": lambda: memory.sum(dtype=np.uint64)}
    if others:
        before[f"after {len(others)} other CPUs read {args.mbytes} MB"] = lambda: streamed_by_others(blocks, others)
    print(f"CPU {here} timed, {len(others)} others; onnxruntime {ort.__version__}, onnx {onnx.__version__}; "
          f"µs median of {args.rounds}, wall / thread CPU time")
    for name, call in calls.items():
        for _ in range(20):
            call()
        for what, first in before.items():
            times = []
            for _ in range(args.rounds):
                first()
                times.append(call())
            wall = statistics.median(t for t, _ in times) * 1e6
            cpu = statistics.median(c for _, c in times) * 1e6
            print(f"  {name:42s} {what:32s} {wall:8.1f} / {cpu:8.1f}", flush=True)


if __name__ == "__main__":
    main()
