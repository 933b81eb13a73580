"""kernels/gpu/launch_pdl.py without a GPU: the ctypes structures against cuda.h's layout, the kernel arguments'
C types, and what a launch hands the driver (a stand-in with cuLaunchKernelEx's C signature records it)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kernels.gpu.launch_pdl import (ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttribute, LaunchConfig,
                                    PdlLauncher, kernel_argument)


def test_structures_have_cuda_h_layout():
    # CUlaunchAttribute: int id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: seven unsigned ints, then the
    # 8-byte aligned stream and attribute pointers and the attribute count
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)
    assert ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


class FakeDeviceArray:
    """What kernel_argument reads of a CuPy ndarray: .data.ptr."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, ptr):
        self.data = self._Data(ptr)


def test_kernel_arguments_take_their_c_types():
    assert isinstance(kernel_argument(np.int32(-7)), ctypes.c_int32) and kernel_argument(np.int32(-7)).value == -7
    assert kernel_argument(np.int64(1 << 40)).value == 1 << 40
    assert kernel_argument(np.float32(1.5)).value == 1.5 and isinstance(kernel_argument(np.float32(0)), ctypes.c_float)
    assert kernel_argument(FakeDeviceArray(0x7F0012345600)).value == 0x7F0012345600
    with pytest.raises(TypeError, match="neither a NumPy scalar nor a device array"):
        kernel_argument(3)  # a Python int: no width
    with pytest.raises(TypeError, match="dtype float64 is not supported"):
        kernel_argument(np.float64(1.0))


LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))


def _recording_driver(status=0):
    seen = {}

    def launch_ex(config, function, params, extra):
        c = config.contents
        attr = c.attrs[0]
        seen.update(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=(c.blockDimX, c.blockDimY, c.blockDimZ),
                    smem=c.sharedMemBytes, stream=c.hStream, num_attrs=c.numAttrs, attr=(attr.id, attr.value.as_int),
                    function=function, extra=bool(extra),
                    args=(ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p))[0],
                          ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0],
                          ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int64))[0],
                          ctypes.cast(params[3], ctypes.POINTER(ctypes.c_float))[0]))
        return status

    return LAUNCH_EX(launch_ex), seen


def test_a_launch_hands_the_driver_the_config_attribute_and_arguments():
    fn, seen = _recording_driver()
    PdlLauncher(fn).launch(0xABC0, (528,), (128,), (FakeDeviceArray(0x1000), np.int32(-3), np.int64(5 << 33),
                                                    np.float32(0.25)), 70_000, 0x5150)
    assert seen == {"grid": (528, 1, 1), "block": (128, 1, 1), "smem": 70_000, "stream": 0x5150, "num_attrs": 1,
                    "attr": (6, 1), "function": 0xABC0, "extra": False, "args": (0x1000, -3, 5 << 33, 0.25)}


def test_the_default_stream_and_a_2d_grid():
    fn, seen = _recording_driver()
    PdlLauncher(fn).launch(1, (3, 7), (256,), (FakeDeviceArray(8), np.int32(1), np.int64(2), np.float32(3)), 0, 0)
    assert seen["grid"] == (3, 7, 1) and seen["stream"] is None


def test_a_refused_launch_names_the_cuda_result():
    fn, _ = _recording_driver(status=1)
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx .* failed: CUresult 1"):
        PdlLauncher(fn).launch(1, (1,), (32,), (FakeDeviceArray(8), np.int32(1), np.int64(2), np.float32(3)), 0, 0)
    with pytest.raises(ValueError, match="one to three positive sizes"):
        PdlLauncher(fn).launch(1, (0,), (32,), (), 0, 0)


def test_the_driver_launcher_is_made_once_per_process():
    assert PdlLauncher.from_driver() is PdlLauncher.from_driver()  # None on a machine without libcuda
