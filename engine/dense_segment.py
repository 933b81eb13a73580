"""One dense segment of the graph as its own onnxruntime session, fed through IO binding."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from engine.decoder_state import DecoderState
from engine.errors import ModelFileError
from engine.onnx_file import OnnxFile
from engine.ort_env import elem_type, session_options
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

    def __init__(self, segment: Segment, source: OnnxFile, input_types: dict[str, int],
                 providers: list[str] | None = None):
        self.segment = segment
        model = build_segment_model(segment, source, input_types)
        try:
            self.session = ort.InferenceSession(
                model.SerializeToString(), session_options(str(source.folder)),
                providers=providers or ["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's errors are long and multi-line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFileError(
                f"{source.path}: onnxruntime cannot load the dense part from node '{segment.nodes[0].name}' "
                f"to '{segment.nodes[-1].name}': {first}") from None
        self.output_types = {o.name: elem_type(o.type) for o in self.session.get_outputs()}

    def run(self, values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray]:
        """Run with `values` for the cut tensors; returns the segment's non-state outputs."""
        return run_bound(self.session, self.segment.inputs, self.segment.outputs, values, state)


def run_bound(session: ort.InferenceSession, inputs: list[str], outputs: list[str],
              values: dict[str, np.ndarray], state: DecoderState) -> dict[str, np.ndarray]:
    """Run a session with state tensors bound to the conversation's buffers (in place for KV)
    and every other output copied out."""
    binding = session.io_binding()
    for name in inputs:
        slot = state.slot_for_past(name)
        if slot is None:
            binding.bind_cpu_input(name, values[name])
        else:
            binding.bind_ortvalue_input(name, slot.past_value)
    fetched = [name for name in outputs if state.slot_for_present(name) is None]
    for name in fetched:
        binding.bind_output(name)
    for name in outputs:
        slot = state.slot_for_present(name)
        if slot is not None:
            binding.bind_ortvalue_output(name, slot.present_value)
    session.run_with_iobinding(binding)
    results = binding.get_outputs()
    return {name: results[i].numpy() for i, name in enumerate(fetched)}
