"""An expert node (com.microsoft QMoE or MoE) of the graph, executed by our kernels."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

import numpy as np
import onnx

from engine.errors import ModelFileError, UnsupportedModelError
from engine.onnx_file import OnnxFile
from kernels.qmoe_spec import MOE_INPUT_NAMES, QMOE_INPUT_NAMES, QMoESpec, UnsupportedLayout

ACTIVATION_INPUTS = ("input", "router_probs", "router_weights")
_T = onnx.TensorProto
_FLOATS = {_T.FLOAT, _T.FLOAT16, _T.BFLOAT16}
_FP8 = {_T.FLOAT8E4M3FN, getattr(_T, "FLOAT8E8M0", _T.FLOAT8E4M3FN)}
# the data types qmoe.md's contract allows each weight input (by its name's ending); MoE's weights are all floats
_QMOE_TYPES = {"experts_weights": {_T.UINT8, _T.FLOAT8E4M3FN}, "scales": _FLOATS | _FP8 | {_T.UINT8},
               "experts_bias": _FLOATS, "zero_points": {_T.UINT8}, "global_scale": _FLOATS, "act_scale": _FLOATS,
               "act_block_scale": _FLOATS}
_INT_ATTRIBUTES = {"k", "normalize_routing_weights", "use_sparse_mixer", "expert_weight_bits", "fc1_expert_weight_bits",
                   "fc2_expert_weight_bits", "fc3_expert_weight_bits", "block_size", "weights_prepacked",
                   "swiglu_fusion", "swiglu_limit_after_activation", "accuracy_level"}
_FLOAT_ATTRIBUTES = {"activation_alpha", "activation_beta", "swiglu_limit"}  # swiglu_limit inf: no clamp
# the attributes onnxruntime 1.32's schemas give each op (contrib_defs): it refuses a model whose node has any other
# ("Unrecognized attribute"), and a misspelt or newer one would be run here as if absent
_KNOWN_ATTRIBUTES = {"MoE": {"activation_alpha", "activation_beta", "activation_type", "k", "normalize_routing_weights",
                             "swiglu_fusion", "swiglu_limit", "swiglu_limit_after_activation", "use_sparse_mixer"}}
_KNOWN_ATTRIBUTES["QMoE"] = _KNOWN_ATTRIBUTES["MoE"] | {
    "accuracy_level", "block_size", "expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits",
    "fc3_expert_weight_bits", "quant_type", "weights_prepacked"}
# flags onnxruntime reads as `== 1`: any other value is off there, where Python's truth would turn it on here
_FLAG_ATTRIBUTES = {"normalize_routing_weights", "use_sparse_mixer"}
GPU_MAX_EXPERTS = 2048  # kernels.gpu.qmoe.GpuQMoE refuses more (its grouping kernel)
# onnxruntime-genai's builder names a layer's nodes '/model/layers.12/moe/QMoE' (and our writer does too)
_MODEL_LAYER = re.compile(r"(?:^|/)layers\.(\d+)/")
KEPT_OUTPUT_TOKENS = 8  # CpuExpertNode reuses its output buffer for steps of at most this many tokens (decode)


@dataclass(frozen=True)
class GpuFootprint:
    """One expert of a node in the GPU kernels' layout (kernels/gpu), after the exact host conversion of layouts
    they do not read as stored (kernels.gpu.convert: int2 / int3 -> int4, SM80 -> raw, mixed widths -> the
    widest, nvfp4 / mxfp4 -> int8). Computed without CuPy, the same on the CUDA and the simulated device."""
    slot_bytes: int   # device memory one slot takes (kernel layout + the fp16 block-scale copy the prefill reads):
                      # convert.gpu_expert_bytes(resident=True); also what a load into a slot copies (pack_expert)
    read_bytes: int   # what the kernels read of one expert (decode streams it from HBM): gpu_expert_bytes()
    wave_bytes: int   # what a prefill wave copies per expert: its (converted) rows before the tile layout
    conversion: str   # "" when the kernels read the stored layout, else what is converted into what
    tier_rows: tuple[int, ...] = ()  # one slot's bytes in each of the kernels' slot arrays (they add up to slot_bytes)

    def tier_device_bytes(self, slots: int) -> int:
        """Device memory `slots` slots take with the host tier, as CudaSlots reserves it: each slot array's device
        rows rounded up to the mapping granule (kernels.gpu.host_tier.tier_device_bytes)."""
        from kernels.gpu.host_tier import tier_device_bytes

        return tier_device_bytes(slots, list(self.tier_rows))


@dataclass
class ExpertNodeInfo:
    """What the graph says about one expert node: its attributes, weights and whether we run it."""
    name: str
    op_type: str
    layer: int                         # its position among the graph's expert nodes (what the engine indexes by)
    attributes: dict
    activation_inputs: dict[str, str]  # "input" / "router_probs" / "router_weights" -> tensor name
    weight_inputs: dict[str, str]      # contract input name -> initializer name
    output: str
    spec: QMoESpec | None
    unsupported: str | None            # why our kernels can't run it, or None
    weight_bytes: int
    gpu: GpuFootprint | None = None    # its experts in the GPU kernels' layout; None when the GPU cannot run it
    gpu_unsupported: str | None = None  # why the GPU kernels cannot run the node (it runs on the CPU), or None

    @property
    def model_layer(self) -> int:
        """The model's decoder layer the node belongs to, as its name says, for what users read: a model whose first
        layers are dense (LFM2-MoE) has its first expert node in layer 1 or 2, not 0. Its position among the expert
        nodes where the name does not say."""
        found = _MODEL_LAYER.search(self.name)
        return int(found.group(1)) if found else self.layer

    @property
    def bytes_per_expert(self) -> int:
        """One expert as stored (host memory, the mapped file, what the CPU kernels read)."""
        return self.weight_bytes // self.spec.num_experts if self.spec else 0

    @property
    def flops_per_token(self) -> int:
        """FLOPs of one token through one expert (a multiply and an add per weight): the CPU's compute term in the
        miss policy's cost model (miss_policy.py)."""
        return 2 * sum(n * k for _name, n, k, _bits in self.spec.projections) if self.spec else 0

    @property
    def device_bytes_per_expert(self) -> int:
        """What one device slot of this node takes (GpuFootprint.slot_bytes); 0 when the GPU cannot run it."""
        return self.gpu.slot_bytes if self.gpu is not None else 0


def gpu_footprint(spec: QMoESpec, tensors: dict) -> GpuFootprint:
    """The GPU layout of one expert of ``spec`` (kernels.gpu.convert / layout, no CuPy). ``tensors`` may be the
    node's arrays or stand-ins of their shape and dtype (values are not read). Raises UnsupportedLayout, with the
    reason, for a node the GPU kernels refuse (fp8 weights, the float MoE op, geglu / relu2, too many experts)."""
    from kernels.gpu import convert, layout

    if spec.num_experts > GPU_MAX_EXPERTS:
        raise UnsupportedLayout(f"node '{spec.node_name}': {spec.num_experts} experts (the GPU kernels take "
                                f"<= {GPU_MAX_EXPERTS})")
    conv = convert.for_gpu(spec, tensors)
    layout.check_supported(conv.spec)  # the float MoE op passes for_gpu unconverted and is refused here
    fc1, fc2 = layout.make_layouts(conv.spec, conv.tensors)
    E = spec.num_experts
    wave = 0
    for proj in ("fc1", "fc2", "fc3"):
        for role in (f"{proj}_experts_weights", f"{proj}_scales", f"{proj}_zero_points", f"{proj}_experts_bias"):
            t = conv.tensors.get(role)
            if t is not None and t.ndim >= 1 and t.shape[0] == E:
                wave += t.nbytes // E
    return GpuFootprint(slot_bytes=fc1.device_bytes() + fc2.device_bytes(), read_bytes=fc1.slot_bytes() + fc2.slot_bytes(),
                        wave_bytes=wave, conversion=conv.note if conv.converted else "",
                        tier_rows=tuple(fc1.row_bytes() + fc2.row_bytes()))


def _stand_in(tensor: onnx.TensorProto) -> np.ndarray:
    """A read-only array of the initializer's shape and dtype that holds no memory (values all zero)."""
    return np.broadcast_to(np.zeros((), OnnxFile.tensor_dtype(tensor)), tuple(tensor.dims))


def _gpu_verdict(spec: QMoESpec | None, weight_inputs: dict, source: OnnxFile):
    """(GpuFootprint, None) or (None, why the GPU cannot run the node)."""
    if spec is None:
        return None, None  # the CPU cannot run it either: info.unsupported says why
    tensors = {role: None for role in QMOE_INPUT_NAMES}
    try:
        tensors.update({role: _stand_in(source.initializers[t]) for role, t in weight_inputs.items()})
        return gpu_footprint(spec, tensors), None
    except UnsupportedLayout as exc:
        return None, str(exc)
    except (ValueError, TypeError, KeyError) as exc:  # a layout the GPU code cannot even size: the CPU runs it
        return None, f"node '{spec.node_name}': the GPU layout of {spec.layout_summary()} cannot be built ({exc})"


def _attributes(node: onnx.NodeProto) -> dict:
    values = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        values[attr.name] = value.decode() if isinstance(value, bytes) else value
    return values


def _check_contract(node: onnx.NodeProto, attributes: dict, weight_inputs: dict, source: OnnxFile) -> None:
    """The node's attributes of the types and its weights of the data types the contract gives them: a scale stored
    as int32 or codes as int8 would otherwise be read as floats or codes they are not, and answer garbage."""
    for name, value in attributes.items():
        known = _KNOWN_ATTRIBUTES[node.op_type]
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            raise ModelFileError(f"{source.path}: node '{node.name}' has attribute '{name}', which {node.op_type} does "
                                 "not have (onnxruntime refuses the model)"
                                 + (f": did you mean '{near[0]}'?" if near else ""))
        if name in _INT_ATTRIBUTES and not isinstance(value, int):
            raise ModelFileError(f"{source.path}: node '{node.name}' attribute {name}={value!r} is not an integer")
        if name in _FLAG_ATTRIBUTES and value not in (0, 1):
            raise ModelFileError(f"{source.path}: node '{node.name}' attribute {name}={value!r} is neither 0 nor 1")
        if name in _FLOAT_ATTRIBUTES and not (isinstance(value, (int, float))
                                              and (math.isfinite(value) or name == "swiglu_limit")):
            raise ModelFileError(f"{source.path}: node '{node.name}' attribute {name}={value!r} is not a finite number")
        # the contract clamps to [-limit, limit]: a negative or NaN bound clamps nothing onnxruntime defines
        if name == "swiglu_limit" and not value >= 0:
            raise ModelFileError(f"{source.path}: node '{node.name}' attribute swiglu_limit={value!r} is not a "
                                 "number from 0 up (inf: no clamp)")
    for role, tensor in weight_inputs.items():
        data_type = source.initializers[tensor].data_type
        allowed = _FLOATS if node.op_type == "MoE" else next(
            types for ending, types in _QMOE_TYPES.items() if role.endswith(ending))
        if data_type not in allowed:
            names = sorted(onnx.helper.tensor_dtype_to_string(t).removeprefix("TensorProto.").lower() for t in allowed)
            raise ModelFileError(f"{source.path}: node '{node.name}' input {role} ('{tensor}') is "
                                 f"{onnx.helper.tensor_dtype_to_string(data_type).removeprefix('TensorProto.').lower()}"
                                 f"; {node.op_type} takes {' or '.join(names)}")


def describe_expert_node(node: onnx.NodeProto, layer: int, source: OnnxFile) -> ExpertNodeInfo:
    names = QMOE_INPUT_NAMES if node.op_type == "QMoE" else MOE_INPUT_NAMES
    activation_inputs, weight_inputs = {}, {}
    for position, tensor in enumerate(node.input):
        if not tensor:
            continue
        if position >= len(names):
            raise ModelFileError(f"{source.path}: node '{node.name}' has {len(node.input)} inputs; {node.op_type} takes {len(names)}")
        role = names[position]
        if role in ACTIVATION_INPUTS and tensor in source.initializers:  # the engine hands a node what the graph computes
            raise ModelFileError(f"{source.path}: node '{node.name}' input '{role}' ('{tensor}') is a constant "
                                 f"initializer; MoE Workbench runs {node.op_type} nodes whose {', '.join(ACTIVATION_INPUTS)} "
                                 "the graph computes")
        if role in ACTIVATION_INPUTS:
            activation_inputs[role] = tensor
        elif tensor in source.initializers:
            weight_inputs[role] = tensor
        else:
            raise ModelFileError(
                f"{source.path}: node '{node.name}' input '{role}' ('{tensor}') is computed, not a constant initializer")
    shapes = {role: None for role in QMOE_INPUT_NAMES}
    shapes.update({role: tuple(source.initializers[t].dims) for role, t in weight_inputs.items()})
    # what the graph says the dense part hands the node: weights made for another hidden size or expert count would
    # read its activations as other rows than they are
    shapes.update({role: source.declared_shape(t) for role, t in activation_inputs.items()})
    attributes = _attributes(node)
    _check_contract(node, attributes, weight_inputs, source)
    try:
        spec, unsupported = QMoESpec.from_node(node.name, node.op_type, attributes, shapes), None
    except UnsupportedLayout as exc:
        spec, unsupported = None, str(exc)
    gpu, gpu_unsupported = _gpu_verdict(spec, weight_inputs, source)
    return ExpertNodeInfo(
        name=node.name, op_type=node.op_type, layer=layer, attributes=attributes,
        activation_inputs=activation_inputs, weight_inputs=weight_inputs, output=node.output[0],
        spec=spec, unsupported=unsupported,
        weight_bytes=sum(source.nbytes(t) for t in weight_inputs.values()),
        gpu=gpu, gpu_unsupported=gpu_unsupported)


class CpuExpertNode:
    """Runs one expert node on the CPU with the Numba kernels, reading mapped weights."""

    def __init__(self, info: ExpertNodeInfo, source: OnnxFile, threads: int | None = None):
        if info.spec is None:
            raise UnsupportedModelError(info.unsupported)
        self.info = info
        self.source = source
        self.in_memory = False
        self._out: np.ndarray | None = None       # the decode-sized output, reused at every step (run)
        self._out_view: np.ndarray | None = None  # ... and the view of it returned
        self._activations_fit = False  # check_activations found them of the weights' sizes
        self._build(threads)

    def check_activations(self, x, logits) -> None:
        """Refuse, naming the node, activations of another hidden size or expert count than its weights: read as rows
        of the weights' sizes they answer garbage, and the kernels index past the routing. ModelFolder.open checks
        the shapes the graph declares; this, at the node's first step, those it does not (the sizes never change)."""
        if self._activations_fit:
            return
        spec, inputs = self.info.spec, self.info.activation_inputs
        where = f"{self.source.path}: node '{self.info.name}'"
        if x.shape[-1] != spec.hidden_size:
            raise ModelFileError(f"{where} input '{inputs['input']}' has {x.shape[-1]} values a token; its weights take "
                                 f"hidden size {spec.hidden_size}")
        tokens = x.size // spec.hidden_size
        if logits.size != tokens * spec.num_experts:
            raise ModelFileError(f"{where} router_probs '{inputs['router_probs']}' has shape {tuple(logits.shape)} for "
                                 f"{tokens} tokens; its weights have {spec.num_experts} experts")
        self._activations_fit = True

    def _build(self, threads: int | None) -> None:
        from kernels.cpu.qmoe import CpuQMoE
        from kernels.cpu.routing import route

        self._route = route

        tensors = {role: None for role in QMOE_INPUT_NAMES}
        for role, name in self.info.weight_inputs.items():
            view = self.source.array(name)
            tensors[role] = np.array(view) if self.in_memory else view
        kernel = CpuQMoE(self.info.spec, tensors, num_threads=threads)
        self.tensors = tensors  # mapped views (or RAM copies): a device copies experts from here
        self.kernel = self._own_kernel = kernel

    def set_file_backing(self, allowed: bool) -> None:
        """allow_file_backing=0 copies the node's experts into RAM; 1 reads them from the mapped file. A copy that
        fails (host memory, a read of the file) leaves the node as it was."""
        if self.in_memory == (not allowed):
            return
        self.in_memory = not allowed
        try:
            self._build(self.kernel.num_threads)
        except BaseException:
            self.in_memory = allowed
            raise

    def release_file_pages(self) -> None:
        """Let the OS drop this node's mapped expert pages from the process (read back from the file if touched)."""
        for name in self.info.weight_inputs.values():
            self.source.release_pages(name, 0, self.source.nbytes(name))

    def run(self, values: dict[str, np.ndarray]) -> np.ndarray:
        inputs = self.info.activation_inputs
        router_weights = values[inputs["router_weights"]] if "router_weights" in inputs else None
        kernel = self.kernel
        x = values[inputs["input"]]
        self.check_activations(x, values[inputs["router_probs"]])
        if kernel is not self._own_kernel or x.dtype != np.float32:  # a stand-in kernel (tests), or fp16 activations
            return kernel.forward(x, values[inputs["router_probs"]], router_weights)
        # CpuQMoE.forward with the output kept: a decode step's is one buffer per node, returned (as the same view)
        # at every step, so the next dense segment finds the very array it bound at the last step and does not bind
        # it again (as HybridExpertNode._output). A result lives until this node's next run: the decoder reads it
        # within the step. Prefill-sized outputs are new arrays.
        spec = kernel.spec
        x2 = x.reshape(-1, spec.hidden_size)
        ids, weights = self._route(values[inputs["router_probs"]], spec, router_weights)
        tokens = x2.shape[0]
        if tokens > KEPT_OUTPUT_TOKENS:
            out = np.zeros((tokens, spec.hidden_size), np.float32)
            kernel.run_experts(x2, ids, weights, out=out)
            return out.reshape(x.shape)
        out = self._out
        if out is None or out.shape[0] != tokens:
            out = self._out = np.zeros((tokens, spec.hidden_size), np.float32)
            self._out_view = None
        else:
            out.fill(0.0)
        kernel.run_experts(x2, ids, weights, out=out)
        view = self._out_view
        if view is None or view.shape != x.shape:
            view = self._out_view = out.reshape(x.shape)
        return view
