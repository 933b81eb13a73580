"""An expert node (com.microsoft QMoE or MoE) of the graph, executed by our kernels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from engine.errors import ModelFileError, UnsupportedModelError
from engine.onnx_file import OnnxFile
from kernels.qmoe_spec import MOE_INPUT_NAMES, QMOE_INPUT_NAMES, QMoESpec, UnsupportedLayout

ACTIVATION_INPUTS = ("input", "router_probs", "router_weights")


@dataclass
class ExpertNodeInfo:
    """What the graph says about one expert node: its attributes, weights and whether we run it."""
    name: str
    op_type: str
    layer: int
    attributes: dict
    activation_inputs: dict[str, str]  # "input" / "router_probs" / "router_weights" -> tensor name
    weight_inputs: dict[str, str]      # contract input name -> initializer name
    output: str
    spec: QMoESpec | None
    unsupported: str | None            # why our kernels can't run it, or None
    weight_bytes: int

    @property
    def bytes_per_expert(self) -> int:
        return self.weight_bytes // self.spec.num_experts if self.spec else 0


def _attributes(node: onnx.NodeProto) -> dict:
    values = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        values[attr.name] = value.decode() if isinstance(value, bytes) else value
    return values


def describe_expert_node(node: onnx.NodeProto, layer: int, source: OnnxFile) -> ExpertNodeInfo:
    names = QMOE_INPUT_NAMES if node.op_type == "QMoE" else MOE_INPUT_NAMES
    activation_inputs, weight_inputs = {}, {}
    for position, tensor in enumerate(node.input):
        if not tensor:
            continue
        if position >= len(names):
            raise ModelFileError(f"{source.path}: node '{node.name}' has {len(node.input)} inputs; {node.op_type} takes {len(names)}")
        role = names[position]
        if role in ACTIVATION_INPUTS:
            activation_inputs[role] = tensor
        elif tensor in source.initializers:
            weight_inputs[role] = tensor
        else:
            raise ModelFileError(
                f"{source.path}: node '{node.name}' input '{role}' ('{tensor}') is computed, not a constant initializer")
    shapes = {role: None for role in QMOE_INPUT_NAMES}
    shapes.update({role: tuple(source.initializers[t].dims) for role, t in weight_inputs.items()})
    attributes = _attributes(node)
    try:
        spec, unsupported = QMoESpec.from_node(node.name, node.op_type, attributes, shapes), None
    except UnsupportedLayout as exc:
        spec, unsupported = None, str(exc)
    return ExpertNodeInfo(
        name=node.name, op_type=node.op_type, layer=layer, attributes=attributes,
        activation_inputs=activation_inputs, weight_inputs=weight_inputs, output=node.output[0],
        spec=spec, unsupported=unsupported,
        weight_bytes=sum(source.nbytes(t) for t in weight_inputs.values()))


class CpuExpertNode:
    """Runs one expert node on the CPU with the Numba kernels, reading mapped weights."""

    def __init__(self, info: ExpertNodeInfo, source: OnnxFile, threads: int | None = None):
        if info.spec is None:
            raise UnsupportedModelError(info.unsupported)
        self.info = info
        self.source = source
        self.in_memory = False
        self._build(threads)

    def _build(self, threads: int | None) -> None:
        from kernels.cpu.qmoe import CpuQMoE

        tensors = {role: None for role in QMOE_INPUT_NAMES}
        for role, name in self.info.weight_inputs.items():
            view = self.source.array(name)
            tensors[role] = np.array(view) if self.in_memory else view
        self.tensors = tensors  # mapped views (or RAM copies): a device copies experts from here
        self.kernel = CpuQMoE(self.info.spec, tensors, num_threads=threads)

    def set_file_backing(self, allowed: bool) -> None:
        """allow_file_backing=0 copies the node's experts into RAM; 1 reads them from the mapped file."""
        if self.in_memory == (not allowed):
            return
        self.in_memory = not allowed
        self._build(self.kernel.num_threads)

    def run(self, values: dict[str, np.ndarray]) -> np.ndarray:
        inputs = self.info.activation_inputs
        router_weights = values[inputs["router_weights"]] if "router_weights" in inputs else None
        return self.kernel.forward(values[inputs["input"]], values[inputs["router_probs"]], router_weights)
