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
        self.output_types = {o.name: elem_type(o.type) for o in session.get_outputs()}

    def run(self, values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray]:
        """Run with `values` for the cut tensors; returns the segment's non-state outputs."""
        return run_bound(self.session, self.segment.inputs, self.segment.outputs, values, state)


def run_bound(session: ort.InferenceSession, inputs: list[str], outputs: list[str],
              values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray]:
    """Run a session with state tensors bound by pointer to the conversation's buffers (in place
    for KV: past and present are one buffer) and every other output copied out to the host."""
    backend = state.backend
    device = (backend.device_type, backend.device_id)
    binding = session.io_binding()
    for name in inputs:
        slot = state.slot_for_past(name)
        if slot is None:
            binding.bind_cpu_input(name, values[name])  # a cut tensor or a step input: host memory
        else:
            array = slot.array
            binding.bind_input(name, *device, array.dtype, array.shape, backend.pointer(array))
    fetched = [name for name in outputs if state.slot_for_present(name) is None]
    for name in fetched:
        binding.bind_output(name)  # onnxruntime allocates it on the host (copied from the GPU if it ran there)
    for name in outputs:
        slot = state.slot_for_present(name)
        if slot is not None:
            array = slot.present
            binding.bind_output(name, *device, array.dtype, array.shape, backend.pointer(array))
    session.run_with_iobinding(binding)
    # onnxruntime synchronises its stream at the end of a run; on the GPU this makes sure, at the cost
    # of a sync on an idle stream, before the host reads outputs or the state buffers are touched again.
    backend.synchronize()
    results = binding.get_outputs()
    return {name: results[i].numpy() for i, name in enumerate(fetched)}
