"""Decode streaming slots: PCIe for the misses of layers that have no expert slot.

With a zero expert budget (or one too small to give every layer a slot) a layer's decode misses could only run on
the CPU, and anchors.md's bound for a miss, W / (B_dram + B_pcie), counts the PCIe link beside the CPU. So the engine
keeps a few device slots outside the expert budget, shared by every such layer: in a decode step the miss policy
(miss_policy.choose, no resident experts, no credit for later hits) copies the misses that shorten the step into
them, one launch computes them while the CPU computes the rest, and the next layer's copies overwrite them. Nothing
stays resident. They are device working memory, as the prefill staging ring is, and session.moe.offload.
device_working_bytes asks for them: up to a token's top-k slots per layout within those bytes. Off by default
('auto'): on the H200 machine they gained 1.05x at gpt-oss-20b-like's 0% and lost 1.1x at Qwen3-30B-A3B-like's
(benchmarks/RESULTS.md, eleventh session). Each copy and the launch cost the host 40-70 µs and ~100 µs a layer, all
before the CPU kernel starts, and the copies' DMA reads the same DRAM as the CPU kernel; they pay where the CPU is
slow against PCIe (fewer cores, or other work on them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.offload.config import OffloadConfig
from engine.offload.decode_path import PATH_WORDS
from engine.offload.device_memory import DeviceMemoryError
from engine.offload.planner import under_limit
from engine.units import counted, human_bytes


# The streaming slots serve decode steps that compute cold experts on the CPU: while decode reads them from the host
# tier (decode_path.py), the tier reads those of layers without slots too, and the sentences below say so. Where no
# decode step can compute them on the CPU (the tier's paths asked for), none is made (plan_streaming's `tier_path`).
ON_CPU = "Where decode computes cold experts on the CPU (not from a host tier)"


@dataclass
class StreamingPlan:
    by_layer: list                               # per expert node: its layout's streaming slots, or None
    groups: list = field(default_factory=list)   # the streaming slots made (one per layout), to close on re-plan
    statements: list[str] = field(default_factory=list)
    tier_path: str | None = None                 # plan_streaming's: the decode path it was made for

    def close(self) -> None:
        for group in self.groups:
            group.close()
        self.groups.clear()
        self.by_layer = [None] * len(self.by_layer)


def _layout_key(info) -> tuple:
    """Nodes whose experts one set of slots can hold: the same spec but for the name, the same tensor shapes."""
    return dataclasses.replace(info.spec, node_name=""), info.device_bytes_per_expert


def plan_streaming(config: OffloadConfig, runners, layer_slots: list[int], device,
                   tier_path: str | None = None) -> StreamingPlan:
    """Streaming slots, where device_working_bytes asks for them, for the nodes the GPU kernels run as stored (no
    conversion: the slots take one node's experts after another's) that got no expert slot, when misses may run on
    the CPU (cpu_execution disabled sends every miss through the prefill staging ring instead). Slots that do not fit
    in device_working_bytes or in the device's free memory are left out, with a statement; the CPU then computes
    those layers' misses. `tier_path` ("tier", "both"): the decode path every decode step takes, reading cold experts
    from a host tier made for it (decode_path.fixed_tier_path), so that no decode step copies a miss: no slot is
    made. None where decode may compute cold experts on the CPU: no tier, or trials that may choose the CPU path."""
    plan = StreamingPlan([None] * len(runners), tier_path=tier_path)
    if device is None or config.mode == "disabled" or config.cpu_execution == "disabled":
        return plan
    left = config.device_working_bytes
    wanted: dict[tuple, list[int]] = {}
    for index, (runner, slots) in enumerate(zip(runners, layer_slots)):
        info = runner.info
        if slots == 0 and info.gpu is not None and not info.gpu.conversion:
            wanted.setdefault(_layout_key(info), []).append(index)
    if tier_path is not None:
        if wanted and left is not None:
            layers = sum(len(indices) for indices in wanted.values())
            plan.statements.append(f"device_working_bytes={left} makes no decode streaming slots: under decode path "
                                   f"'{tier_path}' the cold experts of {counted(layers, 'layer')} without expert slots "
                                   f"are {PATH_WORDS[tier_path]}, none copied to the device.")
        return plan
    if wanted and left is None:
        layers = sum(len(indices) for indices in wanted.values())
        plan.statements.append(f"{ON_CPU}, the misses of {counted(layers, 'layer')} without expert slots run there; "
                               f"device_working_bytes would let some also go over PCIe (decode streaming slots).")
        return plan
    for indices in wanted.values():
        layer_count = counted(len(indices), "layer")
        runner = runners[indices[0]]
        slot_bytes = runner.info.device_bytes_per_expert
        count = min(runner.info.spec.k, left // slot_bytes, device.memory.available // slot_bytes)
        if count == 0:
            slot = f"streaming slot of {human_bytes(slot_bytes)}"
            if left < slot_bytes:
                why = f"device_working_bytes={config.device_working_bytes} holds no {slot}" + (
                    " beside the other layouts' slots" if left < config.device_working_bytes else "")
            else:
                free = human_bytes(device.memory.available)
                why = f"the device has {free} free{under_limit(device)}, less than a {slot}"
            plan.statements.append(f"{ON_CPU}, the misses of {layer_count} without expert slots run there only: "
                                   f"{why}.")
            continue
        try:
            group = device.create_streaming_slots(runner, count)
        except DeviceMemoryError as exc:
            plan.statements.append(f"{ON_CPU}, the misses of {layer_count} without expert slots run there only: "
                                   f"{exc}.")
            continue
        plan.groups.append(group)
        left -= count * slot_bytes
        for index in indices:
            plan.by_layer[index] = group
        plan.statements.append(f"{ON_CPU}, the misses of {layer_count} without expert slots may also be copied to "
                               f"the device, through {counted(count, 'shared streaming slot')} "
                               f"({human_bytes(count * slot_bytes)} of working memory), while the CPU computes the rest.")
    return plan
