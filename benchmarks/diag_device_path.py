"""Which part of the GPU dense path makes logits differ from the CPU's (a diagnostic for the GPU machine).

The writer's fp16 test models (tests/test_dense_device.py: FP16_MODELS) run with the dense part on onnxruntime-gpu,
the experts on the CPU (no offload) or offloaded at 100% / 50%, against the same model all on the CPU, fed the CPU's
tokens. Each variant changes one part of the path (monkeypatched for the run); where a variant's errors fall back to
fp16 rounding (~1e-3), that part is the cause. Found this way on the H200 (2026-12-01): onnxruntime copies a bound
input when it is bound, so kept buffers rewritten in place were read stale (engine/dense_segment.py says how that
is avoided now).

Per line: the relative error of the prompt's logits (all rows), then of each decode step; the prompt's rows that
differ by more than 1e-2 are listed above it.

    SEED=9 python3 benchmarks/diag_device_path.py [VARIANT,...]   # needs onnxruntime-gpu and a GPU

Variants: baseline, no_sync_off (wait for the stream after every run), keeps_off (no kept device output buffers),
no_cut_on_device (every cut tensor to the host), rebind_inputs (every input bound again at every run),
sync_after_run, reserve_512 (KV buffers long enough that no decode step grows them).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import engine.decoder_state as decoder_state  # noqa: E402
import engine.dense_segment as dense_segment  # noqa: E402
from engine.decoder import PartitionedDecoder  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.writer import write_model  # noqa: E402
from tests.test_dense_device import DECODE_STEPS, FP16_MODELS, PROMPT_TOKENS, cuda_model, relative_error  # noqa: E402

CASES = [("fp16", None), ("fp16-sliding", None), ("fp16-sliding", 1.0), ("fp16-sliding", 0.5)]


def errors(folder: Path, name: str, fraction: float | None, seed: int) -> list[float]:
    """The prompt's and each decode step's relative error of the GPU run against the CPU's."""
    spec = FP16_MODELS[name]
    cpu = LoadedModel.open(folder)
    offload = None
    if fraction is not None:
        offload = OffloadConfig(device_expert_bytes=int(fraction * all_resident_bytes(cpu.folder.experts)))
    gpu = cuda_model(folder, offload=offload)
    gpu_state, cpu_state = gpu.new_state(), cpu.new_state()
    prompt = [int(t) for t in np.random.default_rng(seed).integers(10, spec.vocab_size, PROMPT_TOKENS)]
    ours, ref = gpu.decoder.forward(gpu_state, prompt), cpu.decoder.forward(cpu_state, prompt)
    rows = np.abs(ours.astype(np.float64) - ref).max(axis=1) / np.abs(ref).max()
    print(f"   prompt rows off by > 1e-2 (of {len(rows)}): {np.nonzero(rows > 1e-2)[0].tolist()}", flush=True)
    found = [relative_error(ours, ref)]
    for _ in range(DECODE_STEPS):
        token = int(ref[-1].argmax())
        ours, ref = gpu.decoder.forward(gpu_state, [token]), cpu.decoder.forward(cpu_state, [token])
        found.append(relative_error(ours, ref))
    return found


def apply(patch: pytest.MonkeyPatch, variant: str) -> None:
    """Change the one part of the path that `variant` names, for this run."""
    binding, outputs = dense_segment.SegmentBinding, dense_segment.DeviceOutputs
    if variant in ("no_sync_off", "keeps_off"):
        real_init = outputs.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            if variant == "no_sync_off":
                self.no_sync = None
            else:
                self.keeps = False
        patch.setattr(outputs, "__init__", init)
    elif variant == "no_cut_on_device":
        patch.setattr(PartitionedDecoder, "place_cut_tensors", lambda self: None)
    elif variant in ("rebind_inputs", "sync_after_run"):
        real_run = binding.run

        def run(self, values):
            if variant == "rebind_inputs":
                self._held.clear()
            results = real_run(self, values)
            if variant == "sync_after_run":
                self.backend.synchronize()
            return results
        patch.setattr(binding, "run", run)
    elif variant == "reserve_512":
        patch.setattr(decoder_state, "CAPACITY_STEP", 512)
    elif variant != "baseline":
        raise SystemExit(f"unknown variant '{variant}'")


def main() -> None:
    variants = sys.argv[1].split(",") if len(sys.argv) > 1 else [
        "baseline", "no_sync_off", "keeps_off", "no_cut_on_device", "rebind_inputs", "sync_after_run", "reserve_512"]
    seed = int(os.environ.get("SEED", "9"))
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: write_model(Path(tmp) / name, spec) for name, spec in FP16_MODELS.items()}
        for variant in variants:
            for name, fraction in CASES:
                patch = pytest.MonkeyPatch()
                try:
                    apply(patch, variant)
                    found = errors(folders[name], name, fraction, seed)
                    print(f"{variant:18s} {name:13s} {fraction!s:5s} max {max(found):.2e}  "
                          + " ".join(f"{e:.0e}" for e in found), flush=True)
                except Exception as exc:  # one variant's failure is a finding too: report it and go on
                    print(f"{variant:18s} {name:13s} {fraction!s:5s} raised {type(exc).__name__}: {exc}"[:400],
                          flush=True)
                finally:
                    patch.undo()


if __name__ == "__main__":
    main()
