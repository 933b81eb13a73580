"""A thread that computes the CPU's parts of "both" layers beside the engine's Python (decode path "both").

The engine's thread launches a "both" layer (HybridExpertNode.launch_ahead: routing, the GPU's share and a merge that
waits for the host's gate, all queued on the GPU) and hands its host part to this worker (`take`), then goes on to the
next dense segment and layer at once: the GPU orders everything behind the gate. The worker's thread stays in one
compiled loop (kernels/cpu/host_parts.py) that waits for each layer's published routing, computes the CPU's share into
the published block and raises the gate, holding no GIL. So a layer costs the longer of the host's Python and the
GPU's chain plus the CPU's part, not their sum (on the H200, Qwen3-30B-A3B-like at 0%: ~100 µs of the host's work
from a gate to the next routing, then the CPU's ~200 µs part; RESULTS.md forty-first session).

Nothing on the engine's thread may then run a CPU expert kernel while jobs are pending (a second OpenMP pool beside the
worker's, spinning on the same cores): `drain` first. Nothing here waits for the GPU, so the engine's thread may (an
onnxruntime run that synchronises): the worker raises the gates it waits for.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import numba
import numpy as np
from numba.typed import List

from engine.errors import WorkbenchError
from kernels.cpu import host_parts
from kernels.cpu.host_parts import CANCEL, DONE, FAILED, PAIRS, QUEUED, T_GATED, T_REACHED, T_ROUTED
from kernels.cpu.omp_pool import release_pool
from kernels.cpu.threads import use_threads

CAPACITY = 1024     # jobs in flight at most: a step's layers, many times over
IDLE_S = 0.02       # the loop returns to Python (and its thread sleeps) after this long without a job
DRAIN_TIMEOUT_S = 10.0
WAITED_S = 2e-6     # a routing found later than this after the job was reached: the worker waited for the GPU


def supported() -> bool:
    """Whether this machine runs the compiled loop (x86-64: its time-stamp counter and spin hint)."""
    return host_parts.SUPPORTED


def worker_threads(kernel_threads: int | None) -> int:
    """The kernels' threads beside the engine's thread: one core less than they would take alone."""
    cores = kernel_threads or numba.config.NUMBA_NUM_THREADS
    return max(1, min(cores, (os.cpu_count() or 2) - 1))


def loop_item(kernel, block, threads: int) -> tuple | None:
    """A layer's entry in the loop's list, and its int64 params (CpuQMoE.host_part_args), for `kernel` on `threads`
    threads writing into `block` (a PublishedRouting's host views); None where the loop cannot run that kernel or
    the activations' dtype."""
    args = kernel.host_part_args(block.tokens, threads) if hasattr(kernel, "host_part_args") else None
    x = block.x
    if args is None or x.dtype not in (np.float16, np.float32):
        return None
    weights, activation, params = args
    spans = np.zeros((kernel.spec.num_experts, 2), np.int64)  # every expert whole, but for the job's split pair
    spans[:, 1] = kernel.spec.inter_size
    item = (block.flag, block.gate, block.ids, block.on_cpu, block.w,
            x.view(np.uint16) if x.dtype == np.float16 else x, block.part, spans, weights, activation)
    return item, params


class HostBlock:
    """A published block's host views as the loop reads them (kernels/gpu/published.py), over plain memory: what
    compile_loop compiles the loop with before any block exists."""

    def __init__(self, tokens: int, k: int, hidden: int, x_dtype):
        self.tokens, self.k = tokens, k
        self.flag, self.gate = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
        self.ids, self.on_cpu = np.zeros((tokens, k), np.int32), np.zeros((tokens, k), np.int32)
        self.w = np.zeros((tokens, k), np.float32)
        self.x = np.zeros((tokens, hidden), x_dtype)
        self.part = np.zeros((tokens, hidden), np.float32)


def compile_loop(kernel, x_dtype) -> bool:
    """The loop compiled (or loaded from Numba's cache) for layers of `kernel`'s kind with activations of `x_dtype`,
    by a call that returns at once: at load, so that no first "both" step waits for it (its gate would come after the
    merge gave up, and the step would run again). False where the loop cannot run such a layer."""
    spec = kernel.spec
    block = HostBlock(1, spec.k, spec.hidden_size, x_dtype)
    entry = loop_item(kernel, block, 1)
    if entry is None:
        return False
    item, params = entry
    layers = List.empty_list(numba.typeof(item))
    layers.append(item)
    scratch = _Scratch()
    scratch.size(block.tokens, block.k, spec.hidden_size, int(params[6]))
    _call_cancelled(layers, params[None], scratch)
    return True


def _call_cancelled(layers, params, scratch) -> None:
    """run_host_parts called with CANCEL set: compiled for these types (or loaded from Numba's cache, which launches
    Numba's threading layer first: numba_cache.calls_parallel), then back at once."""
    cancelled = host_parts.new_counters()
    cancelled[CANCEL] = 1
    host_parts.run_host_parts(layers, params, np.zeros((1, 2), np.int64), cancelled, np.zeros((1, 4), np.int64),
                              scratch.pair_ids, scratch.x32, scratch.ws, scratch.y, 0)


class _Scratch:
    """The loop's working arrays (pairs' ids, x as float32, the kernel's workspace, per-pair outputs), grown to the
    largest layer admitted."""

    def __init__(self):
        self.sized_for = (0, 0, 0)  # (pairs, hidden, workspace per pair)
        self.pair_ids = self.x32 = self.ws = self.y = None

    def size(self, tokens: int, k: int, hidden: int, ws_per_pair: int) -> None:
        pairs = tokens * k
        have = self.sized_for
        if have[0] and pairs <= have[0] and hidden <= have[1] and ws_per_pair <= have[2] \
                and self.pair_ids.shape[1] == k:
            return
        pairs, hidden, ws_per_pair = max(pairs, have[0]), max(hidden, have[1]), max(ws_per_pair, have[2])
        self.pair_ids = np.zeros((pairs // k, k), np.int64)
        self.x32 = np.zeros((pairs // k, hidden), np.float32)
        self.ws = np.zeros(max(1, pairs * ws_per_pair), np.float32)
        self.y = np.zeros(pairs * hidden, np.float32)
        self.sized_for = (pairs, hidden, ws_per_pair)


class CycleClock:
    """The time-stamp counter as perf_counter seconds, calibrated over a few ms."""

    def __init__(self, span_s: float = 0.005):
        c0, t0 = host_parts.read_cycles(), time.perf_counter()
        while time.perf_counter() - t0 < span_s:
            pass
        c1, t1 = host_parts.read_cycles(), time.perf_counter()
        self.hz = (c1 - c0) / (t1 - t0)
        self.c0, self.t0 = c0, t0

    def seconds(self, cycles: int) -> float:
        return self.t0 + (cycles - self.c0) / self.hz


class JobDone:
    """A job the loop finished: the step, and when the loop reached it, found its routing and raised its gate."""

    __slots__ = ("step", "reached", "routed", "gated", "pairs")

    def __init__(self, step, reached: float, routed: float, gated: float, pairs: int):
        self.step, self.reached, self.routed, self.gated, self.pairs = step, reached, routed, gated, pairs

    @property
    def cpu_s(self) -> float:
        return self.gated - self.routed

    @property
    def waited(self) -> bool:
        """Whether the worker was there before the GPU's routing (the CPU's part waited for the GPU, not the host)."""
        return self.routed - self.reached > WAITED_S


class HostPartWorker:
    def __init__(self, threads: int):
        self.threads = threads
        self.clock = CycleClock()
        self._layers = None  # numba typed List of the loop's per-layer tuples (host_parts._cpu_part's `layer`)
        self._item_type = None
        self._compiled_for = None  # the item type the loop was last called with (_admit)
        self._params = np.zeros((0, 7), np.int64)
        self._index_of: dict[int, tuple[int, object, object]] = {}  # engine layer -> (index, kernel, published)
        self._jobs = np.zeros((CAPACITY, 2), np.int64)
        self._counters = host_parts.new_counters()
        self._times = np.zeros((CAPACITY, 4), np.int64)
        self._steps: list = []  # the SplitStep of every job not yet collected, in order
        self._collected = 0
        self._scratch = _Scratch()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._in_loop = False  # the worker's thread is inside the compiled loop (or about to enter it)

    # ---------------------------------------------------------------- the engine's thread
    def set_threads(self, threads: int) -> None:
        """The kernels' threads from the next job on: every layer's entry made again for them (between steps: the
        loop is stopped once every queued job is done)."""
        if threads == self.threads:
            return
        self.threads = threads
        for layer, (_index, kernel, published) in list(self._index_of.items()):
            self._admit(layer, kernel, published)

    def take(self, step) -> bool:
        """Queue `step`'s host part (a launched SplitStep whose merge waits for the gate); False, with nothing queued,
        where the compiled loop cannot run its layer's kernel or raise its gate (the caller does the part itself)."""
        if not step.store.split_gate_on_device(step.pending):
            return False
        published = step.pending.published
        kernel = step.node.kernel
        known = self._index_of.get(step.node.layer)
        if known is None or known[1] is not kernel or known[2] is not published:
            if not self._admit(step.node.layer, kernel, published):
                return False
            known = self._index_of[step.node.layer]
        queued = int(self._counters[QUEUED])
        if queued - self._collected >= CAPACITY:  # (the decoder collects at every layer: never in a decode)
            return False
        self._jobs[queued % CAPACITY] = known[0], published.launched & 0xFFFFFFFF
        self._steps.append(step)
        self._counters[QUEUED] = queued + 1  # after the job's slot: the loop reads the count first
        self._start()
        return True

    def collect(self) -> list[JobDone]:
        """The jobs done since the last call, in order."""
        done = int(self._counters[DONE])
        finished = []
        seconds = self.clock.seconds
        while self._collected < done:
            times = self._times[self._collected % CAPACITY]
            finished.append(JobDone(self._steps[0], seconds(int(times[T_REACHED])), seconds(int(times[T_ROUTED])),
                                    seconds(int(times[T_GATED])), int(times[PAIRS])))
            self._steps.pop(0)
            self._collected += 1
        return finished

    @property
    def pending(self) -> bool:
        return int(self._counters[DONE]) < int(self._counters[QUEUED])

    def drain(self, while_waiting=None, leave: int = 0) -> None:
        """Wait until every queued job but the last `leave` is done (each waits for its layer's routing on the GPU),
        calling `while_waiting()` (short host work) between looks. A failed job, or one still waiting after
        DRAIN_TIMEOUT_S: every gate left is raised without the CPU's part, and the error says which layer."""
        started = time.perf_counter()
        counters = self._counters
        while counters[DONE] < counters[QUEUED] - leave:
            if counters[FAILED] or self._error is not None:
                self._fail()
            if time.perf_counter() - started > DRAIN_TIMEOUT_S:
                self._fail(f"waited {DRAIN_TIMEOUT_S:.0f} s for the GPU's routing")
            if while_waiting is not None:
                while_waiting()
            time.sleep(0)  # lets the worker's thread take the GIL, where it is between two calls of the loop

    def cancel(self) -> None:
        """Stop the loop and raise the gates of the jobs left, without their CPU's parts (after an error on the
        engine's thread: the GPU is not held until the gates' timeout)."""
        if not self.pending:
            return
        self._counters[CANCEL] = 1
        self._wait_idle()
        self._abandon_rest()

    # ---------------------------------------------------------------- internals
    def _admit(self, layer: int, kernel, published) -> bool:
        """Make `layer`'s entry in the loop's list; False where its kernel, activations' dtype or types differ from
        what the loop runs. The loop is stopped first: it holds the arrays it was called with."""
        entry = loop_item(kernel, published, self.threads)
        if entry is None:
            return False
        item, params = entry
        item_type = numba.typeof(item)
        if self._item_type is not None and item_type != self._item_type:
            return False
        self._stop_loop()
        if self._layers is None:
            self._layers, self._item_type = List.empty_list(item_type), item_type
        known = self._index_of.get(layer)
        if known is None:
            index = len(self._layers)
            self._layers.append(item)
            self._params = np.vstack([self._params, params[None]])
        else:
            index = known[0]
            self._layers[index] = item
            self._params[index] = params
        self._index_of[layer] = (index, kernel, published)
        self._scratch.size(published.tokens, published.k, published.x.shape[1], int(params[6]))
        if self._compiled_for is not item_type:
            # compiled (or loaded from Numba's cache) here, not in the worker's thread while a gated merge waits for
            # its first job (a minute or more on a cold cache: the drain gives up after DRAIN_TIMEOUT_S); at once
            # where compile_loop ran at load
            _call_cancelled(self._layers, self._params, self._scratch)
            self._compiled_for = item_type
        return True

    def _start(self) -> None:
        if self._thread is None:
            # the thread holds the worker only while it works: a worker dropped with its model goes (its layers'
            # kernels over the model's mapped file, the published blocks' pinned and GPU memory, this thread), where a
            # thread with the worker's bound method lived on with all of it for as long as the process
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._wake),
                                            name="moe-host-parts", daemon=True)
            weakref.finalize(self, self._wake.set).atexit = False  # the thread, woken, finds the worker gone and ends
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        """One wake of the worker's thread: the compiled loop while jobs come."""
        idle_cycles = int(IDLE_S * self.clock.hz)
        counters = self._counters
        use_threads(self.threads)  # (every layer's entry was made for them: set_threads)
        self._in_loop = True
        while True:
            scratch = self._scratch
            try:
                host_parts.run_host_parts(self._layers, self._params, self._jobs, counters, self._times,
                                          scratch.pair_ids, scratch.x32, scratch.ws, scratch.y, idle_cycles)
            except BaseException as exc:  # reported on the engine's thread (drain)
                self._error = exc
                break
            if counters[CANCEL] or counters[FAILED] or counters[DONE] >= counters[QUEUED]:
                break
        if not (counters[CANCEL] or counters[FAILED] or self._error is not None):
            # idle, asleep until the next decode: this thread's OpenMP pool given back, so that the engine
            # thread's kernels (prefill, the CPU path) run without the throttle of two pools (kernels/cpu/omp_pool)
            release_pool()
        self._in_loop = False

    def _stop_loop(self) -> None:
        """Every job done and the loop returned (jobs already done stay to be collected)."""
        self.drain()
        if self._in_loop:
            self._counters[CANCEL] = 1
            self._wait_idle()
            self._counters[CANCEL] = 0

    def _wait_idle(self) -> None:
        """Until the loop has returned (it looks at CANCEL between jobs and while it waits for a routing)."""
        deadline = time.perf_counter() + 1.0
        while self._in_loop and time.perf_counter() < deadline:
            time.sleep(0.0002)

    def _abandon_rest(self) -> None:
        """Raise the gates of the jobs not done and take them off the queue; the loop may run again after."""
        self.collect()
        for step in self._steps:
            step.abandon()
        self._collected += len(self._steps)
        self._steps.clear()
        counters = self._counters
        counters[DONE] = counters[QUEUED] = self._collected
        counters[FAILED] = counters[CANCEL] = 0

    def _fail(self, why: str | None = None) -> None:
        failed = int(self._counters[FAILED])
        error = self._error
        self._counters[CANCEL] = 1
        self._wait_idle()
        self.collect()
        layer = self._steps[0].node.info.name if self._steps else "?"
        self._error = None
        self._abandon_rest()
        if why is None:
            why = "an expert id out of range" if failed else f"{type(error).__name__}: {error}"
        raise WorkbenchError(f"{layer}: the CPU's part of a decode step failed on the host-part worker ({why})")


def _serve(worker_ref, wake: threading.Event) -> None:
    """The worker's thread: the compiled loop while jobs come (HostPartWorker._run), asleep between decodes; it ends
    once the worker is gone (its finalizer wakes it)."""
    while True:
        wake.wait()
        wake.clear()
        worker = worker_ref()
        if worker is None:
            return
        worker._run()
        del worker  # not held while asleep
