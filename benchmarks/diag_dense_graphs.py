"""Diagnosis of the dense graphs' one wrong step (GPU machine, onnxruntime-gpu): the scenario of
tests/test_dense_device.py::test_cuda_dense_graphs_replay_what_onnxruntime_runs, step by step, with what each model
did in the step (copies, swaps, CPU misses, replays), in several variants. One line per step where anything differs.

    python3 benchmarks/diag_dense_graphs.py VARIANT [VARIANT ...]

Variants: test (as the test), verify (every replay checked against onnxruntime's run), static (both models' placement
static), eager (graphs off in both models: do two eager models agree?), sync_replay (the device synchronised after
each replay), sync_node (after each expert node), nocopy (the miss policy never copies).
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


def scenario(name: str, variant: str, steps: int = 40) -> None:
    import cupy as cp

    folder = write_model(Path(tempfile.mkdtemp()) / name, FP16_MODELS[name])
    budget = int(0.5 * all_resident_bytes(LoadedModel.open(folder).folder.experts))
    placement = "static" if variant == "static" else "adaptive"
    config = OffloadConfig(device_expert_bytes=budget, placement=placement)
    eager, graphed, cpu = cuda_model(folder, offload=config), cuda_model(folder, offload=config), LoadedModel.open(folder)
    dense_graph.verify = variant == "verify"
    dense_graph.mismatches.clear()
    patches = []
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
    if variant == "nocopy":
        from engine.offload import hybrid_node
        real_copy = hybrid_node.HybridExpertNode._copy_misses
        hybrid_node.HybridExpertNode._copy_misses = lambda self, *a: hybrid_node._NONE
        patches.append((hybrid_node.HybridExpertNode, "_copy_misses", real_copy))
    graphs_on = variant != "eager"
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(10, FP16_MODELS[name].vocab_size, PROMPT_TOKENS)]
    es, gs, cs = eager.new_state(), graphed.new_state(), cpu.new_state()
    try:
        dense_graph.enabled = False
        ref = eager.decoder.forward(es, prompt)
        cpu.decoder.forward(cs, prompt)
        dense_graph.enabled = graphs_on
        graphed.decoder.forward(gs, prompt)
        worst = 0.0
        for step in range(steps):
            token = int(ref[-1].argmax())
            before = counters(eager), counters(graphed), len(dense_graph.mismatches)
            dense_graph.enabled = False
            ref = eager.decoder.forward(es, [token])
            on_cpu = cpu.decoder.forward(cs, [token])
            dense_graph.enabled = graphs_on
            ours = graphed.decoder.forward(gs, [token])
            after = counters(eager), counters(graphed)
            error = relative_error(ours, ref)
            worst = max(worst, error)
            d_eager = tuple(a - b for a, b in zip(after[0], before[0]))
            d_graphed = tuple(a - b for a, b in zip(after[1], before[1]))
            new_mismatches = dense_graph.mismatches[before[2]:]
            if error > 5e-3 or d_eager != d_graphed or new_mismatches:
                print(f"  step {step:2d}: graphed/eager {error:.4f}  eager/cpu {relative_error(ref, on_cpu):.4f}  "
                      f"graphed/cpu {relative_error(ours, on_cpu):.4f}  (swaps, copies, cpu misses, hits) eager "
                      f"{d_eager} graphed {d_graphed}  mismatches {new_mismatches}", flush=True)
        print(f"{name} {variant}: worst graphed/eager {worst:.4f}; mismatches {len(dense_graph.mismatches)}", flush=True)
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
