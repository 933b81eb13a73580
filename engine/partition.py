"""Cut the graph at every expert node into dense segments that onnxruntime runs.

The plan is an ordered list of steps: a dense segment (a sub-graph of consecutive nodes) or an
expert node that our engine executes; first, where the graph has an attention mask, a segment on
the host of the lengths worked out from it (HOST_MASK_OPS). What crosses each cut (hidden states,
router logits, residual sums, mask lengths, position tensors, ...) is computed from the graph's
data flow; nothing is named per architecture. State inputs and outputs (KV cache, conv and recurrent state) stay in
the segment whose nodes read or write them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

EXPERT_OPS = {("com.microsoft", "QMoE"), ("com.microsoft", "MoE")}
# What a graph works out from its attention mask alone (genai's attn_mask_subgraph: ReduceSum - 1 -> seqlens_k,
# Shape[1] -> total_sequence_length), computed on the host in a segment of its own (Segment.on_host). On the GPU the
# mask's length grows at every decode step, so a segment that reads the mask is never replayed as a CUDA graph: with
# these nodes in it, the step's first segment ran eagerly in onnxruntime, ~250 µs a step with the GPU idle (H100,
# RESULTS.md sixty-first session). Other ops (a 4-D mask's Expand / Where, as large as the sequence squared) stay
# where they are.
HOST_MASK_OPS = frozenset({"ReduceSum", "Sub", "Add", "Cast", "Shape", "Gather", "Squeeze", "Unsqueeze", "Concat",
                           "Slice"})


def is_expert_node(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) in EXPERT_OPS


@dataclass
class Segment:
    """Consecutive dense nodes, run by one onnxruntime session."""
    index: int
    nodes: list[onnx.NodeProto]
    inputs: list[str] = field(default_factory=list)       # non-initializer tensors read from outside
    outputs: list[str] = field(default_factory=list)      # tensors later steps or the graph outputs need
    initializers: list[str] = field(default_factory=list)  # initializer names its nodes read
    on_host: bool = False  # runs on the CPU whatever device the dense part runs on (HOST_MASK_OPS)


@dataclass
class ExpertStep:
    """One QMoE/MoE node, run by our engine."""
    node: onnx.NodeProto
    layer: int  # position among the expert nodes


@dataclass
class Plan:
    steps: list[Segment | ExpertStep]

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]

    @property
    def expert_steps(self) -> list[ExpertStep]:
        return [s for s in self.steps if isinstance(s, ExpertStep)]


def node_reads(node: onnx.NodeProto) -> set[str]:
    """Every tensor a node reads, including outer-scope names used inside If/Loop/Scan bodies."""
    names = {name for name in node.input if name}
    for attr in node.attribute:
        bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for body in bodies:
            names |= _outer_scope_reads(body)
    return names


def _outer_scope_reads(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        reads |= node_reads(node) - defined
        defined |= set(node.output)
    return reads


def _topological_order(graph: onnx.GraphProto, initializers: set[str]) -> list[onnx.NodeProto]:
    available = {i.name for i in graph.input} | initializers | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        progressed = []
        for node in pending:
            if node_reads(node) <= available:
                ordered.append(node)
                available.update(node.output)
            else:
                progressed.append(node)
        if len(progressed) == len(pending):
            missing = sorted(node_reads(progressed[0]) - available)
            raise ValueError(f"node '{progressed[0].name}' reads {missing}, which no node produces")
        pending = progressed
    return ordered


def plan_partition(graph: onnx.GraphProto, initializers: set[str], mask: str | None = None) -> Plan:
    """Split the graph into alternating dense segments and expert steps, in execution order; first, where the graph
    has an attention mask input named `mask`, a segment on the host of what it works out from the mask alone."""
    ordered = _topological_order(graph, initializers)
    on_host = _mask_nodes(ordered, mask, initializers) if mask else []
    steps: list[Segment | ExpertStep] = [Segment(0, on_host, on_host=True)] if on_host else []
    hosted = {id(node) for node in on_host}
    current: list[onnx.NodeProto] = []
    experts = 0
    for node in ordered:
        if id(node) in hosted:
            continue
        if is_expert_node(node):
            if current:
                steps.append(Segment(len(steps), current))
                current = []
            steps.append(ExpertStep(node, experts))
            experts += 1
        else:
            current.append(node)
    if current:
        steps.append(Segment(len(steps), current))
    _wire(steps, graph, initializers)
    return Plan(steps)


def _mask_nodes(ordered: list[onnx.NodeProto], mask: str, initializers: set[str]) -> list[onnx.NodeProto]:
    """The nodes of HOST_MASK_OPS that read nothing but the mask, initializers and each other's outputs."""
    derived = {mask}
    chosen = []
    for node in ordered:
        reads = node_reads(node) - initializers
        if node.op_type in HOST_MASK_OPS and node.domain in ("", "ai.onnx") and reads and reads <= derived:
            chosen.append(node)
            derived.update(name for name in node.output if name)
    return chosen


def _wire(steps: list[Segment | ExpertStep], graph: onnx.GraphProto, initializers: set[str]) -> None:
    """Fill each segment's inputs, outputs and initializers from the data flow."""
    last_reader: dict[str, int] = {}
    for index, step in enumerate(steps):
        nodes = step.nodes if isinstance(step, Segment) else [step.node]
        for node in nodes:
            for name in node_reads(node):
                last_reader[name] = index
    graph_outputs = {o.name for o in graph.output}
    for index, step in enumerate(steps):
        if not isinstance(step, Segment):
            continue
        produced: list[str] = []
        reads: set[str] = set()
        for node in step.nodes:
            reads |= node_reads(node)
            produced.extend(o for o in node.output if o)
        produced_set = set(produced)
        step.inputs = sorted(r for r in reads - produced_set if r not in initializers)
        step.initializers = sorted(r for r in reads if r in initializers)
        step.outputs = [p for p in produced if p in graph_outputs or last_reader.get(p, -1) > index]
