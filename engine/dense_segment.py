"""One dense segment of the graph as its own onnxruntime session, fed through IO binding.

The segment runs where the DenseDevice says (CPU, or onnxruntime's CUDA EP). State tensors are bound
by pointer to the conversation's buffers, which live on that device. The cut tensors (the hidden
states that cross into the expert nodes, the logits) go to the host where a reader needs them there
(CpuExpertNode; the logits), so onnxruntime copies them out and the host waits for the stream. On the
GPU, those whose readers all take device arrays (later segments; HybridExpertNode with a CUDA store:
PartitionedDecoder.place_cut_tensors) stay in GPU memory (DeviceOutputs) and are bound by pointer as
the next segment's inputs: a fully resident layer then costs no copy and no wait.
"""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import onnxruntime as ort

from engine import dense_graph
from engine.decoder_state import DecoderState
from engine.errors import ModelFileError, WorkbenchError, error_reason, one_line
from engine.onnx_file import OnnxFile
from engine.ort_env import CPU_DENSE, MASK_DENSE, DenseDevice, elem_type
from engine.partition import Segment


def build_segment_model(segment: Segment, source: OnnxFile, input_types: dict[str, int]) -> onnx.ModelProto:
    """A model of the segment's nodes; initializers keep pointing at the original data file."""
    inputs = [onnx.helper.make_tensor_value_info(name, input_types[name], None) for name in segment.inputs]
    outputs = [onnx.ValueInfoProto(name=name) for name in segment.outputs]  # onnxruntime infers their types
    graph = onnx.helper.make_graph(
        segment.nodes, f"segment_{segment.index}", inputs, outputs,
        [source.initializers[name] for name in segment.initializers])
    model = onnx.helper.make_model(graph, opset_imports=list(source.proto.opset_import))
    model.ir_version = source.proto.ir_version
    return model


class DenseSegment:
    """Runs one segment; state tensors are bound to the conversation's buffers, others copied out."""

    def __init__(self, segment: Segment, source: OnnxFile, input_types: dict[str, int] | None = None,
                 dense: DenseDevice = CPU_DENSE):
        """With `input_types`, the session is created now; without, open() creates it later."""
        self.segment = segment
        self.source = source
        self.session: ort.InferenceSession | None = None
        self.bindings = SegmentBindings()  # IO bindings kept across steps, per conversation state
        # The step's last segment on the GPU: decode steps' bindings with the logits left in GPU memory too, so that
        # its run is a replay the host does not wait for (PartitionedDecoder.place_cut_tensors); None elsewhere
        self.decode_bindings: SegmentBindings | None = None
        self.output_types: dict[str, int] = {}
        self.host_inputs: frozenset[str] = frozenset()  # inputs a session on a device reads in host memory
        if input_types is not None:
            self.open(input_types, dense)

    def open(self, input_types: dict[str, int], dense: DenseDevice = CPU_DENSE) -> None:
        segment, source = self.segment, self.source
        if segment.on_host:
            dense = MASK_DENSE
        model = build_segment_model(segment, source, input_types)
        where = f"from node '{segment.nodes[0].name}' to '{segment.nodes[-1].name}'"
        options = dense.session_options(str(source.folder))  # (refuses two onnxruntime builds: not the model's fault)
        try:
            # enable_fallback=0: onnxruntime's Python wrapper would otherwise retry on the CPU after
            # a CUDA EP failure (printing to stdout), and the GPU state buffers would meet a CPU session.
            session = ort.InferenceSession(
                model.SerializeToString(), options, providers=dense.providers(), enable_fallback=0)
        except Exception as exc:  # onnxruntime's errors are long and multi-line
            raise ModelFileError(f"{source.path}: onnxruntime{dense.provider_words} cannot load the dense part "
                                 f"{where}: {error_reason(exc)}") from None
        if dense.kind == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise ModelFileError(f"{source.path}: onnxruntime did not start its CUDA execution provider for the "
                                 f"dense part {where} (it offers {', '.join(session.get_providers())})")
        if dense.kind == "cuda":
            dense_graph.arena_changed()
        self.session = session
        self.bindings.clear()
        self.decode_bindings = None  # (place_cut_tensors makes them again for the new session)
        self.output_types = {o.name: elem_type(o.type) for o in session.get_outputs()}
        self.bindings.total_lengths = dense_graph.total_length_inputs(segment.nodes, segment.inputs)
        self.host_inputs = (_inputs_read_on_the_host(session) or frozenset()) if dense.kind != "cpu" else frozenset()

    def run(self, values: dict[str, np.ndarray], state: DecoderState, decode: bool = False) -> dict[str, np.ndarray]:
        """Run with `values` for the cut tensors; returns the segment's non-state outputs. `decode`: a one-token step,
        run through `decode_bindings` where this segment has them (the logits then come back as a device array, and
        the host does not wait for them). onnxruntime's own failure (a genai_config that does not match the graph, a
        token id past the embedding's rows) is a WorkbenchError naming the segment, in one line."""
        try:
            if self.segment.on_host:  # host arrays in and out: no binding to keep, no device to wait for
                segment = self.segment
                return dict(zip(segment.outputs, self.session.run(segment.outputs,
                                                                  {name: values[name] for name in segment.inputs})))
            return run_bound(self.session, self.segment.inputs, self.segment.outputs, values, state,
                             self._bindings_for(decode))
        except Exception as exc:  # its Python wrapper raises RuntimeError("Error in execution: ..."), its core its own
            if not (type(exc) is RuntimeError or type(exc).__module__.startswith("onnxruntime")):
                raise
            nodes = self.segment.nodes
            raise WorkbenchError(f"{self.source.path}: onnxruntime failed to run the dense part from node "
                                 f"'{nodes[0].name}' to '{nodes[-1].name}': {one_line(exc)}") from None

    def run_again(self, values: dict[str, np.ndarray], state: DecoderState,
                  decode: bool = False) -> dict[str, np.ndarray] | None:
        """The results of the last step's graph replay launched again for `values` (a launch, nothing that waits for
        the GPU); None, with nothing launched, where this run must take run()'s way."""
        return self._bindings_for(decode).run_again(self.session, values, state)

    def _bindings_for(self, decode: bool) -> "SegmentBindings":
        return self.decode_bindings if decode and self.decode_bindings is not None else self.bindings


def _inputs_read_on_the_host(session: ort.InferenceSession) -> frozenset[str] | None:
    """The inputs a session on a device reads in host memory (onnxruntime's input memory infos: GroupQueryAttention's
    total_sequence_length, shape inputs of nodes left on the CPU). A device buffer bound to one is copied to the host
    when bound, so it cannot stay on the device and be bound once. None where onnxruntime cannot say (before 1.23):
    the float-only rule of DEVICE_ONNX_TYPES then stands alone, and no run is replayed as a graph."""
    try:
        infos = session.get_input_memory_infos()
    except (AttributeError, RuntimeError):
        return None
    return frozenset(i.name for i, info in zip(session.get_inputs(), infos) if info.name == "Cpu")


# A binding kept across steps holds what it was last bound to: the cut tensors fed in and the outputs
# onnxruntime allocated (the NumPy results share their memory). A decode step's are a few KB; a prefill's
# can be hundreds of MB, so a binding that would keep more than this alive is not kept.
KEEP_BINDING_BYTES = 4 << 20


class SegmentBinding:
    """One segment's IO binding for one conversation's state, kept across decode steps.

    Creating a binding and binding every input and output costs host time on every segment of every
    step (issue #4: the per-layer overhead). Kept, a step binds only what changed: the cut tensors
    (new arrays every step, bound in place: bind_cpu_input does not copy), the outputs onnxruntime
    allocates (bound again, unallocated, so each step's results are new arrays and earlier results
    are never overwritten), and the state buffers whose array changed (a KV buffer grown by
    DecoderState.reserve, swapped conv/recurrent state after every step). A state buffer is known by
    a weak reference to its array: the binding never keeps a conversation's buffers alive (nor an
    old KV buffer once it has grown), and an array that died is bound again, by its new pointer.
    Outputs are bound first, fetched ones before state ones, so the fetched results are the first
    of the binding's outputs at every step.
    """

    def __init__(self, session: ort.InferenceSession, inputs: list[str], outputs: list[str], state: DecoderState,
                 fresh: set[str] | None = None, on_device: set[str] = frozenset(), total_lengths: dict | None = None):
        self.session = session
        self.binding = session.io_binding()
        backend = self.backend = state.backend
        self.device = (backend.device_type, backend.device_id)
        self.cut = [name for name in inputs if state.slot_for_past(name) is None]
        self.state_inputs = [(name, state.slot_for_past(name)) for name in inputs if state.slot_for_past(name) is not None]
        self.fetched = [name for name in outputs if state.slot_for_present(name) is None]
        self.state_outputs = [(name, state.slot_for_present(name)) for name in outputs
                              if state.slot_for_present(name) is not None]
        self._bound: dict[str, object] = {}  # name -> weak reference to the array bound by pointer
        # Outputs left in GPU memory (SegmentBindings.on_device; only with the state there): every reader takes
        # device arrays, so no copy to the host and no wait for the stream. DeviceOutputs keeps their buffers.
        device_indices = [i for i, name in enumerate(self.fetched) if name in on_device]
        self._on_device = DeviceOutputs(self, device_indices) if device_indices and backend.device_arrays else None
        for index, name in enumerate(self.fetched):
            if self._on_device is not None and index in self._on_device.indices:
                self.binding.bind_output(name, *self.device)
            else:
                self.binding.bind_output(name)
        # The per-step binds and the read-back go to onnxruntime's C binding under its Python wrapper
        # when it has one (the wrapper's bookkeeping for WebGPU graph capture, unused here, costs more
        # than the binds); `_held` then keeps the bound cut tensors alive, as the wrapper would.
        self._c_binding, self._host = _c_binding(self.binding)
        self._held: dict[str, np.ndarray] = {}
        self._inputs_copied_at_bind = backend.device_type != "cpu"
        # Outputs that live only within a step (all fetched ones but `fresh`; None: none) keep their
        # buffers: while the cut tensors' shapes repeat (decode), they are not bound again and onnxruntime
        # writes this step's values into last step's arrays, so no new array, read-back or NumPy view is
        # made. `fresh` outputs (the logits, which callers keep) are new arrays at every step.
        self._fresh = [i for i, name in enumerate(self.fetched) if fresh is None or name in fresh]
        # Not on the GPU: there onnxruntime copies each output to the host into a buffer of its own, not
        # into last step's (seen on the H200 with onnxruntime-gpu 1.31.1: from the second decode step on,
        # the kept arrays held the first step's values).
        # Nor with outputs left in device memory: DeviceOutputs keeps those buffers itself.
        self._reusable = (fresh is not None and len(self._fresh) < len(self.fetched)
                          and backend.device_type == "cpu" and self._on_device is None)
        # Every output left in GPU memory: the decode run may be replayed as a CUDA graph (dense_graph.py)
        # (total_lengths: dense_graph.total_length_inputs; every input read on the host must be one of them)
        host_read = _inputs_read_on_the_host(session)
        lengths = {name: state.slot_for_past(past) for name, past in (total_lengths or {}).items()}
        replayable = (self._on_device is not None and self._on_device.all and host_read is not None
                      and total_lengths is not None and host_read <= set(lengths)
                      and all(slot is not None and slot.shared for slot in lengths.values()))
        self._graphs = dense_graph.SegmentGraphs(backend, host_read, lengths) if replayable else None
        self._replayed: dict | None = None  # the cut tensors of the last replay (not bound: see run)
        self.last_replay: dense_graph.LastReplay | None = None  # that replay, for run_again
        self._shapes: tuple | None = None  # the cut tensors' shapes of the last run
        # ... but for the attention mask, which grows by one at every decode step: the outputs' shapes do not follow
        # it in the models seen (GQA reduces it to sequence lengths), so the first segment's outputs are kept too;
        # where one does follow it, the first such run fails and reuse is turned off (below).
        self._shape_cut = [name for name in self.cut if name != state.mask_name]
        self._results: dict[str, np.ndarray] | None = None  # its results, their buffers still bound

    def _bind_state(self, name: str, array, bind) -> None:
        ref = self._bound.get(name)
        if ref is not None and ref() is array:
            return  # bound to this very array already
        bind(name, *self.device, array.dtype, array.shape, self.backend.pointer(array))
        try:
            self._bound[name] = weakref.ref(array)
        except TypeError:  # an array type without weak references: bound again at every step
            self._bound.pop(name, None)

    def _bind_fetched(self, indices) -> None:
        """Bind fetched outputs unallocated: onnxruntime allocates them on the host at the next run
        (copied from the GPU if it ran there). Outputs left on the device are DeviceOutputs' to bind."""
        fast, fetched = self._c_binding, self.fetched
        device = self._on_device.indices if self._on_device is not None else ()
        for i in indices:
            if i in device:
                continue
            if fast is not None:
                fast.bind_output(fetched[i], self._host)
            else:
                self.binding.bind_output(fetched[i])

    def run(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        binding, fast = self.binding, self._c_binding
        # The cut tensors and step inputs: host memory. On the CPU they are bound in place (by pointer, not copied),
        # so an input that is the very array bound at the last run (a previous segment's output buffer kept within
        # the decode shapes) is bound still: same memory, same shape, kept alive by `_held`; not bound again. On the
        # GPU, onnxruntime copies a host input to the device when it is bound (IOBinding::BindInput), not when it
        # runs: an array rewritten in place since (an expert node's kept decode output) is bound again at every run.
        # Device arrays (a kept DeviceOutputs buffer, an expert node's result on the GPU) are bound by pointer, read
        # where they lie: the same array is bound still.
        held, rebind = self._held, self._inputs_copied_at_bind
        # graphs: decode runs with the kept outputs' shapes only (a prompt's run takes onnxruntime's own path: with
        # the capacity as its total length GroupQueryAttention would not see a first prompt)
        graphs = self._graphs
        self.last_replay = None  # (run_again's, from the replay below only)
        if graphs is not None and not (dense_graph.enabled and not graphs.failed and self._on_device.bound(values)):
            graphs.forget_key()
            graphs = None
        inputs = values  # the arrays to bind, by cut tensor
        if graphs is not None:
            inputs = {name: self._graph_input(graphs, name, values[name]) for name in self.cut}
            key = self._graph_key(inputs)
            graph = None if dense_graph.verify else graphs.replay(key)
            if graph is not None:
                # nothing to bind: the graph reads and writes the buffers of its key, which these are
                self._replayed = inputs  # alive until the next run, which comes after the replay in stream order
                self.last_replay = self._remember(graphs, graph, values, inputs)
                return dict(self._on_device.results)
        for name in self.cut:
            array = inputs[name]
            on_host = isinstance(array, np.ndarray)
            if (rebind and on_host) or held.get(name) is not array:
                held[name] = array
                if not on_host:
                    binding.bind_input(name, *self.device, array.dtype, array.shape, self.backend.pointer(array))
                elif fast is not None:
                    fast.bind_input(name, array)
                else:
                    binding.bind_cpu_input(name, array)
        reuse = None
        if self._reusable:
            shapes = tuple([values[name].shape for name in self._shape_cut])
            if shapes == self._shapes:
                reuse = self._results
            self._shapes = shapes
        self._bind_fetched(self._fresh if reuse is not None else range(len(self.fetched)))
        for name, slot in self.state_inputs:
            self._bind_state(name, slot.array, binding.bind_input)
        for name, slot in self.state_outputs:
            self._bind_state(name, slot.present, binding.bind_output)
        on_device = self._on_device
        kept = on_device is not None and on_device.bound(values)
        if on_device is not None and not kept:
            on_device.unbind()
        if graphs is not None and kept:
            run = lambda: self.session.run_with_iobinding(binding, on_device.no_sync)  # noqa: E731
            # (a replay without the diagnosis returned above)
            if (dense_graph.verify and graphs.replay(key)) or (graphs.due(key) and graphs.capture(key, run)):
                if dense_graph.verify:
                    graphs.check(key, on_device.results, run)
                return dict(on_device.results)
        try:
            self.session.run_with_iobinding(binding, on_device.no_sync if kept and on_device.all else None)
        except Exception:
            if reuse is None and not kept:
                raise
            # An output's shape changed with equal input shapes (it depends on values): no reuse from now
            # on. Running again is safe: KV is written in place at the same positions, a swapped state's
            # present buffer is written whole.
            self._reusable = False
            reuse = None
            if kept:
                on_device.keeps = False  # onnxruntime allocates them at every run from now on
                on_device.unbind()
                kept = False
            self._bind_fetched(range(len(self.fetched)))
            self.session.run_with_iobinding(binding)
        if on_device is not None and on_device.all and kept:
            # Every output stays in GPU memory, written there already: the host goes on while the stream runs
            # (the readers' work is queued after it, on this stream or one that waits for it).
            return dict(on_device.results)
        # onnxruntime synchronises its stream at the end of a run; on the GPU this makes sure, at the cost
        # of a sync on an idle stream, before the host reads outputs or the state buffers are touched again.
        self.backend.synchronize()
        if reuse is not None and not self._fresh:
            return dict(reuse)
        outputs = fast.get_outputs() if fast is not None else binding.get_outputs()
        if reuse is not None:
            results = dict(reuse)
            for i in self._fresh:
                results[self.fetched[i]] = outputs[i].numpy()
            return results
        device = {}
        if on_device is not None:
            device = on_device.kept() if kept else on_device.keep(outputs, values)
        results = {name: device[i] if i in device else outputs[i].numpy() for i, name in enumerate(self.fetched)}
        if self._reusable:
            self._results = results
        return results

    def run_again(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The last run's graph launched again where it holds for `values` (dense_graph.LastReplay: a decode step's
        replayed segment, the step after); its results, else None (run() then)."""
        last = self.last_replay
        return None if last is None else last.launch(values, self._state_arrays())

    def _state_arrays(self) -> list:
        return [slot.array for _, slot in self.state_inputs] + [slot.present for _, slot in self.state_outputs]

    def _remember(self, graphs, graph, values: dict, inputs: dict) -> dense_graph.LastReplay:
        """What run_again checks before launching `graph` again: the device arrays bound, the buffers the host inputs
        read on the device were staged in (total_sequence_length's capacity follows the state buffers)."""
        device = tuple((name, values[name]) for name in self.cut if not isinstance(values[name], np.ndarray))
        staged = tuple((name, inputs[name]) for name in self.cut if isinstance(values[name], np.ndarray)
                       and name not in graphs.lengths and name not in graphs.host_read)
        return dense_graph.LastReplay(graphs, graph, device, staged, tuple(self._state_arrays()),
                                      self._on_device.results)

    @staticmethod
    def _graph_input(graphs, name: str, array):
        """What a graphed run binds for cut tensor `name`: a host input onnxruntime reads on the device staged in the
        model's buffer for it, a total_sequence_length the KV buffer's capacity (both the same at every step)."""
        if not isinstance(array, np.ndarray):
            return array
        if name in graphs.lengths:
            return graphs.total_length(name)
        return array if name in graphs.host_read else graphs.stage(name, array)

    def _graph_key(self, inputs: dict) -> tuple:
        """The device buffers this run reads and writes (the cut tensors' `inputs` to bind, the state buffers, the
        kept outputs), by pointer and shape: a captured run replays only onto the very buffers it was captured with."""
        arrays = [a for a in (inputs[name] for name in self.cut) if not isinstance(a, np.ndarray)]
        arrays += [slot.array for _, slot in self.state_inputs]
        arrays += [slot.present for _, slot in self.state_outputs]
        arrays += self._on_device.results.values()
        return self._graphs.key_of(arrays)

    def holds(self, values: dict[str, np.ndarray], results: dict[str, np.ndarray]) -> int:
        """Bytes the binding keeps alive until the next step: the cut tensors and the results."""
        total = 0
        for name in self.cut:
            total += values[name].nbytes
        for result in results.values():
            total += result.nbytes
        return total


# The outputs DeviceOutputs holds: float activations, by onnxruntime's element type (CuPy has no bfloat16). Integer
# cut tensors stay on the host: kernels read some on the CPU (GroupQueryAttention's total_sequence_length), and
# onnxruntime copies such an input over when it is bound, so a kept device buffer would be read at its value of the
# run that bound it (seen on the H200: sliding-window layers went wrong from the second decode step on).
DEVICE_OUTPUT_TYPES = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
DEVICE_TO_DEVICE = 3  # cudaMemcpyKind
DEVICE_ONNX_TYPES = frozenset(elem_type(name) for name in DEVICE_OUTPUT_TYPES)  # the same, as ONNX element types


def no_sync_run_options() -> ort.RunOptions:
    """Options for a run whose outputs all stay in GPU memory: the host does not wait for the stream at its end.

    They also set gpu_graph_id to -1, onnxruntime's value for "no CUDA graph capture" (none is enabled here):
    onnxruntime's Python run_with_iobinding reads that key from the options at every run, and reading an unset key
    raises and catches a RuntimeError inside it (24 µs on the dev VM; 46-95 µs a layer in the H200 machine's
    profiles, ninth session), against 0.3 µs when it is set."""
    options = ort.RunOptions()
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options


class DeviceOutputs:
    """A binding's outputs left in GPU memory, in buffers of our own that stay bound.

    A run whose cut tensors have new shapes (the prompt, the first decode step) lets onnxruntime allocate these
    outputs on the device; keep() copies them (device to device, on the stream) into CuPy buffers and binds those
    as the outputs, so the following runs with the same shapes write there: the same arrays at every decode step,
    read within the step by the expert node or dense segment after (as SegmentBinding's reuse on the CPU).
    onnxruntime's own output values cannot be held instead: the binding overwrites them at its next run."""

    def __init__(self, owner: "SegmentBinding", indices: list[int]):
        # a proxy, not the binding: the binding holds this, and a cycle between them would keep onnxruntime's session
        # and these device buffers until a garbage collection, not just until the binding goes
        self.owner = weakref.proxy(owner)
        self.indices = frozenset(indices)
        self.all = len(self.indices) == len(owner.fetched)  # no output goes to the host: no wait after a run
        self.keeps = True  # False once an output's shape changed under equal input shapes: allocated at every run
        self.results: dict[str, object] = {}
        self._shapes: tuple | None = None  # the cut tensors' shapes the kept buffers were made for
        self.no_sync = no_sync_run_options()

    def _cut_shapes(self, values) -> tuple:
        return tuple([values[name].shape for name in self.owner._shape_cut])

    def bound(self, values) -> bool:
        """Whether the kept buffers are bound and made for this run's cut-tensor shapes."""
        return self._shapes is not None and self._shapes == self._cut_shapes(values)

    def unbind(self) -> None:
        """Outputs bound unallocated on the device: onnxruntime allocates them at the next run."""
        self._shapes, self.results = None, {}
        owner = self.owner
        for index in self.indices:
            owner.binding.bind_output(owner.fetched[index], *owner.device)

    def kept(self) -> dict[int, object]:
        fetched = self.owner.fetched
        return {index: self.results[fetched[index]] for index in self.indices}

    def keep(self, outputs, values) -> dict[int, object]:
        """After a run with onnxruntime's allocations: the outputs copied into CuPy buffers, bound for the next
        runs (unless `keeps` is off); index -> array."""
        owner = self.owner
        backend = owner.backend
        cp = backend.xp
        arrays = {}
        with backend._scope():
            stream = cp.cuda.get_current_stream()
            for index in self.indices:
                value = outputs[index]
                array = cp.empty(tuple(value.shape()), DEVICE_OUTPUT_TYPES[value.data_type()])
                if array.nbytes:
                    cp.cuda.runtime.memcpyAsync(array.data.ptr, value.data_ptr(), array.nbytes, DEVICE_TO_DEVICE,
                                                stream.ptr)
                arrays[index] = array
        if self.keeps and all(array.nbytes for array in arrays.values()):  # (an empty buffer has no pointer to bind)
            for index, array in arrays.items():
                owner.binding.bind_output(owner.fetched[index], *owner.device, array.dtype, array.shape,
                                          backend.pointer(array))
            self.results = {owner.fetched[index]: array for index, array in arrays.items()}
            self._shapes = self._cut_shapes(values)
        return arrays


def _c_binding(binding: ort.IOBinding):
    """(onnxruntime's C binding under `binding`, the host device in its terms), or (None, None) when this
    onnxruntime's Python wrapper is not built that way (the wrapper's own methods are used then)."""
    try:
        return binding._iobinding, ort.OrtDevice.make("cpu", 0)._get_c_device()
    except AttributeError:
        return None, None


class SegmentBindings:
    """A segment's kept bindings, one per live conversation state (weakly keyed: a state that is gone
    takes its binding with it; the window's agreement meter runs a shadow state next to the main one)."""

    def __init__(self):
        self._by_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Outputs callers keep past a step (the logits); the others are read within the step only and
        # their buffers are reused at the next (SegmentBinding). None: every output a new array.
        self.fresh: set[str] | None = None
        # GroupQueryAttention's total_sequence_length inputs and their KV inputs (dense_graph.total_length_inputs):
        # None where the segment's decode runs may not be replayed as CUDA graphs
        self.total_lengths: dict[str, str] | None = None
        # Outputs left in GPU memory when the state is there (PartitionedDecoder.place_cut_tensors)
        self.on_device: frozenset[str] = frozenset()

    def run_again(self, session, values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray] | None:
        """SegmentBinding.run_again on the state's kept binding; None without one."""
        bound = self._by_state.get(state)
        return bound.run_again(values) if bound is not None and bound.session is session else None

    def run(self, session, inputs: list[str], outputs: list[str], values: dict[str, np.ndarray],
            state: DecoderState) -> dict[str, np.ndarray]:
        kept = bound = self._by_state.get(state)
        if bound is not None and bound.session is session:
            again = bound.run_again(values)  # a decode step's replay, launched as at the last step
            if again is not None:
                return again
        if bound is None or bound.session is not session:
            bound = SegmentBinding(session, inputs, outputs, state, self.fresh, self.on_device, self.total_lengths)
        results = bound.run(values)
        if bound.holds(values, results) <= KEEP_BINDING_BYTES:
            if bound is not kept:
                self._by_state[state] = bound
        else:  # a prefill's tensors: not kept past this step
            self._by_state.pop(state, None)
        return results

    def clear(self) -> None:
        self._by_state.clear()


def run_bound(session: ort.InferenceSession, inputs: list[str], outputs: list[str],
              values: dict[str, np.ndarray], state: DecoderState,
              bindings: SegmentBindings | None = None) -> dict[str, np.ndarray]:
    """Run a session with state tensors bound by pointer to the conversation's buffers (in place
    for KV: past and present are one buffer) and every other output copied out to the host.
    With `bindings`, the binding is kept for the next step (SegmentBinding); without, it is made
    for this run only."""
    if bindings is not None:
        return bindings.run(session, inputs, outputs, values, state)
    return SegmentBinding(session, inputs, outputs, state).run(values)
