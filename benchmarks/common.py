"""What every benchmark shares: the machine's description and one JSON result file per run.

Result schema: {"benchmark", "date", "machine": {"cpu", "cores", "gpu"}, "command",
"figures": [{"name", "value", "unit", "reference", "reference_value", "ratio"}], ...}.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return None
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else name
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cores": cores, "gpu": gpu_name()}


def machine_tag(info: dict) -> str:
    """A short file-name tag, e.g. 'intel-xeon-16c-h200' or 'amd-epyc-2c'."""
    cpu = re.sub(r"\(r\)|\(tm\)|processor|cpu|@.*", "", info["cpu"].lower())
    cpu = "-".join(re.findall(r"[a-z0-9]+", cpu)[:2]) or "cpu"
    tag = f"{cpu}-{info['cores']}c"
    if info.get("gpu"):
        tag += "-" + re.findall(r"[a-z0-9]+", info["gpu"].lower().replace("nvidia", ""))[0]
    return tag


def write_result(benchmark: str, figures: list[dict], **extra) -> Path:
    info = machine()
    date = datetime.date.today().isoformat()
    result = {"benchmark": benchmark, "date": date, "machine": info,
              "command": " ".join(["python", *sys.argv]), **extra, "figures": figures}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{benchmark}-{date}-{machine_tag(info)}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
