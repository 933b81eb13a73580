"""cProfile of a decode step's host Python on the CUDA stand-in, on any machine (no GPU needed).

The stand-in (tests/test_cuda_slots_standin.py) runs the CUDA device path's Python with CuPy replaced by NumPy: the
slots, the split launch, the published routing, the gated merge, the accounts; its "GPU" work is made free here, so
what remains is the host's own work per layer, the part of a "both" layer that NOTES-overhead's thirty-eighth session
found larger than the CPU kernel. Its dense segments are onnxruntime's CPU runs (no graph replays), so `dense_segment`
and onnxruntime's own time do not stand for the GPU's; read the engine's functions. Figures are cProfile's, inflated
for small calls: for attribution, not for time.

    python benchmarks/profile_standin_step.py [--path both|tier|cpu] [--fraction 0] [--steps 40] [--callers NAME,...]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.test_offload as test_offload  # noqa: E402
from engine.writer import WriterSpec, write_model  # noqa: E402
from tests.test_cuda_slots_standin import FakeGpuQMoE, open_on_standin  # noqa: E402

# Qwen3-30B-A3B-like's routing (128 experts, top-8) at a size the dev VM writes in seconds
SPEC = WriterSpec(layers=4, num_experts=128, top_k=8, hidden_size=256, inter_size=96, seed=3, dense_accuracy_level=0)


class _NoLog(list):
    """The stand-in's stream log, kept empty: a long profile would otherwise grow it by every stream operation."""

    def append(self, item) -> None:
        pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="both", help="the decode path asked for (decode_path.py's modes)")
    parser.add_argument("--fraction", type=float, default=0.0, help="experts resident")
    parser.add_argument("--steps", type=int, default=40, help="decode steps profiled (after 40 of warm-up)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--callers", default="", help="functions whose callers to print, comma-separated")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="profile-standin-")) / "model"
    write_model(folder, SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_offload, "SPEC", SPEC)  # the stand-in's helpers read the model's spec from there
        patch.setattr(FakeGpuQMoE, "run_staged", lambda self, x, ids, w, out: None)  # the "GPU"'s work, free
        model, cp = open_on_standin(folder, args.fraction, patch, decode_path=args.path)
        cp.log = _NoLog()
        state = model.new_state()
        logits = model.decoder.forward(state, model.tokenizer.encode("The expert offload engine must be exact."))
        for _ in range(40):  # compilation, the split's table, the trials' first steps
            logits = model.decoder.forward(state, [int(logits[-1].argmax())])
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        for _ in range(args.steps):
            logits = model.decoder.forward(state, [int(logits[-1].argmax())])
        profile.disable()
        wall = time.perf_counter() - started
    per_layer = 1e6 / (args.steps * SPEC.layers)
    print(f"path in force: {model.offload.decode_path_in_force}; {wall * per_layer:.0f} µs a layer under the profiler")
    stats = pstats.Stats(profile)
    rows = sorted(((own * per_layer, cum * per_layer, calls / (args.steps * SPEC.layers),
                    f"{Path(file).name}:{line}:{name}")
                   for (file, line, name), (_, calls, own, cum, _) in stats.stats.items()), reverse=True)
    print(f"{'own µs':>8} {'cum µs':>8} {'calls':>6}  (a layer)")
    for own, cum, calls, where in rows[:args.top]:
        print(f"{own:8.1f} {cum:8.1f} {calls:6.2f}  {where}")
    by_file: dict[str, float] = {}
    for own, _, _, where in rows:
        by_file[where.split(":")[0]] = by_file.get(where.split(":")[0], 0.0) + own
    print("\nown µs a layer by file:")
    for name, own in sorted(by_file.items(), key=lambda item: -item[1])[:20]:
        print(f"{own:8.1f}  {name}")
    for name in filter(None, args.callers.split(",")):
        stats.print_callers(name)


if __name__ == "__main__":
    main()
