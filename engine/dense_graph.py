"""A dense segment's decode run on the GPU, replayed as a CUDA graph.

onnxruntime's run of one dense segment costs the host 140-250 µs a layer on the H200 (RESULTS.md: `dense_ort`) for
about ten nodes of GPU work: at high residency most of a decode step. Here, once a segment's decode run has repeated
with the same buffers, onnxruntime runs it once more while the dense stream (its user_compute_stream) is captured:
its kernels are recorded into a graph instead of run, and later steps launch that graph in one call while every
buffer it reads and writes lies where it did.

What lies where it did: the bound device buffers (the cut tensors, the KV and state buffers, the kept outputs: the
graph's key, so a grown KV buffer or a swapped state buffer takes a graph of its own) and onnxruntime's scratch,
which its arena hands out again to later runs of any segment, but only to runs queued on the same stream, one after
another, as for its own runs: another model's runs on its own stream share the arena too, and the steps of models on
one GPU run one at a time (ort_env.dense_step_lock). What onnxruntime allocates from the arena to keep (a kernel's own
buffers, made with the session: GroupQueryAttention's zeros) may land in a graph's scratch if made after the capture,
and every replay would overwrite it: graphs captured before a dense session was created on the GPU, by any model, are
dropped (arena_changed) and captured again. Inputs given on the host that onnxruntime reads on the device (GroupQueryAttention's
seqlens_k) are copied into a buffer of ours before each run, the same buffer at every step, one per model and input
(HostInputStaging): the segments of a step read the same lengths, and the first one's copy serves them all.

An input onnxruntime reads on the host is read by the captured run only. The one such input of a decode segment is
GroupQueryAttention's total_sequence_length, "the max of total sequence lengths": its flash-decoding kernels take
their split of the keys from it (seen on the H200: replays with the captured value went wrong from the first replay
on), while each sequence's own length comes from seqlens_k on the device. So graphed runs are given the KV buffer's
capacity instead, the same at every step (a grown buffer makes a new key); segments with a sliding-window
GroupQueryAttention, or any other input read on the host, are not replayed.

Only segments made of the operators in REPLAYED_OPS are replayed: those whose replays were checked against
onnxruntime's own runs on the GPU (the writer's models, as genai's builder makes them: attention by
GroupQueryAttention, int4 MatMulNBits projections). Others (a convolution's or a linear attention's state updates)
run as before. MOE_DENSE_GRAPHS=0 turns replays off.
"""

from __future__ import annotations

import gc
import operator
import os
import weakref
from collections import OrderedDict

import numpy as np

H2D = 1  # cudaMemcpyKind
WARM_RUNS = 2  # runs with a key before it is captured: onnxruntime's first runs allocate and tune
MAX_GRAPHS = 4  # per binding: a swapped state buffer alternates between two keys; a grown KV buffer makes a new one

enabled = os.environ.get("MOE_DENSE_GRAPHS", "1") != "0"
relaunch = True  # a decode step's replay launched again at the next step without the run's work (LastReplay); False:
#                  every run through SegmentBinding.run (bench_offload_ab's dense.relaunch=0)
# A diagnosis (MOE_DENSE_GRAPHS_VERIFY=1): every replay is followed by onnxruntime's own run of the same bound segment
# (it writes the same KV positions and outputs again) and the two outputs compared; differences go to `mismatches`.
verify = os.environ.get("MOE_DENSE_GRAPHS_VERIFY", "0") == "1"
mismatches: list[dict] = []
_arena_generation = 0  # dense sessions created on the GPU so far (arena_changed)
VERIFY_TOLERANCE = 1e-3
REPLAYED_OPS = frozenset({"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "MatMulNBits", "Add",
                          "GroupQueryAttention", "Reshape", "Gather"})


def arena_changed() -> None:
    """A dense session was created on the GPU: its persistent buffers came from the shared arena, perhaps from scratch
    that graphs captured earlier write; those are not replayed again (SegmentGraphs.replay)."""
    global _arena_generation
    _arena_generation += 1


def total_length_inputs(nodes, inputs) -> dict[str, str] | None:
    """{each segment input that is a GroupQueryAttention's total_sequence_length: that node's past_key input}, or None
    where the segment's runs must not be replayed (a GroupQueryAttention with a local window, or without a past_key
    to take the capacity from, or an operator outside REPLAYED_OPS)."""
    found = {}
    for node in nodes:
        if node.op_type not in REPLAYED_OPS:
            return None
        if node.op_type != "GroupQueryAttention":
            continue
        window = next((attribute.i for attribute in node.attribute if attribute.name == "local_window_size"), -1)
        if window != -1 or len(node.input) < 7 or not node.input[3]:
            return None
        if node.input[6] in inputs:
            found[node.input[6]] = node.input[3]
    return found


class HostInputStaging:
    """The device buffers that host inputs read on the device (GroupQueryAttention's seqlens_k) are copied into, one
    per input name for all the segments of a model (its backend: one dense stream). A copy is queued on the dense
    stream only when the values differ from the last ones copied: the buffer holds those in stream order, as every
    replay that reads it is queued on that stream too."""

    def __init__(self, backend):
        # weakly: _staging keys this by its backend, and a value holding its key kept both for as long as the process
        # (the model's dense stream and copy_out's page-locked buffers with it). Used through SegmentGraphs, which
        # holds the backend
        self.backend = weakref.proxy(backend)
        self._buffers: dict[str, tuple] = {}  # input name -> (device buffer, the bytes last copied into it)

    def stage(self, name: str, array: np.ndarray):
        """`array` (host, small) in this input's device buffer from the dense stream's point of view; the buffer."""
        cp = self.backend.xp
        buffer, last = self._buffers.get(name, (None, None))
        if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
            with self.backend._scope():
                buffer, last = cp.empty(array.shape, array.dtype), None
        array = np.ascontiguousarray(array)
        values = array.tobytes()
        if values != last:
            if array.nbytes:
                cp.cuda.runtime.memcpyAsync(buffer.data.ptr, array.ctypes.data, array.nbytes, H2D,
                                            self.backend.stream.ptr)
            self._buffers[name] = (buffer, values)
        return buffer


_staging: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def staging_for(backend) -> HostInputStaging:
    """The model's (backend's) HostInputStaging, made on first use."""
    staging = _staging.get(backend)
    if staging is None:
        staging = _staging[backend] = HostInputStaging(backend)
    return staging


def _same_objects(arrays, others) -> bool:
    """Whether two sequences hold the very same objects, in order (compared in C: no Python frame per array)."""
    return len(arrays) == len(others) and all(map(operator.is_, arrays, others))


class LastReplay:
    """A segment binding's last replay, for the next decode step to launch again without the run's own work
    (SegmentBinding.run's inputs, key and lookup: tens of µs of a layer's host time where the host is what a step
    waits for). It holds where the same graph still reads and writes the right buffers: every device array bound is
    the very object the replay was launched with (each lives where it did while it lives, and this holds it), so are
    the conversation's state buffers (a grown KV buffer is another array: and with it the capacity given for
    total_sequence_length), the host inputs are staged into the same buffers, no dense session was created since
    (arena_changed) and replays are on. The binding drops it at any run that does not launch it."""

    __slots__ = ("graphs", "graph", "device_inputs", "staged", "state_arrays", "results", "generation")

    def __init__(self, graphs: "SegmentGraphs", graph, device_inputs: tuple, staged: tuple, state_arrays: tuple,
                 results: dict):
        self.graphs, self.graph, self.results = graphs, graph, results
        self.device_inputs = device_inputs  # ((cut tensor, the device array bound), ...)
        self.staged = staged  # ((host input read on the device, the buffer it is staged in), ...)
        self.state_arrays = state_arrays
        self.generation = _arena_generation

    def launch(self, values: dict, state_arrays: list) -> dict | None:
        """Launch the graph again for this run's `values` and state buffers where it holds; its results (a new dict
        of the same arrays), or None where the run must take its own way."""
        graphs = self.graphs
        if self.generation != _arena_generation or not (enabled and relaunch) or verify or graphs.failed:
            return None
        for name, array in self.device_inputs:
            if values[name] is not array:
                return None
        if not _same_objects(state_arrays, self.state_arrays):
            return None
        for name, buffer in self.staged:
            if graphs.stage(name, values[name]) is not buffer:  # (a buffer made again for another shape)
                return None
        self.graph.launch(graphs.backend.stream)
        graphs.replays += 1
        return dict(self.results)


class SegmentGraphs:
    """The captured runs of one SegmentBinding, by key (the bound buffers), and the device copies of its host inputs
    that onnxruntime reads on the device. `failed`: why capture stopped for this binding (it runs eagerly then)."""

    def __init__(self, backend, host_read: frozenset[str], lengths: dict):
        self.backend = backend
        self.host_read = host_read
        self.lengths = lengths  # total_sequence_length input -> the StateSlot of its KV buffer
        self._capacities: dict[int, np.ndarray] = {}
        self.failed: str | None = None
        self.replays = self.checked = 0  # (counts, for the diagnosis)
        self._graphs: OrderedDict = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._staging = staging_for(backend)
        self._generation = _arena_generation  # of the graphs held
        self._keyed: tuple = ()  # the arrays of the last key_of call, and its key
        self._key: tuple = ()

    def key_of(self, arrays: list) -> tuple:
        """The key of a run that reads and writes the device `arrays`: each one's pointer and shape. Made again only
        where an array is another object than at the last call; a decode step's run finds the very same arrays, and
        reading their pointers (CuPy makes an object for each `.data`) took ~10 µs a segment on the H200."""
        if not _same_objects(arrays, self._keyed):
            self._keyed, self._key = tuple(arrays), tuple([(a.data.ptr, a.shape) for a in arrays])
        return self._key

    def forget_key(self) -> None:
        """Let go of the last key's arrays (a run that is not replayed: a prompt's, whose KV buffers may replace
        them), so that they are not kept alive in GPU memory by this cache."""
        self._keyed = self._key = ()

    def stage(self, name: str, array: np.ndarray):
        """`array` (host) in this input's device buffer, the model's (HostInputStaging); returns the buffer."""
        return self._staging.stage(name, array)

    def total_length(self, name: str) -> np.ndarray:
        """What a graphed run is given for total_sequence_length input `name`: its KV buffer's capacity."""
        capacity = int(self.lengths[name].array.shape[2])
        value = self._capacities.get(capacity)
        if value is None:
            value = self._capacities[capacity] = np.array(capacity, np.int32)
        return value

    def replay(self, key: tuple):
        """Launch the graph captured for `key` on the dense stream and return it; None when there is none (or the
        arena has changed since it was captured: then every graph held is dropped, to be captured again)."""
        if self._forget_if_arena_changed():
            return None
        graph = self._graphs.get(key)
        if graph is None:
            return None
        self._graphs.move_to_end(key)
        graph.launch(self.backend.stream)
        self.replays += 1
        return graph

    def _forget_if_arena_changed(self) -> bool:
        """Drop every graph held (and the warm runs counted) if a dense session was created on the GPU since they
        were captured (arena_changed); True when it did."""
        if self._generation == _arena_generation:
            return False
        self._graphs.clear()
        self._seen.clear()
        self._generation = _arena_generation
        return True

    def check(self, key: tuple, outputs: dict, run) -> None:
        """`verify`: the replay's `outputs` (name -> device array) against onnxruntime's run of the segment right
        after (`run`, which writes them again); a relative difference above VERIFY_TOLERANCE is kept in `mismatches`."""
        cp = self.backend.xp
        with self.backend._scope():
            replayed = {name: array.copy() for name, array in outputs.items()}
            run()
            for name, array in outputs.items():
                scale = float(cp.abs(array).max()) if array.size else 0.0
                diff = float(cp.abs(array.astype(cp.float32) - replayed[name].astype(cp.float32)).max()) if array.size else 0.0
                if diff > VERIFY_TOLERANCE * max(scale, 1e-30):
                    mismatches.append({"output": name, "relative": diff / max(scale, 1e-30), "key": hash(key),
                                       "replays_of_binding": self.replays})
        self.checked += 1

    def due(self, key: tuple) -> bool:
        """Count an eager run with `key`; True when the next one should be captured."""
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if len(self._seen) > 4 * MAX_GRAPHS:  # keys of buffers long gone (KV growth, other shapes)
            self._seen = {key: seen}
        return seen > WARM_RUNS

    def capture(self, key: tuple, run) -> bool:
        """`run()` (onnxruntime's run of the bound segment, no synchronisation) under capture of the dense stream,
        then its graph launched (the capture recorded the kernels, it did not run them). False, with `failed` set,
        where this onnxruntime or driver cannot capture it: the caller runs it eagerly, now and from now on."""
        self._forget_if_arena_changed()  # graphs of an older arena go; this one is captured in the current one
        cp = self.backend.xp
        stream = self.backend.stream
        mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)  # onnxruntime's arena may allocate
        gc_was_on = gc.isenabled()
        gc.disable()  # a graph freed during the capture fails and leaves CUDA's last error set (GpuQMoE._capture)
        try:
            return self._capture(key, run, stream, mode)
        finally:
            if gc_was_on:
                gc.enable()

    def _capture(self, key: tuple, run, stream, mode) -> bool:
        try:
            stream.begin_capture(*(() if mode is None else (mode,)))
        except Exception as exc:  # noqa: BLE001 - no capture here: eager runs
            self.failed = f"cannot begin a capture: {exc}"
            return False
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - whatever onnxruntime raised under capture
            self.failed = f"onnxruntime's run under capture: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - the capture was invalidated already
                pass
            return False
        try:
            graph = stream.end_capture()
        except Exception as exc:  # noqa: BLE001 - invalidated by a call capture does not allow
            self.failed = f"the capture was invalidated: {exc}"
            return False
        self._graphs[key] = graph
        if len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        graph.launch(stream)
        return True
