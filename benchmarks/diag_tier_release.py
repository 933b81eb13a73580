"""Does a re-plan give the host tier's page-locked memory back? (issue #4; CUDA only)

A Qwen3-30B-A3B-like model of a few layers, the dense part wherever it lands, decode path "tier": after each
re-plan at a resident fraction and a few decode steps, the host memory available, the TieredRows objects alive
(each node's tier is one) and the page-locked bytes they hold. A tier kept alive after its re-plan shows as more
TieredRows than nodes and as available memory falling by a tier's size at each re-plan.

    python benchmarks/diag_tier_release.py [--layers 8] [--folder DIR]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import shape_spec  # noqa: E402
from benchmarks.common import model_folder  # noqa: E402
from engine.generation import LoadedModel  # noqa: E402
from engine.offload import OffloadConfig  # noqa: E402
from engine.offload.cuda_device import open_cuda_device  # noqa: E402
from engine.offload.planner import all_resident_bytes  # noqa: E402
from engine.writer import write_model  # noqa: E402
from kernels.gpu.host_tier import TieredRows  # noqa: E402


def live_tiers() -> tuple[int, int]:
    """(TieredRows alive, the host bytes they map)."""
    tiers = [obj for obj in gc.get_objects() if isinstance(obj, TieredRows)]
    return len(tiers), sum(tier.host_bytes for tier in tiers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--folder")
    args = parser.parse_args()
    where = model_folder(args.folder, "diag-tier-")
    if not (where / "model" / "genai_config.json").is_file():
        write_model(where / "model", shape_spec("qwen3-30b-a3b-like", args.layers, "float16"))
    model = LoadedModel.open(where / "model", offload=OffloadConfig(device_expert_bytes=0), device=open_cuda_device(),
                             decode_path="tier")
    engine = model.offload
    total = all_resident_bytes(model.folder.experts)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 400, 8)]
    print(f"{len(engine.stores)} nodes, dense part on the {model.dense_device}", flush=True)
    for fraction in (0.25, 0.5, 0.0, 0.5, 1.0, 0.25):
        engine.reconfigure(engine.config.updated(device_expert_bytes=int(fraction * total)))
        state = model.new_state()
        logits = model.decoder.forward(state, prompt)
        for _ in range(4):
            logits = model.decoder.forward(state, [int(logits[-1].argmax())])
        count, held = live_tiers()
        print(f"{fraction:4.0%}: tier {engine.host_tier}, {count} TieredRows alive mapping {held / 1e9:.2f} GB "
              f"(the engine's tier: {engine.pinned_info().get('host_tier_bytes', 0) / 1e9:.2f} GB), host memory "
              f"available {psutil.virtual_memory().available / 1e9:.1f} GB", flush=True)


if __name__ == "__main__":
    main()
