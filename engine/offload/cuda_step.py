"""A decode step's inputs and output between the host and one node's GPU slots, in kept buffers.

A launch used to make about ten CuPy calls before the kernels (copies of the activations, the expert ids and their
weights from pageable memory, dtype conversions, an output allocation and its memset) and a pageable copy back:
~340 µs per layer and token on the H200 (benchmarks/RESULTS.md), against 34-63 µs of kernels. Here the three
inputs are written into one pinned buffer and go over in one asynchronous copy, the decode kernels zero the output
themselves, and the result comes back through pinned memory. A node may have two launches in flight in one step
(its residents and the misses copied in that step), so buffers are taken from a small pool and given back at collect.
"""

from __future__ import annotations

import numpy as np

ALIGN = 256
H2D, D2H = 1, 2  # cudaMemcpyKind


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StepBuffers:
    """Pinned host and device buffers for one launch of `tokens` tokens: x [T, H] float32, expert ids [T, k] int32
    and weights [T, k] float32 in one copy; the output [T, H] float32 and its pinned copy back."""

    def __init__(self, cp, tokens: int, hidden: int, k: int):
        self.cp = cp
        self.tokens, self.k = tokens, k
        x_bytes, pair_bytes = tokens * hidden * 4, tokens * k * 4
        self._offsets = (0, _aligned(x_bytes), _aligned(x_bytes) + _aligned(pair_bytes))
        self.nbytes = self._offsets[2] + pair_bytes
        self._pinned_in = cp.cuda.alloc_pinned_memory(self.nbytes)
        host = self._host = np.frombuffer(self._pinned_in, np.uint8, self.nbytes)
        self.device = cp.empty(self.nbytes, cp.uint8)
        x_at, ids_at, w_at = self._offsets
        self.host_x = host[x_at:x_at + x_bytes].view(np.float32).reshape(tokens, hidden)
        self.host_ids = host[ids_at:ids_at + pair_bytes].view(np.int32).reshape(tokens, k)
        self.host_w = host[w_at:w_at + pair_bytes].view(np.float32).reshape(tokens, k)
        self.x = self.device[x_at:x_at + x_bytes].view(cp.float32).reshape(tokens, hidden)
        self.ids = self.device[ids_at:ids_at + pair_bytes].view(cp.int32).reshape(tokens, k)
        self.w = self.device[w_at:w_at + pair_bytes].view(cp.float32).reshape(tokens, k)
        self.out = cp.empty((tokens, hidden), cp.float32)
        self._pinned_out = cp.cuda.alloc_pinned_memory(x_bytes)
        self.host_out = np.frombuffer(self._pinned_out, np.float32, tokens * hidden).reshape(tokens, hidden)
        # addresses looked up once: `.ctypes` makes an object at every use (µs a call, several calls a layer)
        self._host_at, self._device_at = host.ctypes.data, self.device.data.ptr
        self._host_out_at, self._out_at = self.host_out.ctypes.data, self.out.data.ptr
        # the launch's start and stop, recorded again at each launch with these buffers: the step reads them before
        # the buffers are taken again (they go back to the pool at the merge or collect of their launch)
        self.start, self.stop = cp.cuda.Event(), cp.cuda.Event()

    def upload(self, x2d: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, stream) -> None:
        """The step's inputs into the pinned buffer (ids as int32), then one asynchronous copy on `stream`."""
        np.copyto(self.host_x, x2d)
        np.copyto(self.host_ids, expert_ids, casting="unsafe")  # expert ids < 2**31
        np.copyto(self.host_w, weights)
        self.cp.cuda.runtime.memcpyAsync(self._device_at, self._host_at, self.nbytes, H2D, stream.ptr)

    def download(self, stream) -> np.ndarray:
        """The output, copied into pinned memory on `stream` and waited for; valid until the next download."""
        self.cp.cuda.runtime.memcpyAsync(self._host_out_at, self._out_at, self.host_out.nbytes, D2H, stream.ptr)
        stream.synchronize()
        return self.host_out


class StepBufferPool:
    """StepBuffers by shape, reused: take one for a launch, give it back when its result is collected."""

    def __init__(self, cp, hidden: int):
        self.cp, self.hidden = cp, hidden
        self._free: dict[tuple[int, int], list[StepBuffers]] = {}

    def take(self, tokens: int, k: int) -> StepBuffers:
        free = self._free.get((tokens, k))
        return free.pop() if free else StepBuffers(self.cp, tokens, self.hidden, k)

    def give_back(self, buffers: StepBuffers) -> None:
        self._free.setdefault((buffers.tokens, buffers.k), []).append(buffers)


class RoutedBuffers:
    """A fully resident layer's launch with the routing on the device (CudaSlots.launch_routed): the float32 result
    and its copy in the dense part's dtype (what the next dense segment reads, in GPU memory), the routed experts'
    ids [T, k] the launch writes and their pinned host copy (the step's statistics read them once the copy is in),
    and the launch's start and stop events."""

    def __init__(self, cp, tokens: int, hidden: int, dtype, k: int):
        self.cp = cp
        self.key = RoutedBuffers.key_of(tokens, dtype)
        self.out32 = cp.empty((tokens, hidden), cp.float32)
        self.out = self.out32 if np.dtype(dtype) == np.float32 else cp.empty((tokens, hidden), dtype)
        self.ids = cp.empty((tokens, k), cp.int32)
        self._pinned = cp.cuda.alloc_pinned_memory(max(1, self.ids.nbytes))
        self.host_ids = np.frombuffer(self._pinned, np.int32, self.ids.size).reshape(tokens, k)
        self._host_ids_at = self.host_ids.ctypes.data
        self.start, self.stop = cp.cuda.Event(), cp.cuda.Event()
        self._result = None  # `out` in the node's output shape: one view, so the next segment binds it only once

    @staticmethod
    def key_of(tokens: int, dtype) -> tuple:
        return tokens, np.dtype(dtype).str

    def result(self, shape: tuple):
        if self._result is None or self._result.shape != tuple(shape):
            self._result = self.out.reshape(shape)
        return self._result

    def copy_ids(self, stream) -> None:
        """The launch's routed ids into the pinned copy, asynchronously on `stream`."""
        self.cp.cuda.runtime.memcpyAsync(self._host_ids_at, self.ids.data.ptr, self.ids.nbytes, D2H, stream.ptr)


class SplitBuffers:
    """A decode step whose cold experts the GPU and the CPU share (CudaSlots.launch_split, decode path "both"): where
    route_split publishes the routing to the host (kernels/gpu/published.py), the GPU's float32 part, and the
    launch's start and stop events. Kept per node and shape: a CUDA graph replays with the same pointers."""

    def __init__(self, cp, tokens: int, hidden: int, k: int, dtype):
        from kernels.gpu.published import PublishedRouting

        self.key = SplitBuffers.key_of(tokens, dtype)
        self.published = PublishedRouting(cp, tokens, k, hidden, dtype)
        self.out32 = cp.empty((tokens, hidden), cp.float32)
        self.start, self.stop = cp.cuda.Event(), cp.cuda.Event()
        self.sum_buffers = None  # the MergeBuffers of this shape (CudaSlots.launch_split sets it)
        self.merge = None  # the step's MergeBuffers where its merge was queued at the launch (the gated merge)
        self.launched_at = 0.0  # perf_counter at the gated merge's launch
        self.gate_late = False  # the latest gate raised after the merge may have stopped waiting (merge_split)
        self.merged_again = False  # the latest launch's sum made again after its gated merge gave up (merge_split)
        self.routing_wait_s = 0.0  # the host's wait for the latest routing (split_routing; 0 where it was there)
        self.stream = None  # the stream of the latest launch (the compute stream, or the dense part's: launch_split)

    @staticmethod
    def key_of(tokens: int, dtype) -> tuple:
        return tokens, np.dtype(dtype).str


class HostCopies:
    """Device arrays a layer needs on the host (the dense part left them in GPU memory, the layer has cold
    experts): copied into one kept pinned buffer, one wait for them all. The NumPy views returned are valid until
    the next fetch (the hybrid node reads them within its run)."""

    def __init__(self, cp):
        self.cp = cp
        self._pinned = None
        self._buffer = np.empty(0, np.uint8)
        self._buffer_at = 0

    def fetch(self, arrays, stream) -> list:
        cp = self.cp
        device = [a for a in arrays if isinstance(a, cp.ndarray)]
        need = sum(_aligned(a.nbytes) for a in device)
        if need > self._buffer.size:
            self._pinned = cp.cuda.alloc_pinned_memory(need)
            self._buffer = np.frombuffer(self._pinned, np.uint8, need)
            self._buffer_at = self._buffer.ctypes.data
        fetched, offset = [], 0
        with stream:  # a contiguous copy, where one is needed, is ordered after the work that made the array
            for array in arrays:
                if not isinstance(array, cp.ndarray):
                    fetched.append(array)
                    continue
                array = cp.ascontiguousarray(array)
                host = self._buffer[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
                cp.cuda.runtime.memcpyAsync(self._buffer_at + offset, array.data.ptr, array.nbytes, D2H, stream.ptr)
                fetched.append(host)
                offset += _aligned(array.nbytes)
        stream.synchronize()
        return fetched


class MergeBuffers:
    """A decode step's result kept in GPU memory (CudaSlots.merge_on_device): the CPU's float32 part in pinned
    memory and on the device, and the sum in the dense part's dtype, which the next dense segment reads."""

    def __init__(self, cp, tokens: int, hidden: int, dtype):
        self.cp = cp
        self._pinned = cp.cuda.alloc_pinned_memory(tokens * hidden * 4)
        self.host_part = np.frombuffer(self._pinned, np.float32, tokens * hidden).reshape(tokens, hidden)
        # the CPU's part already in the sum's dtype, for steps without a device part (the same pinned bytes: a step
        # uses one or the other)
        self.host_sum = np.frombuffer(self._pinned, dtype, tokens * hidden).reshape(tokens, hidden)
        self._host_at = self.host_part.ctypes.data
        self.part = cp.empty((tokens, hidden), cp.float32)
        self.sum = cp.empty((tokens, hidden), dtype)
        self._view = None

    def upload(self, cpu_part: np.ndarray, stream, to_sum: bool) -> None:
        """The CPU's part into pinned memory, then over to the device asynchronously on `stream`: into `part`, or,
        for a step without a device part (to_sum), converted to the sum's dtype here and straight into `sum` (no
        kernel at all)."""
        host, target = (self.host_sum, self.sum) if to_sum else (self.host_part, self.part)
        np.copyto(host, cpu_part.reshape(host.shape), casting="same_kind")
        self.cp.cuda.runtime.memcpyAsync(target.data.ptr, self._host_at, host.nbytes, H2D, stream.ptr)

    def combine(self, device_part, with_cpu_part: bool, merge_sum) -> None:
        """sum = device part + CPU part, in sum's dtype, on the current stream, by `merge_sum(a, b, out)`
        (GpuQMoE.merge_sum: one launch). Without a device part the CPU's part is in `sum` already (upload to_sum);
        with neither, zeros."""
        if device_part is not None:
            merge_sum(device_part, self.part if with_cpu_part else None, self.sum)
        elif not with_cpu_part:
            self.sum.fill(0)

    def result(self, shape: tuple):
        """The sum in the node's output shape: one view, so the next segment binds it once."""
        if self._view is None or self._view.shape != tuple(shape):
            self._view = self.sum.reshape(shape)
        return self._view


class MergeBufferPool:
    """MergeBuffers by (tokens, dtype), kept: one per node and decode shape."""

    def __init__(self, cp, hidden: int):
        self.cp, self.hidden = cp, hidden
        self._kept: dict[tuple[int, str], MergeBuffers] = {}

    def take(self, tokens: int, dtype) -> MergeBuffers:
        key = (tokens, np.dtype(dtype).str)
        if key not in self._kept:
            self._kept[key] = MergeBuffers(self.cp, tokens, self.hidden, dtype)
        return self._kept[key]
