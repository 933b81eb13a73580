"""Print the pyproject extra that installs the right onnxruntime build for this machine.

onnxruntime (CPU) and onnxruntime-gpu install the same Python module, so exactly one may be
installed. A machine with an NVIDIA driver gets the GPU build matching its CUDA generation
(driver 580 or newer runs CUDA 13); every other machine gets the CPU build. MOE_WORKBENCH_RUNTIME
(cpu, cuda12, cuda13) overrides the choice. Standard library only: it runs before any install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHOICES = ("cpu", "cuda12", "cuda13")


def nvidia_driver_version() -> int | None:
    """The driver's major version, or None when no NVIDIA driver is loaded."""
    proc_file = Path("/proc/driver/nvidia/version")
    if proc_file.is_file():
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+)\.", proc_file.read_text(errors="replace"))
        if match:
            return int(match.group(1))
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        match = re.match(r"\s*(\d+)\.", out)
        if match:
            return int(match.group(1))
    return None


def choose(driver_major: int | None, override: str | None = None) -> str:
    if override:
        if override not in CHOICES:
            raise SystemExit(f"MOE_WORKBENCH_RUNTIME must be one of {', '.join(CHOICES)}, got '{override}'")
        return override
    if driver_major is None:
        return "cpu"
    return "cuda13" if driver_major >= 580 else "cuda12"


if __name__ == "__main__":
    print(choose(nvidia_driver_version(), os.environ.get("MOE_WORKBENCH_RUNTIME")))
    sys.exit(0)
