"""A decode step's kept pinned / device buffers (engine/offload/cuda_step.py) on a stand-in for CuPy whose
"device" memory is host memory and whose asynchronous copies are memmove: the layout of the one copy in, the
copy back, and the pool's reuse. The CUDA side runs in tests/test_offload_cuda.py (marker gpu)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np

from engine.offload.cuda_step import D2H, H2D, StepBufferPool, StepBuffers


class FakeDeviceArray(np.ndarray):
    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


class FakeCupy:
    float32, int32, uint8 = np.float32, np.int32, np.uint8
    copies: list = []

    class cuda:
        @staticmethod
        def alloc_pinned_memory(nbytes):
            return bytearray(nbytes)

        class runtime:
            @staticmethod
            def memcpyAsync(dst, src, size, kind, stream):
                FakeCupy.copies.append((kind, size, stream))
                ctypes.memmove(dst, src, size)

    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype).view(FakeDeviceArray)


class Stream:
    ptr = 77
    synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_one_copy_carries_activations_ids_and_weights():
    FakeCupy.copies.clear()
    rng = np.random.default_rng(0)
    buffers = StepBuffers(FakeCupy, tokens=2, hidden=100, k=3)
    x = rng.standard_normal((2, 100)).astype(np.float16)  # fp16 activations go over as float32
    ids = np.array([[5, -1, 7], [0, 2, 127]], np.int64)
    weights = rng.random((2, 3)).astype(np.float32)
    buffers.upload(x, ids, weights, Stream())
    assert FakeCupy.copies == [(H2D, buffers.nbytes, Stream.ptr)]
    assert np.array_equal(np.asarray(buffers.x), x.astype(np.float32)) and buffers.x.dtype == np.float32
    assert np.array_equal(np.asarray(buffers.ids), ids) and buffers.ids.dtype == np.int32
    assert np.array_equal(np.asarray(buffers.w), weights)
    for view in (buffers.x, buffers.ids, buffers.w):  # views of the one device buffer, aligned
        assert np.shares_memory(view, buffers.device) and (view.ctypes.data - buffers.device.ctypes.data) % 256 == 0


def test_the_output_comes_back_through_pinned_memory():
    FakeCupy.copies.clear()
    buffers = StepBuffers(FakeCupy, tokens=1, hidden=64, k=2)
    buffers.out[:] = np.arange(64, dtype=np.float32)
    stream = Stream()
    result = buffers.download(stream)
    assert result.shape == (1, 64) and np.array_equal(result[0], np.arange(64, dtype=np.float32))
    assert not np.shares_memory(result, buffers.out)
    assert FakeCupy.copies == [(D2H, 64 * 4, Stream.ptr)] and stream.synchronized == 1


def test_the_pool_reuses_buffers_once_given_back():
    pool = StepBufferPool(FakeCupy, hidden=32)
    first = pool.take(1, 8)
    second = pool.take(1, 8)  # two launches in flight in one step: two sets
    assert first is not second
    pool.give_back(first)
    assert pool.take(1, 8) is first and pool.take(2, 8) is not second
