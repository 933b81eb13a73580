"""Versions and machine facts for a run record."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import psutil

from engine import nvml
from engine.errors import one_line


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def onnxruntime_build() -> dict:
    """The onnxruntime imported: its version, build (the distribution installed beside the module, not one elsewhere
    on the path that it shadows) and execution providers."""
    import onnxruntime

    from engine.ort_env import installed_onnxruntime_builds

    builds = installed_onnxruntime_builds()  # "name version"; a load refuses more than one
    return {"version": onnxruntime.__version__, "build": builds[0].split()[0] if builds else "unknown",
            "providers": onnxruntime.get_available_providers()}


def cuda_versions() -> dict:
    """CuPy and the CUDA runtime/driver, where present (never fails)."""
    try:
        import cupy

        runtime = cupy.cuda.runtime
        return {"cupy": cupy.__version__, "cuda_runtime": runtime.runtimeGetVersion(),
                "cuda_driver": runtime.driverGetVersion()}
    except Exception:
        return {"cupy": None, "cuda_runtime": None, "cuda_driver": None}


def cuda_version_text(number: int | None) -> str | None:
    """A CUDA version as CUDA gives it (12080) in its usual words ("12.8"); None where there is none (0: no driver)."""
    return f"{number // 1000}.{number % 1000 // 10}" if isinstance(number, int) and number > 0 else None


def gpus() -> list[dict]:
    if nvml.init():
        return []
    pynvml = nvml.pynvml
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                found.append({"name": name.decode() if isinstance(name, bytes) else name,
                              "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                              "driver": pynvml.nvmlSystemGetDriverVersion()})
            except Exception as exc:  # a GPU reset or lost: the run's record is kept all the same
                found.append({"error": f"GPU {index}: NVML cannot read it ({one_line(exc)})"})
        return found
    finally:
        pynvml.nvmlShutdown()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    return {"app": _version("moe-workbench") or "source", "python": sys.version.split()[0],
            "onnxruntime": onnxruntime_build(), "numpy": _version("numpy"), "numba": _version("numba"),
            **cuda_versions()}


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "gpus": gpus(), "os": platform.platform()}
