"""What every benchmark shares: the machine's description and one JSON result file per run.

Result schema: {"benchmark", "date", "machine": {"cpu", "cores", "gpu"}, "command",
"figures": [{"name", "value", "unit", "reference", "reference_value", "ratio"}], ...}.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path


import numpy as np

from engine.records.environment import cpu_model, gpus

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the run's date, read once as it starts (a benchmark imports this module then): a benchmark that writes its result
# file after every point wrote a run that crossed midnight into two files, each read at its write
RUN_DATE = datetime.date.today().isoformat()


def gpu_name() -> str | None:
    found = gpus()
    return found[0]["name"] if found else None


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores, "gpu": gpu_name()}


def machine_tag(info: dict) -> str:
    """A short file-name tag, e.g. 'intel-xeon-16c-h200' or 'amd-epyc-2c'."""
    cpu = re.sub(r"\(r\)|\(tm\)|processor|cpu|@.*", "", info["cpu"].lower())
    cpu = "-".join(re.findall(r"[a-z0-9]+", cpu)[:2]) or "cpu"
    tag = f"{cpu}-{info['cores']}c"
    if info.get("gpu"):
        tag += "-" + re.findall(r"[a-z0-9]+", info["gpu"].lower().replace("nvidia", ""))[0]
    return tag


def model_folder(given: str | None, prefix: str) -> Path:
    """Where a benchmark writes its model: `given` (kept, and reused by later runs), or a temporary folder removed
    when the benchmark exits (a full-size model is gigabytes: none is left behind in /tmp)."""
    if given:
        return Path(given)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def written_model(folder: Path, spec) -> Path:
    """The model `spec` (a WriterSpec) describes, in `folder`: written there once and reused by later runs. Each spec
    has a folder of its own (named by a digest of it), so a run asking for fewer layers or another dtype never reuses
    a model written for another."""
    from engine.writer import write_model

    path = folder / f"model-{hashlib.sha1(repr(spec).encode()).hexdigest()[:12]}"
    if not (path / "genai_config.json").is_file():
        write_model(path, spec)
    return path


def write_result(benchmark: str, figures: list[dict], **extra) -> Path:
    info = machine()
    result = {"benchmark": benchmark, "date": RUN_DATE, "machine": info,
              "command": " ".join(["python", *sys.argv]), **extra, "figures": figures}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{benchmark}-{RUN_DATE}-{machine_tag(info)}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def stream_read_bandwidth(gbytes: float = 2.0, repeats: int = 5) -> float:
    """Streaming read bandwidth in GB/s: the engine's own measurement (a Numba parallel sum over a float32
    array, all threads, best of n) over a larger array than the engine uses when a device opens."""
    from engine.offload.host_bandwidth import stream_read_bandwidth as measure

    return measure(int(gbytes * 1e9), repeats) / 1e9


def median_seconds(fn, runs: int, warmup: int = 0) -> float:
    """The median wall seconds of `runs` calls of fn(), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))
