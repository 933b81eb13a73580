"""Where a conversation's state buffers live: host memory (NumPy) or a CUDA device (CuPy).

DecoderState allocates, grows, resets and swaps its KV caches and conv/recurrent state through one
of these, and run_bound hands onnxruntime a raw pointer (`binding.bind_input(name, device_type,
device_id, element_type, shape, pointer)`), the same code for both: the CPU tests exercise the
binding the GPU uses. CuPy is imported only when a CUDA backend is made.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import numpy as np


class ArrayBackend:
    """The operations DecoderState needs. `xp` is the array module (numpy, cupy or a stand-in)."""

    name = "numpy"
    device_type = "cpu"  # as onnxruntime's OrtDevice names it
    device_arrays = False  # arrays of `xp` live in device memory (dense outputs may stay there: DeviceOutputs)

    def __init__(self, xp=np, device_id: int = 0):
        self.xp = xp
        self.device_id = device_id

    def _scope(self):
        return nullcontext()

    def zeros(self, shape: tuple[int, ...], dtype) -> "np.ndarray":
        with self._scope():
            return self.xp.zeros(shape, dtype)

    def copy_prefix(self, dst, src, kept: int) -> None:
        """dst[:, :, :kept] = src[:, :, :kept]: a KV buffer's filled positions kept when it grows."""
        if kept:
            with self._scope():
                dst[:, :, :kept] = src[:, :, :kept]

    def to_host(self, array) -> np.ndarray:
        """A copy of `array` in host memory (a state snapshot: no device memory beside the budgets)."""
        return np.array(self.to_numpy(array), copy=True)

    def load(self, dst, host: np.ndarray) -> None:
        """dst[..., :n, :] (n: host's length on the token axis, the whole of dst for a state of fixed shape) = host."""
        with self._scope():
            if host.shape == dst.shape:
                dst[...] = self.xp.asarray(host)
            else:
                dst[:, :, :host.shape[2]] = self.xp.asarray(host)

    def fill_zero(self, array) -> None:
        with self._scope():
            array.fill(0)

    @staticmethod
    def swap(a, b):
        """A swapped state's buffers trade roles (present becomes past): no copy."""
        return b, a

    def pointer(self, array) -> int:
        if not array.flags.c_contiguous:
            raise ValueError("state buffers bound by pointer must be C-contiguous")
        return int(array.ctypes.data)

    def to_numpy(self, array) -> np.ndarray:
        return np.asarray(array)

    def synchronize(self) -> None:
        """Wait for the backend's queued work (nothing is queued on the host)."""


class NumpyBackend(ArrayBackend):
    pass


class CupyBackend(ArrayBackend):
    """State buffers in one CUDA device's memory (CuPy's memory pool, under the limit CudaDevice set).

    Every buffer operation runs on `stream`, a non-blocking stream of our own that is also handed to
    onnxruntime's CUDA EP as its `user_compute_stream` (DenseDevice): buffer zeroing, the prefix copy
    when a KV buffer grows and onnxruntime's kernels that read and write those buffers then sit on
    one stream, in issue order, with no event or host synchronisation between them. CuPy's default
    is the legacy null stream, and onnxruntime otherwise makes its own non-blocking stream, which
    does not wait for the null stream: a zeroed or grown buffer could be read before it is written.
    A stream of our own, rather than whichever is current when the model loads, cannot be the null
    stream (pointer 0) by accident, and stays the same for every session and every step.
    """

    name = "cupy"
    device_type = "cuda"
    device_arrays = True

    def __init__(self, cp, device_id: int = 0, stream=None):
        super().__init__(cp, device_id)
        with cp.cuda.Device(device_id):
            self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
            self._mark = cp.cuda.Event(disable_timing=True)  # mark()'s, recorded again at each call
        self._pinned: dict[tuple, np.ndarray] = {}  # copy_out's page-locked buffers, by shape and dtype

    def _scope(self):
        scope = ExitStack()
        scope.enter_context(self.xp.cuda.Device(self.device_id))
        scope.enter_context(self.stream)
        return scope

    @property
    def stream_pointer(self) -> int:
        return int(self.stream.ptr)

    def pointer(self, array) -> int:
        if not array.flags.c_contiguous:
            raise ValueError("state buffers bound by pointer must be C-contiguous")
        return int(array.data.ptr)

    def to_numpy(self, array) -> np.ndarray:
        with self._scope():
            host = array.get(stream=self.stream)
        self.stream.synchronize()
        return host

    def synchronize(self) -> None:
        self.stream.synchronize()

    def copy_out(self, array) -> np.ndarray:
        """A host copy of `array` (a decode step's logits), through a page-locked buffer kept for its shape: one DMA
        into it, where a copy into pageable memory goes through the driver's staging buffers. (The wait for Qwen's
        logits after the step's end was ~150 µs on the H100 machine either way, sixty-second session: not yet
        understood.)"""
        key = (array.shape, array.dtype.str)
        pinned = self._pinned.get(key)
        if pinned is None:
            memory = self.xp.cuda.alloc_pinned_memory(max(array.nbytes, 1))  # (as cupyx.empty_pinned makes one)
            pinned = self._pinned[key] = np.ndarray(array.shape, array.dtype, buffer=memory)
        with self._scope():
            array.get(stream=self.stream, out=pinned)
        self.stream.synchronize()  # (CuPy before 13 returns at once from a copy into page-locked memory)
        return pinned.copy()

    def mark(self):
        """An event after the work queued on the stream so far, whose synchronize() waits for that work only: one
        event, recorded again at every call (none made per step)."""
        with self._scope():
            return self.stream.record(self._mark)


NUMPY = NumpyBackend()


def cupy_backend(device_id: int = 0) -> CupyBackend:
    """A CUDA backend on `device_id`; imports CuPy (only the CUDA path gets here)."""
    import cupy

    return CupyBackend(cupy, device_id)
