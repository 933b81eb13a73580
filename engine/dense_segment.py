"""One dense segment of the graph as its own onnxruntime session, fed through IO binding.

The segment runs where the DenseDevice says (CPU, or onnxruntime's CUDA EP). State tensors are bound
by pointer to the conversation's buffers, which live on that device. The cut tensors (the hidden
states that cross into the expert nodes, the logits) stay on the host: the expert nodes take NumPy
(CpuExpertNode, and HybridExpertNode, which splits a layer's tokens between CPU and GPU kernels),
so onnxruntime copies each segment's inputs in and its outputs out. On the GPU that is two small
PCIe copies per layer per step (a [tokens, hidden] activation each way) plus a stream sync; handing
the expert nodes device arrays instead is the next step.
"""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import onnxruntime as ort

from engine.decoder_state import DecoderState
from engine.errors import ModelFileError
from engine.onnx_file import OnnxFile
from engine.ort_env import CPU_DENSE, DenseDevice, elem_type
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
        self.output_types: dict[str, int] = {}
        if input_types is not None:
            self.open(input_types, dense)

    def open(self, input_types: dict[str, int], dense: DenseDevice = CPU_DENSE) -> None:
        segment, source = self.segment, self.source
        model = build_segment_model(segment, source, input_types)
        where = f"from node '{segment.nodes[0].name}' to '{segment.nodes[-1].name}'"
        try:
            # enable_fallback=0: onnxruntime's Python wrapper would otherwise retry on the CPU after
            # a CUDA EP failure (printing to stdout), and the GPU state buffers would meet a CPU session.
            session = ort.InferenceSession(
                model.SerializeToString(), dense.session_options(str(source.folder)),
                providers=dense.providers(), enable_fallback=0)
        except Exception as exc:  # onnxruntime's errors are long and multi-line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFileError(f"{source.path}: onnxruntime{dense.provider_words} cannot load the dense part "
                                 f"{where}: {first}") from None
        if dense.kind == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise ModelFileError(f"{source.path}: onnxruntime did not start its CUDA execution provider for the "
                                 f"dense part {where} (it offers {', '.join(session.get_providers())})")
        self.session = session
        self.bindings.clear()
        self.output_types = {o.name: elem_type(o.type) for o in session.get_outputs()}

    def run(self, values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray]:
        """Run with `values` for the cut tensors; returns the segment's non-state outputs."""
        return run_bound(self.session, self.segment.inputs, self.segment.outputs, values, state, self.bindings)


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
                 fresh: set[str] | None = None):
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
        for name in self.fetched:
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
        self._reusable = (fresh is not None and len(self._fresh) < len(self.fetched)
                          and backend.device_type == "cpu")
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
        (copied from the GPU if it ran there)."""
        fast, fetched = self._c_binding, self.fetched
        for i in indices:
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
        held, rebind = self._held, self._inputs_copied_at_bind
        for name in self.cut:
            array = values[name]
            if rebind or held.get(name) is not array:
                held[name] = array
                if fast is not None:
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
        try:
            self.session.run_with_iobinding(binding)
        except Exception:
            if reuse is None:
                raise
            # An output's shape changed with equal input shapes (it depends on values): no reuse from now
            # on. Running again is safe: KV is written in place at the same positions, a swapped state's
            # present buffer is written whole.
            self._reusable = False
            reuse = None
            self._bind_fetched(range(len(self.fetched)))
            self.session.run_with_iobinding(binding)
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
        results = {name: outputs[i].numpy() for i, name in enumerate(self.fetched)}
        if self._reusable:
            self._results = results
        return results

    def holds(self, values: dict[str, np.ndarray], results: dict[str, np.ndarray]) -> int:
        """Bytes the binding keeps alive until the next step: the cut tensors and the results."""
        return sum(values[name].nbytes for name in self.cut) + sum(r.nbytes for r in results.values())


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

    def run(self, session, inputs: list[str], outputs: list[str], values: dict[str, np.ndarray],
            state: DecoderState) -> dict[str, np.ndarray]:
        bound = self._by_state.get(state)
        if bound is None or bound.session is not session:
            bound = SegmentBinding(session, inputs, outputs, state, self.fresh)
        results = bound.run(values)
        if bound.holds(values, results) <= KEEP_BINDING_BYTES:
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
