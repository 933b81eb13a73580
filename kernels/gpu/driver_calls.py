"""CUDA driver calls made straight through ctypes with little Python per call: host -> device copies
(cuMemcpyHtoDAsync_v2) and kernel launches prepared once (cuLaunchKernel). The hybrid decode's expert copies
(``GpuQMoE.upload_expert_device``) issue a few copies and one launch each; through CuPy that cost the host ~40-55 us
per expert (a pool allocation, runtime wrappers, the RawKernel call marshalling its arguments every time), issue 4.

A prepared launch builds its ``void*[]`` argument array once, pointing at ctypes values it keeps; a call rewrites the
few values that change (``PreparedLaunch.argument(i).value = ...``) and launches. libcuda is loaded as
``kernels.gpu.launch_pdl`` loads it (one per process); tests pass stand-ins with the C signatures instead.
"""
from __future__ import annotations

import ctypes
import functools

from .launch_pdl import CUDA_SUCCESS, _grid3, kernel_argument, libcuda

__all__ = ["DriverError", "DriverCalls", "PreparedLaunch", "MEMCPY_HTOD_ASYNC", "LAUNCH_KERNEL"]

# cuda.h: CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream)
MEMCPY_HTOD_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
# CUresult cuLaunchKernel(CUfunction f, unsigned grid x, y, z, unsigned block x, y, z, unsigned sharedMemBytes,
#                         CUstream stream, void** kernelParams, void** extra)
LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))


class DriverError(RuntimeError):
    """A driver call that returned an error: ``call`` (its name) and ``status`` (the CUresult)."""

    def __init__(self, call: str, status: int):
        super().__init__(f"{call} failed: CUresult {status}")
        self.call, self.status = call, status


class PreparedLaunch:
    """One kernel's launch configuration, stream and arguments, made once: ``launch()`` hands the driver the same
    argument array every time; set the values that change first through ``argument(i)``."""

    def __init__(self, launch_kernel, function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int):
        self._launch_kernel = launch_kernel
        # the ctypes values the argument array points at: kept here, rewritten in place
        self._values = [kernel_argument(a) for a in args]
        self.params = (ctypes.c_void_p * max(1, len(self._values)))(*[ctypes.addressof(v) for v in self._values])
        dims = [ctypes.c_uint(d) for d in (*_grid3(grid), *_grid3(block))]
        self._call = (ctypes.c_void_p(int(function_ptr)), *dims, ctypes.c_uint(int(shared_mem)),
                      ctypes.c_void_p(int(stream_ptr) or None), self.params, None)

    def argument(self, index: int):
        """The ctypes value of kernel parameter ``index``: set its ``.value`` before ``launch()``."""
        return self._values[index]

    def launch(self) -> None:
        status = self._launch_kernel(*self._call)
        if status != CUDA_SUCCESS:
            raise DriverError("cuLaunchKernel", status)


class DriverCalls:
    """The driver calls of an expert copy. ``memcpy_htod_async`` / ``launch_kernel``: libcuda's functions (or tests'
    stand-ins made with MEMCPY_HTOD_ASYNC / LAUNCH_KERNEL)."""

    def __init__(self, memcpy_htod_async, launch_kernel):
        self._memcpy = memcpy_htod_async
        self._launch_kernel = launch_kernel

    @classmethod
    @functools.cache
    def from_driver(cls) -> "DriverCalls | None":
        """Over libcuda's functions (one per process), or None where the driver or one of them is missing."""
        driver = libcuda()
        try:
            return cls(MEMCPY_HTOD_ASYNC(("cuMemcpyHtoDAsync_v2", driver)),
                       LAUNCH_KERNEL(("cuLaunchKernel", driver)))
        except (AttributeError, TypeError):  # no symbol; TypeError: no driver (None)
            return None

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream_ptr: int) -> None:
        """Copy ``nbytes`` from host address ``src`` to device address ``dst``, ordered on the stream (asynchronous to
        the host only from page-locked memory)."""
        status = self._memcpy(dst, src, nbytes, stream_ptr)
        if status != CUDA_SUCCESS:
            raise DriverError("cuMemcpyHtoDAsync_v2", status)

    def prepare(self, function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int) -> PreparedLaunch:
        """A launch of the CUfunction at ``function_ptr`` (a CuPy RawKernel's .kernel.ptr) on ``stream_ptr``."""
        return PreparedLaunch(self._launch_kernel, function_ptr, grid, block, args, shared_mem, stream_ptr)
