"""Where the route_split kernel (route.cu) leaves a decode step's routing for the host, and how the host waits for it.

One page-locked block, written by the kernel over PCIe: a flag, every routed expert id [T, k], which pairs the CPU
takes [T, k], the weights [T, k] and the activations' bytes [T, H]. The kernel sets the flag to the launch's number
last, after a system-scope fence; the host spins on it (a few µs after the kernel) instead of synchronising the stream,
which would also wait for the decode kernels queued behind the routing. Also here: the device's ids and weights of the
GPU's share (decode_prep's input), the CPU's share per cold count and the rows of a split pair (kernels/cold_split.py),
the rows of this step's split pair that the decode kernels compute (`cut`) and the launch counter.

The other way, for a merge queued before the CPU's part exists (merge.cu's merge_gated, GpuQMoE.merge_gated): the
host writes the CPU's part [T, H] (float32) into the block and then raises the gate to the launch's number
(open_gate); the merge's blocks wait for it, and a gate still down after their timeout leaves the launch's number in
the `failed` word (gate_failed).
"""

from __future__ import annotations

import time

import numpy as np

FLAG_BYTES = 128  # the flag on a line of its own
# GPU clock readings (%globaltimer, ns) the kernels leave beside the flag and the failed word (gpu_times)
ROUTE_TIMES_AT = 8    # route_split's start and its routing published
MERGE_TIMES_AT = 8    # past failed_at: merge_gated's wait began, the gate seen
H2D = 1           # cudaMemcpyKind
SPIN_S = 0.005    # spinning beyond this, the host lets the driver wait (a GPU far behind the host)


def _aligned(n: int, to: int = 128) -> int:
    return -(-n // to) * to


class PublishTimeout(RuntimeError):
    pass


class PublishedRouting:
    def __init__(self, cp, tokens: int, k: int, hidden: int, x_dtype):
        self.cp, self.tokens, self.k = cp, tokens, k
        pair_bytes = tokens * k * 4
        self.x_bytes = tokens * hidden * np.dtype(x_dtype).itemsize
        self.gate_at = FLAG_BYTES  # the host's gate, and the merge's failed word, each on a line of its own
        self.failed_at = 2 * FLAG_BYTES
        self.ids_at = 3 * FLAG_BYTES
        self.cpu_at = self.ids_at + _aligned(pair_bytes)
        self.w_at = self.cpu_at + _aligned(pair_bytes)
        self.x_at = self.w_at + _aligned(pair_bytes)
        # the tables' host copy, cpu_take then split_rows (the host writes it)
        self.take_at = self.x_at + _aligned(self.x_bytes)
        self.part_at = self.take_at + _aligned(8 * (k + 1))  # the CPU's part (the host writes it)
        nbytes = self.part_at + _aligned(tokens * hidden * 4)
        self._pinned = cp.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(self._pinned, np.uint8, nbytes)
        host[:] = 0
        self.flag = host[:4].view(np.uint32)
        self.ids = host[self.ids_at:self.ids_at + pair_bytes].view(np.int32).reshape(tokens, k)
        self.on_cpu = host[self.cpu_at:self.cpu_at + pair_bytes].view(np.int32).reshape(tokens, k)
        self.w = host[self.w_at:self.w_at + pair_bytes].view(np.float32).reshape(tokens, k)
        self.x = host[self.x_at:self.x_at + self.x_bytes].view(x_dtype).reshape(tokens, hidden)
        self._take = host[self.take_at:self.take_at + 8 * (k + 1)].view(np.int32)
        self.gate = host[self.gate_at:self.gate_at + 4].view(np.uint32)
        self.failed = host[self.failed_at:self.failed_at + 4].view(np.uint32)
        self._route_times = host[ROUTE_TIMES_AT:ROUTE_TIMES_AT + 16].view(np.uint64)
        merge_times_at = self.failed_at + MERGE_TIMES_AT
        self._merge_times = host[merge_times_at:merge_times_at + 16].view(np.uint64)
        self.part = host[self.part_at:self.part_at + tokens * hidden * 4].view(np.float32).reshape(tokens, hidden)
        self._take_at = self._take.ctypes.data
        # under unified addressing (every 64-bit CUDA platform) kernels reach page-locked host memory at its host
        # address (benchmarks/bench_zero_copy.py reads it so)
        self.device_ptr = host.ctypes.data
        self.dev_ids = cp.empty((tokens, k), cp.int32)
        self.dev_w = cp.empty((tokens, k), cp.float32)
        self.seq = cp.zeros(1, cp.uint32)  # the kernel's count of its runs (graph replays included)
        self.tables = cp.zeros(2 * (k + 1), cp.int32)  # the device's cpu_take and split_rows
        self.cpu_take, self.split_rows = self.tables[:k + 1], self.tables[k + 1:]
        self.cut = cp.zeros(1, cp.int32)
        self.launched = 0  # the host's count of launches: the flag reads this once the latest has published
        # the tables last given (set_cpu_take: the engine hands the same ones until it remakes them)
        self._given = (None, None)

    def set_cpu_take(self, table: np.ndarray, stream, split_rows: np.ndarray | None = None) -> None:
        """The CPU's share per cold count, and the rows of a split pair (none unless given), for the launches from now
        on (copied in stream order where they changed)."""
        if table is self._given[0] and split_rows is self._given[1]:
            return
        self._given = (table, split_rows)
        tables = np.zeros(self._take.size, np.int32)
        tables[:self.k + 1] = table
        if split_rows is not None:
            tables[self.k + 1:] = split_rows
        if not np.array_equal(tables, self._take):
            self._take[:] = tables  # a copy still in flight reads the old tables or these: either is whole
            self.cp.cuda.runtime.memcpyAsync(self.tables.data.ptr, self._take_at, self._take.nbytes, H2D,
                                             stream.ptr)

    def open_gate(self) -> None:
        """Let the latest launch's gated merge go on: `part` holds the CPU's part by now (x86 keeps stores in order, so
        the merge, which reads the gate first, finds the part's bytes)."""
        self.gate[0] = self.launched & 0xFFFFFFFF

    def gate_failed(self) -> int:
        """The number of a launch whose gated merge gave up waiting (it left the GPU's part alone), else 0."""
        return int(self.failed[0])

    def gpu_times(self) -> tuple[int, int, int, int]:
        """The latest launch's moments on the GPU's clock (ns): route_split began, its routing was published; the
        gated merge began to wait, it saw the gate (0, 0 before a merge saw one). Read once the step is done."""
        return (int(self._route_times[0]), int(self._route_times[1]), int(self._merge_times[0]),
                int(self._merge_times[1]))

    def wait(self, launched, idle=None) -> float:
        """Wait for the latest launch's routing; returns the seconds waited. Spins on the flag for up to SPIN_S, then
        synchronises `launched` (an event recorded right after the launch, or its stream where nothing that waits for
        the host follows: a gated merge would wait for ever, or for its timeout) and requires the flag set. `idle`: the
        host's own work meanwhile, a piece a call (it returns whether there was one), until none is left. 0.0 exactly
        where the routing was there at once."""
        expected = self.launched & 0xFFFFFFFF
        flag = self.flag
        if flag[0] == expected:
            return 0.0
        started = time.perf_counter()
        while flag[0] != expected:
            if idle is not None:
                if idle():
                    continue
                idle = None
            if time.perf_counter() - started > SPIN_S:
                launched.synchronize()
                if flag[0] != expected:
                    raise PublishTimeout(f"route_split published launch {int(flag[0])}, expected {expected}")
                break
        return time.perf_counter() - started
