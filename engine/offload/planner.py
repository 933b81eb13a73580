"""From budgets to slots: how many experts of each node live on the device, and why."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from engine.errors import WorkbenchError
from engine.expert_node import ExpertNodeInfo
from engine.offload.config import OffloadConfig
from engine.offload.device_memory import ARENA_BUDGET_HINT, DENSE_RESERVATION, SHARED_ARENA_HINT
from engine.units import counted, human_bytes
from kernels.gpu.host_tier import TIER_GRANULE

# Kept free for KV cache, state and workspace when the automatic budget is computed and the user
# gave no reserve_device_bytes: a tenth of the device, at least 512 MiB.
AUTO_RESERVE_FRACTION = 0.10
AUTO_RESERVE_MIN = 512 << 20


class OffloadPlanError(WorkbenchError):
    """A configuration that cannot be honoured (required mode, a budget too small)."""


class DeviceShort(OffloadPlanError):
    """What the device has free, not the configuration alone, is too little: another model or process holding part of
    the device (side by side's A) can be why."""


class BudgetAboveFree(DeviceShort):
    """Under mode=required, a budget above the `available` bytes the device has free (the other modes hold those)."""

    def __init__(self, message: str, available: int):
        super().__init__(message)
        self.available = available


@dataclass
class OffloadPlan:
    placement_mode: str                  # "cpu_only", "all_resident" or "hybrid"
    budget_bytes: int
    slots: dict[str, int] = field(default_factory=dict)   # node name -> slots
    statements: list[str] = field(default_factory=list)   # plain sentences for the user
    # what the device had free as the budget was set (an automatic budget is this less reserve_device_bytes); 0: no
    # device, or offload disabled
    free_bytes: int = 0

    @property
    def leaves_cold(self) -> bool:
        """Whether some expert has no slot (its misses go to the CPU, the host tier or a prefill wave)."""
        return self.placement_mode != "all_resident"

    def device_bytes(self, experts: list[ExpertNodeInfo], host_tier: bool = False) -> int:
        """Device memory of the planned slots (slots_device_bytes)."""
        return slots_device_bytes(experts, self.slots, host_tier)


def slots_device_bytes(experts: list[ExpertNodeInfo], slots: dict[str, int], host_tier: bool = False) -> int:
    """Device memory of `slots` per node, each the size of an expert in the GPU kernels' layout; with the host tier,
    what a device reserves for its mappings instead: every node the GPU runs maps each of its slot arrays, rounded up
    to the mapping granule, even without slots (GpuFootprint.tier_device_bytes)."""
    if host_tier:
        return sum(info.gpu.tier_device_bytes(slots.get(info.name, 0)) for info in experts if info.gpu is not None)
    return sum(slots.get(info.name, 0) * info.device_bytes_per_expert for info in experts)


def all_resident_bytes(experts: list[ExpertNodeInfo]) -> int:
    """The expert budget that holds every expert the GPU kernels can run (device slot sizes, converted layouts
    included): a budget sweep's 100% point. More than the stored expert bytes (ModelFolder.expert_bytes)."""
    return sum(info.device_bytes_per_expert * info.spec.num_experts for info in experts if info.gpu is not None)


def whole_layers_held(experts: list[ExpertNodeInfo], budget: int) -> int:
    """How many expert layers `budget` holds whole, filled in layer order as plan_offload(whole_layers=True) fills
    them (without node_overrides; nodes the GPU kernels cannot run are left out)."""
    held = spent = 0
    for info in sorted((i for i in experts if i.gpu is not None), key=lambda i: i.layer):
        need = info.device_bytes_per_expert * info.spec.num_experts
        if spent + need <= budget:
            spent += need
            held += 1
    return held


def split_choosable(config: OffloadConfig, plan: OffloadPlan, experts: list[ExpertNodeInfo]) -> int:
    """Whether the budget spread over every layer and on whole layers are two plans to choose between (the layer
    split's trials, layer_split.py): a hybrid plan under adaptive placement with the CPU computing misses and no node
    placed by the user (node_overrides). Returns how many layers the budget holds whole, 0 where there is no choice."""
    if (config.mode == "disabled" or config.placement != "adaptive" or config.cpu_execution == "disabled"
            or config.node_overrides or plan.placement_mode != "hybrid"):
        return 0
    return whole_layers_held(experts, plan.budget_bytes)


def automatic_budget(config: OffloadConfig, available: int) -> int:
    reserve = config.reserve_device_bytes
    if reserve is None:
        reserve = max(AUTO_RESERVE_MIN, int(AUTO_RESERVE_FRACTION * available))
    return max(0, available - reserve)


def expert_room(config: OffloadConfig, device) -> int:
    """What the expert slots, with the host tier its mappings, may take of `device` now: its free memory, less the
    reserve for KV cache and workspace where the budget is automatic (reserve_device_bytes applies to that only)."""
    available = device.memory.available
    if config.device_expert_bytes is not None:
        return available
    # a dense part the load put on the device holds what the reserve kept for it (DENSE_RESERVATION): a re-plan
    # counts it as that reserve, not beside it
    return min(available, automatic_budget(config, available + device.memory.by_purpose.get(DENSE_RESERVATION, 0)))


def tier_mapping_excess(experts: list[ExpertNodeInfo]) -> int:
    """The most the host tier's device mappings take beyond their slots' bytes: each slot array rounded up to the
    mapping granule, and a node without slots still mapping one (GpuFootprint.tier_device_bytes)."""
    return sum(len(info.gpu.tier_rows) * TIER_GRANULE + info.device_bytes_per_expert
               for info in experts if info.gpu is not None)


def _limit_bounds(device) -> int:
    """gpu_device_mem_limit where it, not the device's memory, bounds what the device has free; else 0."""
    memory = device.memory
    return memory.limit if memory.limit and memory.limit < memory.capacity else 0


def under_limit(device) -> str:
    """' under gpu_device_mem_limit=N' where that limit bounds what the device has free; else ''."""
    limit = _limit_bounds(device)
    return f" under gpu_device_mem_limit={limit}" if limit else ""


def _limit_without_effect(device) -> list[str]:
    """A gpu_device_mem_limit above what the device has for this process bounds nothing: said so (a sentence in a
    list), naming the card's memory where the limit is more than that."""
    memory = device.memory
    if memory.limit <= memory.capacity:
        return []
    limit, card = f"gpu_device_mem_limit={human_bytes(memory.limit)} is more than", memory.card or memory.capacity
    if memory.limit >= card:
        return [f"{limit} the card's {human_bytes(card)} of memory: it has no effect."]
    return [f"{limit} the {human_bytes(memory.capacity)} the card has free for this process (other processes hold "
            f"{human_bytes(card - memory.capacity)}): the free memory bounds the plan, not the limit."]


def _reserve_left(device, available: int, budget: int) -> str:
    """Why the automatic budget is `budget`: what the reserve kept of the device's free memory."""
    remedies = "a smaller reserve, a device_expert_bytes or a larger gpu_device_mem_limit" if _limit_bounds(device) \
        else "a smaller reserve or a device_expert_bytes"
    return (f"of the {human_bytes(available)} the device has free{under_limit(device)} it keeps "
            f"{human_bytes(available - budget)} for KV cache and workspace (reserve_device_bytes); set {remedies}")


def _layers(infos: list[ExpertNodeInfo]) -> str:
    layers = [info.model_layer for info in infos]
    return f"layer {layers[0]}" if len(layers) == 1 else "layers " + ", ".join(str(layer) for layer in layers)


def _by_reason(infos: list[ExpertNodeInfo], reason_of) -> dict[str, list[ExpertNodeInfo]]:
    """Nodes grouped by a reason with their own name taken out ("node 'x': ..."), in layer order."""
    groups: dict[str, list[ExpertNodeInfo]] = {}
    for info in infos:
        groups.setdefault(reason_of(info).replace(f"node '{info.name}': ", ""), []).append(info)
    return groups


def _gpu_refusal(info: ExpertNodeInfo) -> str:
    """Why the GPU kernels cannot run the node, without the closing "(this node runs on the CPU)"."""
    return info.gpu_unsupported.removesuffix(" (this node runs on the CPU)")


def _names(infos: list[ExpertNodeInfo]) -> str:
    return ("node " if len(infos) == 1 else "nodes ") + ", ".join(f"'{info.name}'" for info in infos)


def gpu_statements(experts: list[ExpertNodeInfo]) -> list[str]:
    """Where the GPU layout decides something: nodes the GPU kernels refuse (they run all on the CPU) and layouts
    converted on upload (a device slot then takes more than the stored expert)."""
    statements = []
    refused = [info for info in experts if info.spec is not None and info.gpu_unsupported]
    for reason, infos in _by_reason(refused, _gpu_refusal).items():
        who = f"Expert node '{infos[0].name}' ({_layers(infos)})" if len(infos) == 1 else \
            f"{len(infos)} expert nodes ({_layers(infos)})"
        statements.append(f"{who} run{'s' if len(infos) == 1 else ''} all on the CPU, because the GPU kernels "
                          f"cannot run {'it' if len(infos) == 1 else 'them'}: {reason.rstrip('.')}.")
    converted = [info for info in experts if info.gpu is not None and info.gpu.conversion]
    for note, infos in _by_reason(converted, lambda info: info.gpu.conversion).items():
        info = infos[0]
        statements.append(f"Experts of {_layers(infos)} are converted for the GPU kernels on upload ({note}): a device "
                          f"slot takes {human_bytes(info.device_bytes_per_expert)} per expert, "
                          f"{info.device_bytes_per_expert / max(1, info.bytes_per_expert):.2f}x the stored "
                          f"{human_bytes(info.bytes_per_expert)}.")
    return statements


def _check_substitution_rank(config: OffloadConfig, experts: list[ExpertNodeInfo]) -> None:
    """Tail substitution's lowest rank must be one a node routes (0 <= rank < k), as onnxruntime checks per node."""
    if config.tail_substitution_threshold <= 0:
        return
    rank = config.tail_substitution_min_rank
    for info in experts:
        if info.spec is not None and rank >= info.spec.k:
            routed = f"{info.spec.k} expert" + ("s" if info.spec.k > 1 else "")
            raise OffloadPlanError(f"tail_substitution_min_rank={rank}: node '{info.name}' routes {routed} a token "
                                   f"(ranks 0 to {info.spec.k - 1}), so no rank from {rank} on is "
                                   f"there to substitute (onnxruntime refuses it while tail_substitution_threshold "
                                   f"is set)")


def _plan_beside_dense(config: OffloadConfig, experts: list[ExpertNodeInfo], device) -> OffloadPlan:
    """mode=disabled with the dense part on the device: every expert there too, as onnxruntime runs a QMoE node whole
    on its execution provider when offload is off; the budgets do not apply, only what the device has free beside
    the reserve for KV cache and workspace (a model that does not fit needs mode=auto, which offloads)."""
    runnable = [info for info in experts if info.gpu is not None]
    need = all_resident_bytes(runnable)
    room = automatic_budget(config, device.memory.available)
    if need > room:
        raise DeviceShort(
            f"offload mode 'disabled' keeps every expert where the dense part runs, on the {device.name}: they need "
            f"{human_bytes(need)}, and {human_bytes(room)} is free beside the reserve for KV cache and workspace "
            "(reserve_device_bytes); mode=auto keeps the experts that do not fit on the CPU")
    slots = {info.name: info.spec.num_experts if info.gpu is not None else 0 for info in experts}
    resident, total = sum(slots.values()), sum(info.spec.num_experts for info in experts if info.spec is not None)
    statements = [f"All {resident} of {total} experts resident on the {device.name}, where the dense part runs "
                  f"({human_bytes(need)}): offload is disabled, so the expert budgets do not apply."]
    statements += gpu_statements(experts) + _exact_routing_statement(config)
    return OffloadPlan("all_resident" if resident == total else "hybrid", need, slots, statements)


# what mode=disabled says in place of the arena checks' hints, which name the expert budgets
_DISABLED_ROOM = "raise gpu_device_mem_limit, or use mode=auto, which keeps the experts that do not fit on the CPU"
_DISABLED_HINTS = {ARENA_BUDGET_HINT: f": {_DISABLED_ROOM}",
                   SHARED_ARENA_HINT: f": {_DISABLED_ROOM}, or restart and load this model first"}


def dense_cpu_words(dense_cpu: str, mode: str) -> str:
    """Why the dense part runs on the CPU, as offload `mode` says it: the arena checks' hints name the expert budgets,
    which do not apply under mode=disabled (every expert goes beside the dense part); there a larger limit or
    mode=auto frees the room."""
    if mode == "disabled":
        for hint, disabled in _DISABLED_HINTS.items():
            if dense_cpu.endswith(hint):
                return dense_cpu.removesuffix(hint) + disabled
    return dense_cpu


def _exact_routing_statement(config: OffloadConfig) -> list[str]:
    """Under mode=disabled, the approximate routing settings given, which do not apply (as a one-sentence list)."""
    idle = config.idle_routing_settings()
    if not idle:
        return []
    verb = "does" if len(idle) == 1 else "do"
    return [f"Routing is exact: offload is disabled, so approximate routing's {', '.join(idle)} {verb} not apply."]


def _tier_mapping_statement(config: OffloadConfig, runnable: list[ExpertNodeInfo], slots: dict[str, int], device,
                            host_tier: bool) -> list[str]:
    """The device memory the host tier's mappings take with `slots` (as a one-sentence list), where the tier will be
    made (decode_path.tier_verdict: some expert cold, room on `device` for its mappings): more than the slots' bytes,
    and a granule per slot array even at a budget of 0."""
    if not host_tier or all(slots[info.name] >= info.spec.num_experts for info in runnable):
        return []
    need = slots_device_bytes(runnable, slots, host_tier=True)
    if need > expert_room(config, device):
        return []  # no tier is made (decode_path._device_refusal says why)
    return [f"With the host tier, the expert slots take {human_bytes(need)} of device memory: each slot array's device "
            f"rows are mapped rounded up to the {human_bytes(TIER_GRANULE)} granule, one granule even without slots."]


def plan_offload(config: OffloadConfig, experts: list[ExpertNodeInfo], device,
                 whole_layers: bool = False, dense_on_device: bool = False, host_tier: bool = False,
                 dense_cpu: str | None = None) -> OffloadPlan:
    """The slots of every expert node for `config` on `device`. The budget is spread evenly over the layers; with
    `whole_layers` it goes to whole layers instead, in layer order (layer_split.py: the engine measures which of the
    two decodes faster). Under mode=disabled every expert goes where the dense part runs: on the device where
    `dense_on_device` (onnxruntime's CUDA execution provider runs it there), else on the CPU, the plan naming why the
    dense part runs there where `dense_cpu` says (ort_env.dense_cpu_reason, DenseDevice.reason). `host_tier`: the decode
    path plans one (decode_path.tier_planned), whose granule-rounded mappings an automatic budget leaves room for
    beside its slots, so that the reserve stays free."""
    names = [info.name for info in experts]
    for name in config.node_overrides:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            raise OffloadPlanError(f"node_overrides names '{name}', which is no expert node of this model"
                                   + (f" (did you mean '{near[0]}'?)" if near else f" (they are {', '.join(names)})"))
    if config.mode != "disabled":  # approximate routing applies, on the CPU alone too
        _check_substitution_rank(config, experts)
    if config.mode == "disabled" and device is not None and dense_on_device:
        return _plan_beside_dense(config, experts, device)
    if device is None or config.mode == "disabled":
        if config.mode == "required":
            raise OffloadPlanError("offload mode 'required' needs a GPU device (a simulated GPU or the CUDA GPU)")
        dense = f" ({dense_cpu_words(dense_cpu, config.mode)})" if dense_cpu else ""
        why = ("offload is disabled, and the dense part runs on the CPU" + dense if config.mode == "disabled"
               else "no GPU device is in use")
        return OffloadPlan("cpu_only", 0, {info.name: 0 for info in experts},
                           [f"All experts run on the CPU: {why}."] + _exact_routing_statement(config))
    # Whether the GPU kernels run a node is decided here, the same on the CUDA and the simulated device
    # (ExpertNodeInfo.gpu_unsupported: kernels.gpu.convert / layout, no CuPy); slots are sized in the GPU layout.
    refused = [info for info in experts if info.spec is not None and info.gpu_unsupported]
    if config.mode == "required" and refused:
        raise OffloadPlanError("offload mode 'required': " + "; ".join(
            f"the GPU kernels cannot run {_names(infos)}: {reason}"
            for reason, infos in _by_reason(refused, _gpu_refusal).items()))
    runnable = [info for info in experts if info.gpu is not None]

    available = free = device.memory.available
    tier_room = 0  # what an automatic budget leaves to the host tier's mappings beyond their slots
    if config.device_expert_bytes is not None:
        budget = config.device_expert_bytes
    else:
        free = available + device.memory.by_purpose.get(DENSE_RESERVATION, 0)
        budget = expert_room(config, device)
        # with the host tier, its mappings beside the slots within the room too, where a tier is made: some expert
        # left cold, and room for its mappings without slots (else decode_path._device_refusal refuses it)
        if (host_tier and budget < all_resident_bytes(runnable)
                and slots_device_bytes(runnable, {}, host_tier=True) <= budget):
            tier_room = min(budget, tier_mapping_excess(runnable))
            budget -= tier_room
    clamped = budget > available
    if clamped:
        if config.mode == "required":
            raise BudgetAboveFree(f"offload mode 'required': device_expert_bytes={budget} exceeds the "
                                  f"{human_bytes(available)} ({available} bytes) the device has "
                                  f"free{under_limit(device)}", available)
        budget = available
    limits, too_small = {}, []  # too_small: the nodes whose override's bytes hold no expert
    for info in runnable:
        override = config.node_overrides.get(info.name)
        cap = info.spec.num_experts
        if override and override.max_resident_slots is not None:
            cap = min(cap, override.max_resident_slots)
        if override and override.device_expert_bytes is not None:
            cap = min(cap, override.device_expert_bytes // max(1, info.device_bytes_per_expert))
            if override.device_expert_bytes < info.device_bytes_per_expert:
                too_small.append(f"node '{info.name}' device_expert_bytes={override.device_expert_bytes}, less than "
                                 f"one of its experts on the device ({info.device_bytes_per_expert} bytes)")
        limits[info.name] = cap
    if too_small and config.mode == "required":
        raise OffloadPlanError(f"offload mode 'required': node_overrides give {'; '.join(too_small)}")

    smallest = min((i.device_bytes_per_expert for i in runnable), default=0)
    if config.mode == "required" and budget < smallest:
        automatic = config.device_expert_bytes is None
        raise (DeviceShort if automatic else OffloadPlanError)(
            f"offload mode 'required': the {'automatic ' if automatic else ''}expert budget of {budget} bytes holds no "
            f"expert (the smallest needs {smallest} bytes on the device)"
            + (f": {_reserve_left(device, available, budget + tier_room)}" if automatic else ""))
    slots = {info.name: 0 for info in experts}
    spent = 0
    if whole_layers:
        # Every expert of a layer while the layer fits: those layers run all on the GPU, the others all on the CPU
        # (as llama.cpp's --n-cpu-moe); what is left over stays unspent.
        for info in sorted(runnable, key=lambda i: i.layer):
            need = limits[info.name] * info.device_bytes_per_expert
            if limits[info.name] == info.spec.num_experts and spent + need <= budget:
                slots[info.name] = limits[info.name]
                spent += need
        if config.mode == "required" and runnable and not spent:
            layer = min(info.device_bytes_per_expert * info.spec.num_experts for info in runnable)
            raise OffloadPlanError(f"offload mode 'required': the expert budget of {budget} bytes holds no whole layer "
                                   f"(the smallest needs {layer} bytes on the device); the layer split 'spread' "
                                   "places the budget expert by expert")
    # Even slot counts across layers (each token visits every layer), then leftovers layer by layer.
    grew = not whole_layers
    while grew:
        grew = False
        for info in runnable:
            size = info.device_bytes_per_expert
            if slots[info.name] < limits[info.name] and spent + size <= budget:
                slots[info.name] += 1
                spent += size
                grew = True
    total_experts = sum(info.spec.num_experts for info in experts if info.spec is not None)
    resident = sum(slots.values())
    mode = "all_resident" if resident == total_experts else "hybrid"
    # slots, not residents, where some experts stay cold: adaptive placement may leave slots to copied misses
    # (OffloadEngine._weigh_miss_slots), and "where everything landed" says how many
    held = (f"{resident} of {total_experts} experts resident" if mode == "all_resident"
            else f"{counted(resident, 'expert slot')} for the {total_experts} experts")
    statements = [f"{held} on the {device.name} ({human_bytes(spent)} of a {human_bytes(budget)} expert budget)."]
    statements += _tier_mapping_statement(config, runnable, slots, device, host_tier and not tier_room)
    if whole_layers:
        full = sum(1 for info in runnable if slots[info.name] == info.spec.num_experts)
        # (where the others' experts run, the CPU or the host tier, the sentences after the plan's say)
        others = len(runnable) - full
        rest = f"; the other {others} {'has' if others == 1 else 'have'} no expert slot there" if others else ""
        statements.append(f"The budget holds whole layers: {full} of {len(runnable)} expert layers keep all their "
                          f"experts on the {device.name}{rest}.")
    if clamped:
        statements.append(f"device_expert_bytes={config.device_expert_bytes} is more than the device has "
                          f"free{under_limit(device)}; the budget is {human_bytes(budget)}.")
    if config.device_expert_bytes is not None and config.reserve_device_bytes is not None:
        statements.append(f"reserve_device_bytes={config.reserve_device_bytes} does not apply: device_expert_bytes "
                          "sets the expert budget (the reserve sizes the automatic one).")
    statements += _limit_without_effect(device)
    if tier_room:
        statements.append(f"The automatic budget leaves {human_bytes(tier_room)} to the host tier's device mappings, "
                          f"which round each slot array up to the {human_bytes(TIER_GRANULE)} mapping granule, so "
                          "that the reserve for KV cache and workspace stays free.")
    if config.device_expert_bytes is None and budget < smallest and runnable:
        statements.append(f"The automatic budget holds no expert: "
                          f"{_reserve_left(device, available, budget + tier_room)}.")
    if too_small:
        statements.append(f"node_overrides give {'; '.join(too_small)}: "
                          f"{'it keeps' if len(too_small) == 1 else 'they keep'} none there.")
    statements += gpu_statements(experts)
    if mode == "hybrid" and resident < sum(info.spec.num_experts for info in runnable):
        statements.append("Cold experts that routing hits during decode run on the CPU." if config.cpu_execution != "disabled"
                          else "Cold experts that routing hits are copied to the device before they run.")
    return OffloadPlan(mode, budget, slots, statements, free)
