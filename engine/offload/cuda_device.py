"""The CUDA device: resident experts in GPU slots, computed by the CuPy kernels."""

from __future__ import annotations

from engine.errors import WorkbenchError


class NoCudaDevice(WorkbenchError):
    """No usable NVIDIA GPU: CuPy missing, no driver, or no device."""


def open_cuda_device(mem_limit: int = 0, index: int = 0):
    try:
        import cupy
    except ImportError:
        raise NoCudaDevice("--device cuda needs CuPy (install with `make install` on a machine with an NVIDIA driver)") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorNoDevice, driver missing or too old
        raise NoCudaDevice(f"no CUDA device: {str(exc).splitlines()[0]}") from None
    if count <= index:
        raise NoCudaDevice(f"no CUDA device {index}: {count} found")
    raise NoCudaDevice("CUDA expert execution is not available in this build yet; use --device simulated")
