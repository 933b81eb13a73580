"""Diagnosis of the dense graphs' one wrong step (GPU machine, onnxruntime-gpu): the scenario of
tests/test_dense_device.py::test_cuda_dense_graphs_replay_what_onnxruntime_runs, step by step, with what each model
did in the step (copies, swaps, CPU misses, replays), in several variants. One line per step where anything differs.

    python3 benchmarks/diag_dense_graphs.py VARIANT [VARIANT ...]

Variants: test (as the test), verify (every replay checked against onnxruntime's run), static (both models' placement
static), eager (graphs off in both models: do two eager models agree?), sync_replay (the device synchronised after
each replay), sync_node (after each expert node), nocopy (the miss policy never copies), sliding (sliding-window segments replayed too, given
their KV buffer's capacity as total length like the others: an experiment; off by 0.22-0.71 on the H200),
sliding-full (the same, every segment given the full-attention KV buffers' capacity: the next experiment), check (as sync_node, and every expert
node's result
checked against the CPU kernels on the same inputs, and placement's expert -> slot map against GpuQMoE's host and
device maps, after every node and step).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import dense_graph  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.writer import write_model  # noqa: E402
from tests.test_dense_device import FP16_MODELS, PROMPT_TOKENS, cuda_model, relative_error  # noqa: E402


def counters(model) -> tuple:
    layers = model.offload.stats.layers
    return tuple(sum(getattr(s, name) for s in layers) for name in ("swaps", "miss_copies", "misses_cpu", "hits"))


def maps_differ(engine) -> list[str]:
    """Where placement's expert -> slot map and GpuQMoE's (host, device) disagree, per layer."""
    found = []
    for layer, (slots, store) in enumerate(zip(engine.slots, engine.stores)):
        gpu = getattr(store, "gpu", None)
        if gpu is None:
            continue
        device = gpu._slot_dev.get()
        resident = slots.slot_of >= 0
        if not (np.array_equal(slots.slot_of[resident], gpu.slot_of[resident])
                and np.array_equal(gpu.slot_of, device)):
            found.append(f"layer {layer}: placement {slots.slot_of.tolist()} gpu host {gpu.slot_of.tolist()} "
                         f"device {device.tolist()}")
    return found


def checked_nodes(cp, names: dict, step_of: list) -> list:
    """HybridExpertNode.run wrapped: the device synchronised around it, its result against the CPU kernels'."""
    from engine.offload import hybrid_node
    from kernels.cpu.routing import route

    real_run = hybrid_node.HybridExpertNode.run

    def host(a):
        return None if a is None else (cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.array(a))

    def run(self, values):
        inputs = self.info.activation_inputs
        cp.cuda.Device().synchronize()
        x, logits = host(values[inputs["input"]]), host(values[inputs["router_probs"]])
        weights_in = host(values[inputs["router_weights"]]) if "router_weights" in inputs else None
        spec = self.info.spec
        before = [(s.hits, s.misses, s.miss_copies, s.misses_cpu) for s in [self.engine.stats.layers[self.layer]]]
        out = real_run(self, values)
        cp.cuda.Device().synchronize()
        got = host(out).astype(np.float32).reshape(-1, spec.hidden_size)
        ids, weights = route(logits.reshape(-1, spec.num_experts), spec, weights_in)
        ref = self.kernel.run_experts(x.reshape(-1, spec.hidden_size), ids, weights,
                                      out=np.zeros(got.shape, np.float32))
        error = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        stats = self.engine.stats.layers[self.layer]
        who = names.get(id(self.engine), "?")
        if error > 2e-2:
            gpu = getattr(self.engine.stores[self.layer], "gpu", None)
            print(f"    NODE step {step_of[0]} {who} layer {self.layer}: relative error {error:.4f}; routed "
                  f"{ids.tolist()} placement slots {self.engine.slots[self.layer].slot_of[ids].tolist()} gpu slots "
                  f"{None if gpu is None else gpu.slot_of[ids].tolist()} (hits, misses, copies, cpu) before "
                  f"{before[0]} after {(stats.hits, stats.misses, stats.miss_copies, stats.misses_cpu)} "
                  f"held {isinstance(values[inputs['input']], cp.ndarray)}", flush=True)
        for line in maps_differ(self.engine):
            print(f"    MAP after node, step {step_of[0]} {who}: {line}", flush=True)
        return out

    hybrid_node.HybridExpertNode.run = run
    return [(hybrid_node.HybridExpertNode, "run", real_run)]


def scenario(name: str, variant: str, steps: int = 40) -> None:
    import cupy as cp

    patches = []
    if variant in ("sliding", "sliding-full"):  # before the models open: their segments ask at open
        real_lengths = dense_graph.total_length_inputs

        def total_length_inputs(nodes, inputs):
            found = {}
            for node in nodes:
                if node.op_type not in dense_graph.REPLAYED_OPS:
                    return None
                if node.op_type == "GroupQueryAttention" and node.input[6] in inputs:
                    found[node.input[6]] = node.input[3]
            return found
        patches.append((dense_graph, "total_length_inputs", real_lengths))
        dense_graph.total_length_inputs = total_length_inputs
    folder = write_model(Path(tempfile.mkdtemp()) / name, FP16_MODELS[name])
    budget = int(0.5 * all_resident_bytes(LoadedModel.open(folder).folder.experts))
    placement = "static" if variant == "static" else "adaptive"
    config = OffloadConfig(device_expert_bytes=budget, placement=placement)
    eager, graphed, cpu = cuda_model(folder, offload=config), cuda_model(folder, offload=config), LoadedModel.open(folder)
    dense_graph.verify = variant == "verify"
    dense_graph.mismatches.clear()
    step_of = [-1]
    captures, real_capture = [], dense_graph.SegmentGraphs.capture

    def capture(self, key, run):
        done = real_capture(self, key, run)
        captures.append(done or self.failed)
        return done
    patches.append((dense_graph.SegmentGraphs, "capture", real_capture))
    dense_graph.SegmentGraphs.capture = capture
    if variant == "sync_replay":
        real = dense_graph.SegmentGraphs.replay

        def replay(self, key):
            done = real(self, key)
            cp.cuda.Device().synchronize()
            return done
        patches.append((dense_graph.SegmentGraphs, "replay", real))
        dense_graph.SegmentGraphs.replay = replay
    if variant == "sync_node":
        from engine.offload import hybrid_node
        real_run = hybrid_node.HybridExpertNode.run

        def run(self, *args, **kwargs):
            cp.cuda.Device().synchronize()
            out = real_run(self, *args, **kwargs)
            cp.cuda.Device().synchronize()
            return out
        patches.append((hybrid_node.HybridExpertNode, "run", real_run))
        hybrid_node.HybridExpertNode.run = run
    if variant == "check":
        patches += checked_nodes(cp, {id(eager.offload): "eager", id(graphed.offload): "graphed"}, step_of)
    if variant == "nocopy":
        from engine.offload import hybrid_node
        real_copy = hybrid_node.HybridExpertNode._copy_misses
        hybrid_node.HybridExpertNode._copy_misses = lambda self, *a: hybrid_node._NONE
        patches.append((hybrid_node.HybridExpertNode, "_copy_misses", real_copy))
    if variant == "sliding-full":  # a sliding layer's buffer holds window + slack positions: the full layers' capacity
        real_total = dense_graph.SegmentGraphs.total_length
        patches.append((dense_graph.SegmentGraphs, "total_length", real_total))
        dense_graph.SegmentGraphs.total_length = lambda self, name: np.array(
            max(slot.array.shape[2] for slot in full_slots[0]), np.int32)
    graphs_on = variant != "eager"
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(10, FP16_MODELS[name].vocab_size, PROMPT_TOKENS)]
    es, gs, cs = eager.new_state(), graphed.new_state(), cpu.new_state()
    full_slots = [[slot for slot in gs.slots if slot.shared and not slot.sliding]]
    try:
        dense_graph.enabled = False
        ref = eager.decoder.forward(es, prompt)
        cpu.decoder.forward(cs, prompt)
        dense_graph.enabled = graphs_on
        graphed.decoder.forward(gs, prompt)
        worst = 0.0
        for step in range(steps):
            step_of[0] = step
            token = int(ref[-1].argmax())
            before = counters(eager), counters(graphed), len(dense_graph.mismatches)
            dense_graph.enabled = False
            ref = eager.decoder.forward(es, [token])
            on_cpu = cpu.decoder.forward(cs, [token])
            dense_graph.enabled = graphs_on
            ours = graphed.decoder.forward(gs, [token])
            after = counters(eager), counters(graphed)
            if variant == "check":
                for who, model in (("eager", eager), ("graphed", graphed)):
                    for line in maps_differ(model.offload):
                        print(f"    MAP at the step's end, step {step} {who}: {line}", flush=True)
            error = relative_error(ours, ref)
            worst = max(worst, error)
            d_eager = tuple(a - b for a, b in zip(after[0], before[0]))
            d_graphed = tuple(a - b for a, b in zip(after[1], before[1]))
            new_mismatches = dense_graph.mismatches[before[2]:]
            if error > 5e-3 or d_eager != d_graphed or new_mismatches:
                print(f"  step {step:2d}: graphed/eager {error:.4f}  eager/cpu {relative_error(ref, on_cpu):.4f}  "
                      f"graphed/cpu {relative_error(ours, on_cpu):.4f}  (swaps, copies, cpu misses, hits) eager "
                      f"{d_eager} graphed {d_graphed}  mismatches {new_mismatches}", flush=True)
        failed = sorted({str(c) for c in captures if c is not True})
        print(f"{name} {variant}: worst graphed/eager {worst:.4f}; mismatches {len(dense_graph.mismatches)}; "
              f"captures {sum(c is True for c in captures)}, failed {failed}", flush=True)
    finally:
        for owner, attribute, value in patches:
            setattr(owner, attribute, value)
        dense_graph.enabled, dense_graph.verify = True, False


if __name__ == "__main__":
    for variant in sys.argv[1:] or ["test"]:
        for name in sorted(FP16_MODELS):
            try:
                scenario(name, variant)
            except Exception as exc:  # noqa: BLE001 - a diagnosis: go on with the next
                print(f"{name} {variant}: {type(exc).__name__}: {exc}", flush=True)
