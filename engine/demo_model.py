"""The embedded demo model: a small random-weight MoE written into the user's cache on first use."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import platformdirs

from engine.writer import WriterSpec, write_model

DEMO_NAME = "demo-moe-v1"
DEMO_SPEC = WriterSpec(
    layers=4, hidden_size=256, num_experts=16, top_k=4, inter_size=256, num_heads=8, num_kv_heads=2,
    head_size=32, vocab_size=1024, context_length=4096, sliding_window=128, bits=4, block_size=32,
    seed=2026, description="MoE Workbench demo model: RANDOM weights, the text it writes is meaningless.")


def demo_model_path(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir else Path(platformdirs.user_cache_dir("moe-workbench"))
    return root / DEMO_NAME


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Write the demo model unless a complete copy is already there; returns its folder."""
    target = demo_model_path(cache_dir)
    if (target / "genai_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted write never leaves a half model.
    staging = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=target.parent))
    try:
        write_model(staging, DEMO_SPEC)
        staging.rename(target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        # another process (a second window started at once) renamed its complete copy there first
        if not (isinstance(exc, OSError) and (target / "genai_config.json").is_file()):
            raise
    return target
