"""Diagnosis: where a "both" layer's host time goes, from one gate to the next (issue #4, NOTES-overhead's next step).

Every decode step under the decode path "both" is timed on the host at the boundaries of what a layer does there: the
dense segments' runs (`dense`: a replay launched again, or a run), a layer's launch (`launch`), its wait for the
routing (`wait`), the CPU's share (`cpu`) and the gate (`gate`). Between two gates lies one layer's host chain; the
most common order of events in it is printed with the median of each event and of each gap before it (µs), so the
host's work after a gate, before the GPU can go on, reads off directly. `--ahead` turns engine.decoder.launch_ahead on.

    python3 benchmarks/diag_host_timeline.py --folder /tmp/bench-qwen3-30b-a3b-like [--fraction 0] [--ahead]
    python3 benchmarks/diag_host_timeline.py --standin     # the CUDA stand-in (tests), on any machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import split_words  # noqa: E402
from engine import decoder  # noqa: E402
from engine.dense_segment import DenseSegment  # noqa: E402
from engine.offload.hybrid_node import HybridExpertNode  # noqa: E402
from engine.units import counted  # noqa: E402

WARMUP = 64  # decode steps before the timed ones: graphs captured, tables made, the trials' first steps over


class Timeline:
    """(event, start, end) per host boundary, perf_counter seconds, over the timed steps; an event inside another is
    part of the outer one."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []
        self.recording = False
        self._depth = 0  # events under way: one inside another (the stand-in's "GPU" runs the CPU kernel) is not kept
        self._undo: list = []

    def wrap(self, owner, method: str, event: str) -> None:
        """Time every call of `owner.method` (a class's) as `event`, while recording."""
        real = getattr(owner, method)
        timeline = self

        def timed(*args, **kwargs):
            if not timeline.recording or timeline._depth:
                return real(*args, **kwargs)
            timeline._depth += 1
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                timeline.events.append((event, started, time.perf_counter()))
                timeline._depth -= 1

        setattr(owner, method, timed)
        self._undo.append((owner, method, real))

    def unwrap(self) -> None:
        for owner, method, real in reversed(self._undo):
            setattr(owner, method, real)
        self._undo.clear()

    def layers(self) -> list[list[tuple[str, float, float]]]:
        """The events from one gate's end to the next gate's end, each such stretch a list."""
        stretches, current = [], None
        for event in self.events:
            if current is not None:
                current.append(event)
            if event[0] == "gate":
                if current is not None:
                    stretches.append(current)
                current = [event]
        return stretches


def instrument(model) -> Timeline:
    """The timeline's boundaries on `model`'s classes: its dense segments, its hybrid nodes, its stores and CPU
    kernels."""
    timeline = Timeline()
    timeline.wrap(DenseSegment, "run", "dense")
    timeline.wrap(DenseSegment, "run_again", "dense again")
    timeline.wrap(HybridExpertNode, "_run_split", "launch")
    stores = {type(store) for store in model.offload.stores if store is not None}
    for store_class in stores:
        timeline.wrap(store_class, "split_routing", "wait")
        timeline.wrap(store_class, "merge_split", "gate")
    kernels = {type(node.kernel) for node in model.decoder.steps if isinstance(node, HybridExpertNode)}
    for kernel_class in kernels:
        timeline.wrap(kernel_class, "run_experts", "cpu")
    return timeline


def summarise(timeline: Timeline) -> tuple[tuple[str, ...], list[tuple[str, float, float]], int, int]:
    """(the most common order of events from one gate to the next, [(event, median gap before it µs, median µs)],
    how many stretches had that order, how many in all)."""
    stretches = timeline.layers()
    orders = Counter(tuple(name for name, _, _ in stretch[1:]) for stretch in stretches)
    if not orders:
        return (), [], 0, 0
    order, count = orders.most_common(1)[0]
    chosen = [stretch for stretch in stretches if tuple(name for name, _, _ in stretch[1:]) == order]
    rows = []
    for i, name in enumerate(order, start=1):
        gaps = [(stretch[i][1] - stretch[i - 1][2]) * 1e6 for stretch in chosen]
        spans = [(stretch[i][2] - stretch[i][1]) * 1e6 for stretch in chosen]
        rows.append((name, statistics.median(gaps), statistics.median(spans)))
    return order, rows, count, len(stretches)


def report(timeline: Timeline) -> str:
    order, rows, count, total = summarise(timeline)
    if not rows:
        return "no layer went from one gate to another (no \"both\" step timed)"
    lines = [f"from a gate's end to the next gate's end ({count} of {total} stretches in this order); µs, medians:",
             f"{'event':>12} {'gap before':>11} {'lasts':>8}"]
    lines += [f"{name:>12} {gap:11.1f} {span:8.1f}" for name, gap, span in rows]
    to_wait = next((i for i, name in enumerate(order) if name == "wait"), None)
    if to_wait is not None:
        chain = sum(gap for _, gap, _ in rows[:to_wait + 1]) + sum(span for _, _, span in rows[:to_wait])
        lines.append(f"the host's work from a gate to its wait for the next routing: {chain:.1f} µs")
    return "\n".join(lines)


def run(model, prompt: list[int], steps: int, warmup: int = WARMUP) -> Timeline:
    """`model` decoding under "both": `warmup` steps, then `steps` timed ones."""
    model.offload.set_decode_path("both")
    timeline = instrument(model)
    try:
        state = model.new_state()
        token = int(model.decoder.forward(state, prompt)[-1].argmax())
        for _ in range(warmup):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
        timeline.recording = True
        for _ in range(steps):
            token = int(model.decoder.forward(state, [token])[-1].argmax())
    finally:
        timeline.recording = False
        timeline.unwrap()
    return timeline


def on_standin(args) -> tuple:
    """The CUDA stand-in's small model (tests/test_cuda_slots_standin.py) timed; (the model, its Timeline)."""
    import tempfile

    import pytest

    import tests.test_offload as test_offload
    from benchmarks.profile_standin_step import SPEC
    from engine.writer import write_model
    from tests.test_cuda_slots_standin import open_on_standin

    folder = Path(tempfile.mkdtemp(prefix="diag-timeline-")) / "model"
    write_model(folder, SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_offload, "SPEC", SPEC)  # the stand-in's helpers read the model's spec from there
        model, _cp = open_on_standin(folder, args.fraction, patch)
        return model, run(model, model.tokenizer.encode("Where does the host's time go?"), args.steps, args.warmup)


def on_cuda(args) -> tuple:
    """The shape's model (--layers of them) on the GPU, its dense part there, timed; (the model, its Timeline)."""
    from benchmarks.bench_offload_ab import open_model
    from engine.offload import OffloadConfig
    from engine.offload.planner import all_resident_bytes

    model, prompt = open_model(args.shape, args.layers, args.folder, "float16", "cuda", "diag-timeline-")
    budget = int(args.fraction * all_resident_bytes(model.folder.experts))
    model.offload.reconfigure(OffloadConfig(device_expert_bytes=budget), decode_path="both")
    return model, run(model, prompt, args.steps, args.warmup)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-like")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--folder", help="the benchmark's model folder (written there once, reused after)")
    parser.add_argument("--fraction", type=float, default=0.0, help="experts resident")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--ahead", action="store_true", help="engine.decoder.launch_ahead on")
    parser.add_argument("--standin", action="store_true", help="the CUDA stand-in's small model (no GPU needed)")
    args = parser.parse_args(argv)
    ahead_before, decoder.launch_ahead = decoder.launch_ahead, args.ahead
    try:
        model, timeline = on_standin(args) if args.standin else on_cuda(args)
    finally:
        decoder.launch_ahead = ahead_before
    # every layer's split table, each distinct one with its layers, and the host's gap the tables were made with
    print(f"dense part on the {model.dense_device}; launch ahead {'on' if args.ahead else 'off'}; "
          f"{counted(model.decoder.layers_ahead, 'layer')} launched ahead"
          + split_words(model.offload.copy_state()["decode_path"]["cold_split"]))
    print(report(timeline))


if __name__ == "__main__":
    main()
