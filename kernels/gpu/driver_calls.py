"""CUDA driver calls made straight through ctypes with little Python per call: host -> device copies
(cuMemcpyHtoDAsync_v2, or a batch of them in one cuMemcpyBatchAsync) and kernel launches prepared once
(cuLaunchKernel). The hybrid decode's expert copies (``GpuQMoE.upload_expert_device``) issue a few copies and one
launch each; through CuPy that cost the host ~40-55 us per expert (a pool allocation, runtime wrappers, the RawKernel
call marshalling its arguments every time), issue 4; through single memcpys the driver's own ~4-5 us per copy.

A prepared launch builds its ``void*[]`` argument array once, pointing at ctypes values it keeps; a call rewrites the
few values that change (``PreparedLaunch.argument(i).value = ...``) and launches. A prepared batch likewise keeps its
destination, source and size arrays and its attribute; a call rewrites the sources (``PreparedBatch.sources[i]``).
libcuda is loaded as ``kernels.gpu.launch_pdl`` loads it (one per process); tests pass stand-ins with the C
signatures instead.
"""
from __future__ import annotations

import ctypes
import functools

from .launch_pdl import CUDA_SUCCESS, _grid3, kernel_argument, libcuda

__all__ = ["DriverError", "BatchCopyError", "DriverCalls", "PreparedLaunch", "PreparedBatch", "MemLocation",
           "MemcpyAttributes", "MEMCPY_HTOD_ASYNC", "MEMCPY_BATCH_ASYNC_V2", "MEMCPY_BATCH_ASYNC", "LAUNCH_KERNEL",
           "EVENT_RECORD_WITH_FLAGS", "SRC_ACCESS_ORDER_ANY"]

# cuda.h: CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream)
MEMCPY_HTOD_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class MemLocation(ctypes.Structure):
    """CUmemLocation: a CUmemLocationType and an id."""
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (24 bytes): the location hints count only for managed memory; zero (invalid) here."""
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


# CU_MEMCPY_SRC_ACCESS_ORDER_ANY: the driver may read the sources out of stream order, also after the call returns.
# The sources are expert weights (the file mapping, host copies of it) that nothing writes while a copy is in flight,
# so this is safe, and it is what makes a batch cheap: with ..._STREAM (1) the H200's driver (580) took 219 / 55 us
# of host time for one expert's 6 copies at shapes A / B (it copies sources it did not allocate on the host first),
# against 20 / 11 us with this order and 36 / 20 us for 6 single memcpys (RESULTS.md, fifteenth session).
SRC_ACCESS_ORDER_ANY = 3
# CUDA 13: CUresult cuMemcpyBatchAsync_v2(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
#                                         CUmemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs, CUstream)
# The pointers as void*: ctypes passes a c_void_p made once in half the time it takes to check an array against a
# typed pointer (~0.55 against ~1.2 us a call).
_BATCH_ARGS = (*(ctypes.c_void_p,) * 3, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
MEMCPY_BATCH_ASYNC_V2 = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS, ctypes.c_void_p)
# CUDA 12.8 / 12.9 (the symbol cuMemcpyBatchAsync): the same with size_t* failIdx before the stream
MEMCPY_BATCH_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS, ctypes.c_void_p, ctypes.c_void_p)
# CUresult cuLaunchKernel(CUfunction f, unsigned grid x, y, z, unsigned block x, y, z, unsigned sharedMemBytes,
#                         CUstream stream, void** kernelParams, void** extra)
LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))
# CUresult cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned int flags) (CUDA 11.1)
EVENT_RECORD_WITH_FLAGS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
# CU_EVENT_RECORD_EXTERNAL: recorded on a stream being captured, the event becomes an event record node of the graph
# (recorded at every replay); a plain record there only orders the capture's streams and is never recorded itself
EVENT_RECORD_EXTERNAL = 1


class DriverError(RuntimeError):
    """A driver call that returned an error: ``call`` (its name) and ``status`` (the CUresult)."""

    def __init__(self, call: str, status: int):
        super().__init__(f"{call} failed: CUresult {status}")
        self.call, self.status = call, status


class BatchCopyError(DriverError):
    """A batch memcpy the driver refused, or has not (before CUDA 12.8): the copies can go one by one instead."""


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


class PreparedBatch:
    """Host -> device copies to destinations and of sizes made once, on one stream, issued in one cuMemcpyBatchAsync
    call: the arrays and the one attribute entry (sources read in any order: SRC_ACCESS_ORDER_ANY) are kept; set
    ``sources[i]`` (host addresses) before ``copy()``. ``name``: the driver symbol, as errors name it."""

    def __init__(self, batch_async, name: str, dsts, sizes, stream_ptr: int, fail_index: bool):
        count = len(dsts)
        if count == 0 or len(sizes) != count:
            raise ValueError(f"a batch of {count} destinations and {len(sizes)} sizes")
        if not int(stream_ptr):  # the driver refuses the legacy NULL stream for batches
            raise ValueError("a batch memcpy on the legacy NULL stream")
        self._batch_async, self.name = batch_async, name
        self.destinations = (ctypes.c_uint64 * count)(*dsts)
        self.sources = (ctypes.c_uint64 * count)()
        self.sizes = (ctypes.c_size_t * count)(*sizes)
        self.attributes = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_ANY)
        self.attribute_starts = (ctypes.c_size_t * 1)(0)  # the one entry applies from copy 0 on
        self.fail_index = ctypes.c_size_t(0)  # CUDA 12.8's out-parameter: the copy that failed
        self._call = (_address(self.destinations), _address(self.sources), _address(self.sizes),
                      ctypes.c_size_t(count), _address(self.attributes), _address(self.attribute_starts),
                      ctypes.c_size_t(1), *((_address(self.fail_index),) if fail_index else ()),
                      ctypes.c_void_p(int(stream_ptr)))

    def copy(self) -> None:
        status = self._batch_async(*self._call)
        if status != CUDA_SUCCESS:
            raise BatchCopyError(self.name, status)


class DriverCalls:
    """The driver calls of an expert copy. ``memcpy_htod_async`` / ``launch_kernel``: libcuda's functions (or tests'
    stand-ins made with MEMCPY_HTOD_ASYNC / LAUNCH_KERNEL); ``memcpy_batch_async_v2`` (CUDA 13's ABI) or else
    ``memcpy_batch_async`` (CUDA 12.8's, with failIdx): the batch memcpy, None where the driver has neither."""

    def __init__(self, memcpy_htod_async, launch_kernel, memcpy_batch_async_v2=None, memcpy_batch_async=None,
                 event_record_with_flags=None):
        self._memcpy = memcpy_htod_async
        self._launch_kernel = launch_kernel
        self._event_record = event_record_with_flags
        if memcpy_batch_async_v2 is not None:
            self._batch = (memcpy_batch_async_v2, "cuMemcpyBatchAsync_v2", False)
        elif memcpy_batch_async is not None:
            self._batch = (memcpy_batch_async, "cuMemcpyBatchAsync", True)
        else:
            self._batch = None

    @classmethod
    @functools.cache
    def from_driver(cls) -> "DriverCalls | None":
        """Over libcuda's functions (one per process), or None where the driver or one of them is missing."""
        return cls.over(libcuda())

    @classmethod
    def over(cls, driver) -> "DriverCalls | None":
        """Over the functions of `driver` (libcuda, or a stand-in with its symbols as attributes; None: no driver), or
        None where the memcpy or the launch is missing; a driver before CUDA 12.8 has no batch memcpy: calls without."""
        memcpy = _symbol(MEMCPY_HTOD_ASYNC, "cuMemcpyHtoDAsync_v2", driver)
        launch = _symbol(LAUNCH_KERNEL, "cuLaunchKernel", driver)
        if memcpy is None or launch is None:
            return None
        return cls(memcpy, launch, _symbol(MEMCPY_BATCH_ASYNC_V2, "cuMemcpyBatchAsync_v2", driver),
                   _symbol(MEMCPY_BATCH_ASYNC, "cuMemcpyBatchAsync", driver),
                   _symbol(EVENT_RECORD_WITH_FLAGS, "cuEventRecordWithFlags", driver))

    @property
    def records_in_graphs(self) -> bool:
        """Whether record_external can be had (the driver has cuEventRecordWithFlags)."""
        return self._event_record is not None

    def record_external(self, event_ptr: int, stream_ptr: int) -> None:
        """Record the event on the stream, which is being captured, as a node of the graph (recorded at each replay:
        CU_EVENT_RECORD_EXTERNAL). Outside a capture the H200's driver (580) refuses the flag (CUresult 401)."""
        if self._event_record is None:
            raise DriverError("loading libcuda's cuEventRecordWithFlags", -1)
        status = self._event_record(event_ptr, stream_ptr or None, EVENT_RECORD_EXTERNAL)
        if status != CUDA_SUCCESS:
            raise DriverError("cuEventRecordWithFlags", status)

    @property
    def batch_call(self) -> "str | None":
        """The driver symbol prepare_batch's batches call, None where there is none."""
        return None if self._batch is None else self._batch[1]

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream_ptr: int) -> None:
        """Copy ``nbytes`` from host address ``src`` to device address ``dst``, ordered on the stream (asynchronous to
        the host only from page-locked memory)."""
        status = self._memcpy(dst, src, nbytes, stream_ptr)
        if status != CUDA_SUCCESS:
            raise DriverError("cuMemcpyHtoDAsync_v2", status)

    def prepare_batch(self, dsts, sizes, stream_ptr: int) -> PreparedBatch:
        """Copies of ``sizes[i]`` bytes to device addresses ``dsts[i]`` on ``stream_ptr`` (not the legacy NULL
        stream), in one driver call each time; BatchCopyError where the driver has no batch memcpy (before CUDA 12.8)."""
        if self._batch is None:
            raise BatchCopyError("loading libcuda's cuMemcpyBatchAsync_v2 or cuMemcpyBatchAsync", -1)
        function, name, fail_index = self._batch
        return PreparedBatch(function, name, dsts, sizes, stream_ptr, fail_index)

    def prepare(self, function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int) -> PreparedLaunch:
        """A launch of the CUfunction at ``function_ptr`` (a CuPy RawKernel's .kernel.ptr) on ``stream_ptr``."""
        return PreparedLaunch(self._launch_kernel, function_ptr, grid, block, args, shared_mem, stream_ptr)


def _symbol(prototype, name: str, driver):
    """`driver`'s function `name` with the C signature `prototype`, or None where it has no such symbol."""
    try:
        return prototype(ctypes.cast(getattr(driver, name), ctypes.c_void_p).value)
    except AttributeError:  # no symbol; no driver (None)
        return None


def _address(value) -> ctypes.c_void_p:
    """Where a ctypes object kept by its owner lies, as the void* argument handed to the driver."""
    return ctypes.c_void_p(ctypes.addressof(value))
