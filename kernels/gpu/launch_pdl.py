"""Kernel launches with programmatic dependent launch (PDL, sm_90+), through the driver's cuLaunchKernelEx.

A kernel launched this way may start while the kernel before it on the stream is still running, as soon as every
block of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited); it must execute
``griddepcontrol.wait`` before it reads anything the earlier kernel writes (decode5.cu / route.cu: QM_PDL_WAIT,
QM_PDL_LAUNCH). That hides the next kernel's launch and block dispatch behind the earlier one's tail: the GPU decode
chain decode_prep -> FC1 -> FC2 is three short dependent kernels (issue #3).

CuPy's RawKernel call has no launch attributes, so the launch goes through ctypes here. cuda-python's driver
bindings would do the same, but would add a dependency for this one call. Stream capture records the attribute as a
programmatic edge of the CUDA graph (CUDA 12.3+).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

# cuda.h (CUDA 12 / 13): CUlaunchAttributeID, CUresult
ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CUDA_SUCCESS = 0


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: a 64-byte union; PDL uses its leading int."""
    _fields_ = [("pad", ctypes.c_char * 64), ("as_int", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, the value."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.uint64): ctypes.c_uint64}


def kernel_argument(value):
    """The ctypes value a kernel parameter slot holds: a device array's address, a NumPy scalar as its C type, a copy
    of a ctypes scalar. Anything else is refused: a Python int has no width, and a wrong width shifts every later
    parameter."""
    if isinstance(value, np.generic):
        ctype = _SCALARS.get(value.dtype)
        if ctype is None:
            raise TypeError(f"kernel argument of dtype {value.dtype} is not supported")
        return ctype(value.item())
    if isinstance(value, ctypes._SimpleCData):  # already a C value (a device address as c_void_p): a copy of it
        return type(value)(value.value)
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):  # a CuPy ndarray
        return ctypes.c_void_p(int(data.ptr))
    raise TypeError(f"kernel argument {type(value).__name__} is neither a NumPy scalar nor a device array")


@functools.cache
def libcuda() -> "ctypes.CDLL | None":
    """The CUDA driver library (loaded once per process), or None where there is none."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _grid3(dims) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"grid / block dimensions {dims}: one to three positive sizes")
    return dims + (1,) * (3 - len(dims))


class PdlLauncher:
    """launch(): one kernel launch with programmatic stream serialization allowed.

    ``launch_ex`` is the driver's cuLaunchKernelEx (tests pass a stand-in with its C signature)."""

    def __init__(self, launch_ex):
        self._launch_ex = launch_ex
        self._attr = LaunchAttribute()
        self._attr.id = ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value.as_int = 1

    @classmethod
    @functools.cache
    def from_driver(cls) -> "PdlLauncher | None":
        """The launcher over libcuda's cuLaunchKernelEx (one per process), or None where the driver has none (before
        CUDA 12)."""
        try:
            launch_ex = libcuda().cuLaunchKernelEx
        except AttributeError:  # no driver (None), or one without the call
            return None
        launch_ex.restype = ctypes.c_int
        launch_ex.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(ctypes.c_void_p)]
        return cls(launch_ex)

    def launch(self, function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int) -> None:
        """Launch the CUfunction at ``function_ptr`` (a CuPy RawKernel's .kernel.ptr) on ``stream_ptr``; raises
        RuntimeError naming the CUresult when the driver refuses."""
        config = LaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = _grid3(grid)
        config.blockDimX, config.blockDimY, config.blockDimZ = _grid3(block)
        config.sharedMemBytes = int(shared_mem)
        config.hStream = int(stream_ptr) or None
        config.attrs = ctypes.pointer(self._attr)
        config.numAttrs = 1
        values = [kernel_argument(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        status = self._launch_ex(ctypes.byref(config), ctypes.c_void_p(int(function_ptr)), params, None)
        if status != CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx with programmatic dependent launch failed: CUresult {status}")
