"""Print the pyproject extra that installs the right onnxruntime build for this machine.

onnxruntime (CPU) and onnxruntime-gpu install the same Python module, so exactly one may be
installed. A machine with an NVIDIA driver gets the GPU build matching its CUDA generation
(driver 580 or newer runs CUDA 13, 525 or newer CUDA 12); every other machine, and one whose driver
is older than CUDA 12, gets the CPU build. MOE_WORKBENCH_RUNTIME (cpu, cuda12, cuda13) overrides
the choice. Standard library only: it runs before any install, with the Python make was given,
so it also refuses a Python the project does not support (make then stops before making .venv).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHOICES = ("cpu", "cuda12", "cuda13")
PROC_VERSION = Path("/proc/driver/nvidia/version")
CUDA13_DRIVER = 580  # the oldest driver each CUDA generation runs on (Linux)
CUDA12_DRIVER = 525
OLDEST_PYTHON = (3, 11)  # pyproject's requires-python
# onnxruntime-gpu for CUDA 12 is 1.23 (pyproject's cuda12 extra; later builds are for CUDA 13): no wheels past 3.13
CUDA12_NEWEST_PYTHON = (3, 13)
# and for x86-64 alone (platform.machine(): x86_64 on Linux, AMD64 on Windows); onnxruntime-gpu 1.31, the CUDA 13
# build, has aarch64 wheels too
CUDA12_MACHINES = ("x86_64", "AMD64")


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


def choose(driver_major: int | None, override: str | None = None,
           python: tuple[int, int] = sys.version_info[:2], machine: str = platform.machine()) -> str:
    """The extra for this machine; SystemExit with the reason where none can be installed."""
    version = ".".join(map(str, python))
    if python < OLDEST_PYTHON:
        raise SystemExit(f"moe-workbench needs Python {'.'.join(map(str, OLDEST_PYTHON))} or newer; this is "
                         f"{version} (make PYTHON=python3.12 …)")
    if override:
        if override not in CHOICES:
            raise SystemExit(f"MOE_WORKBENCH_RUNTIME must be one of {', '.join(CHOICES)}, got '{override}'")
        runtime = override
    elif driver_major is None or driver_major < CUDA12_DRIVER:
        runtime = "cpu"
    else:
        runtime = "cuda13" if driver_major >= CUDA13_DRIVER else "cuda12"
    if runtime == "cuda12" and python > CUDA12_NEWEST_PYTHON:
        raise SystemExit(f"onnxruntime-gpu for CUDA 12 has no wheels for Python {version}: use Python 3.11-3.13 "
                         f"(make PYTHON=python3.13 …), a driver {CUDA13_DRIVER} or newer (CUDA 13), "
                         "or MOE_WORKBENCH_RUNTIME=cpu")
    if runtime == "cuda12" and machine not in CUDA12_MACHINES:
        raise SystemExit(f"onnxruntime-gpu for CUDA 12 has no wheels for {machine}: use a driver {CUDA13_DRIVER} or "
                         "newer (CUDA 13), or MOE_WORKBENCH_RUNTIME=cpu")
    return runtime


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
