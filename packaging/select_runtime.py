"""Print the pyproject extra that installs the right onnxruntime build for this machine.

onnxruntime (CPU) and onnxruntime-gpu install the same Python module, so exactly one may be
installed. A machine with an NVIDIA driver gets the GPU build matching its CUDA generation
(driver 580 or newer runs CUDA 13, 525 or newer CUDA 12); every other machine, and one whose driver
is older than CUDA 12, gets the CPU build. MOE_WORKBENCH_RUNTIME (cpu, cuda12, cuda13) overrides
the choice. Standard library only: it runs before any install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHOICES = ("cpu", "cuda12", "cuda13")
PROC_VERSION = Path("/proc/driver/nvidia/version")
CUDA13_DRIVER = 580  # the oldest driver each CUDA generation runs on (Linux)
CUDA12_DRIVER = 525


def driver_major_in_proc(text: str) -> int | None:
    """The major version in /proc/driver/nvidia/version's text (proprietary or open kernel module)."""
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+)\.", text)
    return int(match.group(1)) if match else None


def driver_major_in_smi(out: str) -> int | None:
    """The major version in `nvidia-smi --query-gpu=driver_version` output (a line per GPU)."""
    match = re.match(r"\s*(\d+)\.", out)
    return int(match.group(1)) if match else None


def nvidia_driver_version() -> int | None:
    """The driver's major version, or None when no NVIDIA driver is loaded."""
    if PROC_VERSION.is_file():
        major = driver_major_in_proc(PROC_VERSION.read_text(errors="replace"))
        if major is not None:
            return major
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        return driver_major_in_smi(out)
    return None


def choose(driver_major: int | None, override: str | None = None) -> str:
    if override:
        if override not in CHOICES:
            raise SystemExit(f"MOE_WORKBENCH_RUNTIME must be one of {', '.join(CHOICES)}, got '{override}'")
        return override
    if driver_major is None or driver_major < CUDA12_DRIVER:
        return "cpu"
    return "cuda13" if driver_major >= CUDA13_DRIVER else "cuda12"


def too_old_note(driver_major: int | None, runtime: str) -> str | None:
    """What to tell the user whose NVIDIA driver gets the CPU build, or None."""
    if driver_major is None or runtime != "cpu" or driver_major >= CUDA12_DRIVER:
        return None
    return (f"NVIDIA driver {driver_major} is older than CUDA 12 needs ({CUDA12_DRIVER}): installing the CPU build "
            "of onnxruntime (a newer driver gets the GPU build)")


if __name__ == "__main__":
    driver = nvidia_driver_version()
    chosen = choose(driver, os.environ.get("MOE_WORKBENCH_RUNTIME"))
    note = too_old_note(driver, chosen)
    if note:
        print(note, file=sys.stderr)
    print(chosen)
    sys.exit(0)
