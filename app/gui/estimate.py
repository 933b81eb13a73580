"""What a model needs and where it would land, computed without loading it (no Qt here).

The budget panel calls `estimate()` on every move of a control: it plans with the engine's own
planner (`plan_offload`) against a stand-in device of the chosen size, so the numbers are the ones
the engine will use when the model loads or re-plans. The staging it takes before planning (the
pinned host ring and the device's prefill staging ring) is sized by the engine's own code
(engine.offload.staging.plan_staging), so an explicit pinned_bytes bounds the ring and the prefill
wave here exactly as in the engine, and a ring that holds no expert is refused with its message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import psutil

from engine.decoder_state import DecoderState, kv_rows_at_most
from engine.errors import ModelFileError
from engine.offload import decode_path as paths
from engine.offload.config import OffloadConfig
from engine.offload.dense_landing import PlanPreview, land_dense, planned_experts
from engine.offload.device_memory import card_memory
from engine.ort_env import DenseDoesNotFit, dense_arena, dense_cpu_reason
from engine.offload.devices import SimulatedDevice
from engine.offload.host_cache import file_backing_refusal
from engine.onnx_file import OnnxFile
from engine.offload.staging import StagingPlan, plan_staging
from engine.offload.planner import (AUTO_RESERVE_FRACTION, AUTO_RESERVE_MIN, OffloadPlan, OffloadPlanError,
                                    dense_cpu_words)
from engine.units import counted, human_bytes
from kernels.gpu.host_tier import TIER_GRANULE

GIB = 1 << 30
_ELEM_BYTES = {1: 4, 10: 2, 16: 2, 11: 8, 2: 1, 3: 1, 6: 4, 7: 8}


@dataclass(frozen=True)
class StagedNode:
    """What a device's staging_bytes_per_expert reads of an expert node's runner (engine
    CpuExpertNode): its info, and its weight tensors by role, here read-only stand-ins of the right
    shape and dtype that hold no memory (nothing is loaded to estimate)."""
    info: object
    tensors: dict


def staged_nodes(folder) -> list[StagedNode]:
    from kernels.qmoe_spec import QMOE_INPUT_NAMES

    nodes = []
    for info in folder.experts:
        if info.spec is None:
            continue
        tensors = {role: None for role in QMOE_INPUT_NAMES}
        for role, name in info.weight_inputs.items():
            tensor = folder.onnx.initializers[name]
            tensors[role] = np.broadcast_to(np.zeros((), OnnxFile.tensor_dtype(tensor)), tuple(tensor.dims))
        nodes.append(StagedNode(info, tensors))
    return nodes


@dataclass
class ModelFacts:
    """What the window knows about a model folder once it is opened (before it loads)."""
    path: str
    name: str
    report: dict                       # app.inspect_report.inspection()
    experts: list                      # engine ExpertNodeInfo, in layer order
    context_length: int
    longest_sequence: int              # what the KV cache is sized for (GenaiConfig.longest_sequence)
    longest_sequence_words: str        # which bound that is
    kv_bytes_per_token: int            # every attention layer's key + value, one token
    kv_window_bytes_per_token: int
    window_tokens: int
    state_bytes: int                   # conv / recurrent state's buffers: fixed, whatever the context
    dense_bytes: int
    expert_bytes: int
    dense_segments: int
    is_demo: bool = False
    staged_nodes: list = field(default_factory=list)   # StagedNode per runnable expert node (staging estimates)
    kv_dtypes: frozenset = frozenset()                  # the KV caches' element types (where the dense part can run)
    # the state at its longest (longest_sequence) with a KV buffer's growth, as the load counts it on the GPU
    # (DecoderState's full_context_bytes); None where the graph's state inputs cannot be read (the load refuses the model)
    dense_state_bytes: int | None = None

    @property
    def supported(self) -> bool:
        return bool(self.report.get("supported"))

    def kv_rows(self, tokens: int | None = None) -> int:
        """The rows the full-attention KV buffers may hold for a conversation of `tokens` (the longest sequence where
        None): they grow by doubling, so up to nearly twice the tokens (engine.decoder_state.kv_rows_at_most)."""
        return kv_rows_at_most(self.longest_sequence if tokens is None else tokens, self.longest_sequence)

    def kv_cache_bytes(self, tokens: int | None = None) -> int:
        """The KV caches and state as the engine holds them for `tokens`: full-attention buffers at kv_rows, each
        sliding-window buffer at its whole window from the first step."""
        return (self.kv_bytes_per_token * self.kv_rows(tokens) + self.kv_window_bytes_per_token * self.window_tokens
                + self.state_bytes)

    def kv_words(self, tokens: int | None = None) -> str:
        """'4096 tokens', with the rows the buffers may grow to where those are more, or naming search.max_length
        where it is what bounds them."""
        tokens = self.longest_sequence if tokens is None else tokens
        rows = self.kv_rows(tokens)
        if tokens == self.longest_sequence < self.context_length:
            return f"{tokens} tokens (search.max_length, below the {self.context_length}-token context)"
        return f"{tokens} tokens" + (f" (its buffers may grow to {rows} rows: they double)" if rows > tokens else "")


def model_facts(folder, report: dict, is_demo: bool = False) -> ModelFacts:
    """From an opened engine ModelFolder and its inspection."""
    config = folder.config
    window = (config.sliding_window_size or 0) + (config.sliding_cache_slack or 0)
    per_token = per_window_token = state = 0
    kv_dtypes = set()
    patterns = []
    for kind, past, _present in config.state_pairs():
        patterns.append((kind, re.compile("^" + re.escape(past).replace("%d", r"(\d+)") + "$")))
    for value in folder.onnx.proto.graph.input:
        for kind, pattern in patterns:
            match = pattern.match(value.name)
            if not match:
                continue
            tensor = value.type.tensor_type
            elem = _ELEM_BYTES.get(tensor.elem_type, 4)
            layer = int(match.group(1))
            fixed, has_tokens = 1, False
            for dim in tensor.shape.dim:
                if dim.HasField("dim_value"):
                    fixed *= dim.dim_value
                elif "batch" in dim.dim_param:
                    continue
                elif "length" in dim.dim_param or "sequence" in dim.dim_param:
                    has_tokens = True
                else:  # kv_cache_dim and the like
                    fixed *= config.head_size or 1
            if kind in ("key", "value"):
                kv_dtypes.add(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)))
            if kind in ("key", "value") and has_tokens:
                if config.is_sliding(layer):
                    per_window_token += fixed * elem
                else:
                    per_token += fixed * elem
            else:  # conv / recurrent state: two buffers, the one a step reads and the one it writes (DecoderState)
                state += 2 * fixed * elem
    from pathlib import Path

    return ModelFacts(
        path=str(folder.folder), name=Path(folder.folder).name, report=report, experts=list(folder.experts),
        context_length=config.context_length, longest_sequence=config.longest_sequence,
        longest_sequence_words=config.longest_sequence_words, kv_bytes_per_token=per_token,
        kv_window_bytes_per_token=per_window_token, window_tokens=window,
        state_bytes=state, dense_bytes=report["dense_bytes"], expert_bytes=report["expert_bytes"],
        dense_segments=report["dense_segments"], is_demo=is_demo, staged_nodes=staged_nodes(folder),
        kv_dtypes=frozenset(kv_dtypes), dense_state_bytes=_dense_state_bytes(folder))


def _dense_state_bytes(folder) -> int | None:
    try:
        total, growth = DecoderState(folder.config, folder.onnx.proto.graph).full_context_bytes()
    except ModelFileError:
        return None
    return total + growth


@dataclass(frozen=True)
class DeviceChoice:
    """Where resident experts would live: 'cpu' (nowhere), 'simulated' (a size you choose), 'cuda'."""
    kind: str = "cpu"
    capacity: int = 8 * GIB           # simulated size, or the card's memory
    others_bytes: int = 0             # memory other processes and the driver hold on a real card
    name: str = ""
    error: str = ""                   # why the chosen device cannot be used
    index: int = 0                    # the CUDA device's number (the window opens device 0)
    others_note: str = ""             # how others_bytes was found, or its parts

    @property
    def label(self) -> str:
        if self.kind == "simulated":
            return self.name or f"simulated GPU, {human_bytes(self.capacity)}"
        if self.kind == "cuda":
            return self.name or "CUDA GPU"
        return "CPU only"


@dataclass
class Part:
    key: str        # experts | dense | kv | workspace | others | free | limit
    label: str
    bytes: int
    note: str = ""


def slot_words(experts) -> str:
    """Where a device slot takes more than the expert stored (the GPU kernels' layout: an fp16 copy of the block scales,
    a conversion), what one takes: the model panel lists the stored size, which the resident bytes would not add up
    to. '' where the slots differ between nodes or take what is stored."""
    sizes = {(info.device_bytes_per_expert, info.bytes_per_expert) for info in experts if info.gpu is not None}
    if len(sizes) != 1:
        return ""
    (slot, stored), = sizes
    return f", {human_bytes(slot)} a slot: the GPU kernels' layout of {human_bytes(stored)} stored" if slot != stored \
        else ""


@dataclass
class Estimate:
    plan: OffloadPlan | None
    error: str                         # the planner refused (e.g. mode=required) or the device is unusable
    per_layer: list[tuple[int, str, int, int]]   # (layer, node, resident, experts)
    device_parts: list[Part]           # VRAM, adding up to the device's capacity
    host_parts: list[Part]             # host memory the model takes
    capacity: int
    ceiling: int                       # what the model may take: what other processes leave, under the limit
    staging_bytes: int
    statements: list[str] = field(default_factory=list)
    staging: "StagingPlan | None" = None   # the pinned ring and prefill wave the engine would take (None: none)
    host_tier: bool = False            # the engine would make the host tier (its device mappings are in "experts")
    reserve_bytes: int | None = None   # what the automatic budget keeps free (reserve_device_bytes); None: no device

    @property
    def resident(self) -> int:
        return sum(r for _l, _n, r, _e in self.per_layer)

    @property
    def total_experts(self) -> int:
        return sum(e for _l, _n, _r, e in self.per_layer)


def staging_for(config: OffloadConfig, nodes: list[StagedNode], device) -> StagingPlan | None:
    """Reserve on `device` (the estimate's stand-in) the staging the offload engine takes before it
    plans, sized by the engine's own staging.plan_staging: an explicit pinned_bytes bounds the ring
    and the prefill wave, and a ring below one expert raises OffloadPlanError with the engine's
    message. None where the engine takes none (no device, offload disabled)."""
    if device is None or not nodes or config.mode == "disabled":
        return None
    runnable = [node for node in nodes if node.info.gpu is not None]
    staged = max((device.staging_bytes_per_expert(node) for node in runnable), default=0)
    largest_slot = max((node.info.device_bytes_per_expert for node in runnable), default=0)
    layer_experts = max((node.info.spec.num_experts for node in runnable), default=0)
    staging = plan_staging(config, staged, largest_slot, device.memory.available, psutil.virtual_memory().available,
                           layer_experts)
    device.memory.reserve(staging.device_bytes, "prefill staging ring")
    return staging


def auto_reserve(config: OffloadConfig, available: int) -> int:
    if config.reserve_device_bytes is not None:
        return config.reserve_device_bytes
    return max(AUTO_RESERVE_MIN, int(AUTO_RESERVE_FRACTION * available))


def experts_in_host_memory(expert_bytes: int, config: OffloadConfig) -> Part:
    """The experts' share of host memory: the file's pages as the OS keeps them, at most host_expert_bytes of them
    (the bounded cache, engine/offload/host_cache.py), or all of them copied into RAM (allow_file_backing=0)."""
    if not config.allow_file_backing:
        return Part("experts", "expert weights (in RAM)", expert_bytes, "copied from the file at load "
                    "(allow_file_backing=0)")
    if config.host_expert_bytes is not None and config.host_expert_bytes < expert_bytes:
        return Part("experts", "expert weights (memory-mapped)", config.host_expert_bytes,
                    f"at most host_expert_bytes of the {human_bytes(expert_bytes)}; the rest stays in the file")
    return Part("experts", "expert weights (memory-mapped)", expert_bytes, "read from the page cache")


def estimate(facts: ModelFacts, config: OffloadConfig, device: DeviceChoice, kv_tokens: int | None = None,
             whole_layers: bool = False, experts_in_ram: int = 0, decode_path: str | None = None,
             arena_over_tier: str | None = None) -> Estimate:
    """experts_in_ram: the bytes of experts the loaded model keeps copied in RAM already (allow_file_backing=0), which
    the same setting does not need again (as the engine counts them). decode_path: the engine's (decode_path.py; None:
    the default it takes), which decides whether the slots are mapped with a host tier. arena_over_tier: the loaded
    model's OffloadEngine.arena_over_tier where these settings re-plan it: no host tier, as its re-plans make none."""
    if device.kind != "cpu" and device.error and config.mode != "required":
        # as the engine does (engine_worker._make_device): a GPU that cannot be used leaves every expert on the CPU,
        # and only mode=required refuses the load
        fallback = estimate(facts, config, DeviceChoice(), kv_tokens, whole_layers, experts_in_ram, decode_path)
        fallback.statements.insert(0, f"The {device.label} cannot be used ({device.error}): every expert would run "
                                      "on the CPU.")
        return fallback
    kv = facts.kv_cache_bytes(kv_tokens)
    # Where the engine would put the dense part (LoadedModel: ort_env.choose_dense_device); the plan is made for it
    # there, and under gpu_device_mem_limit what the plan leaves decides (dense_fit below).
    dense_cpu = dense_cpu_reason(device.kind if device.kind != "cpu" else None, facts.kv_dtypes)
    dense_on_gpu = dense_cpu is None
    host_available = psutil.virtual_memory().available
    # what the engine refuses before it plans (OffloadEngine._check_file_backing)
    error = file_backing_refusal(config, facts.expert_bytes, host_available + experts_in_ram)
    stand_in = None
    staged: StagingPlan | None = None
    staging = 0
    if device.kind != "cpu":
        if device.error:
            error = device.error
        elif not error:
            # the memory the load's CudaDevice would count (card_memory): other processes' outside the limit
            stand_in = SimulatedDevice(device.capacity, mem_limit=config.gpu_device_mem_limit, name=device.label,
                                       others_bytes=device.others_bytes)
            try:
                staged = staging_for(config, facts.staged_nodes, stand_in)  # reserves its device part
            except OffloadPlanError as exc:  # the engine refuses to load (or re-plan) with this
                error = str(exc)
                stand_in = None
            if staged is not None:
                staging = staged.device_bytes
    plan = preview = None

    def arena(ahead: int) -> str | None:  # the load's check, the stand-in as the plan leaves it with `ahead` more taken
        return dense_fit(facts, device, config, stand_in.memory.used + ahead)

    try:  # the nodes the engine runs, as the load's plan; the others said as left out of it
        experts, left_out = planned_experts(config, facts.experts)
    except OffloadPlanError as exc:  # mode=required, where a node is left out
        experts, left_out, error = [], [], error or str(exc)
    if experts and not error:  # an unusable device (mode required, above), a refused ring or node: no plan
        try:
            preview = PlanPreview(config, experts, facts.staged_nodes, stand_in, device.kind, whole_layers,
                                  decode_path or paths.default_decode_path(), dense_cpu, arena, arena_over_tier)
            plan = preview.plan
        except Exception as exc:  # OffloadPlanError and friends: the verdict shows it
            error = str(exc)
    landed = dense_cpu  # where the load would put the dense part, the plan made (None: on the card)
    if plan is not None and stand_in is not None and not error:
        # the slots and streaming slots reserved, made again where the load would keep the dense part on the CPU
        preview.make_slots()
        landed = land_dense(preview, preview.place)
        plan = preview.plan
    elif dense_on_gpu and stand_in is not None and not error:  # (no expert node the engine runs: no plan)
        landed = arena(0)
    at_load = landed if dense_on_gpu else None  # why the load would keep it on the CPU all the same (dense_fit)
    if at_load:
        dense_cpu, dense_on_gpu = at_load, False
    host_tier, tier_said, streaming = (preview.host_tier, preview.tier_said, preview.streaming) if preview else (
        False, "", None)
    resident_bytes, streaming_bytes = (preview.slot_bytes, preview.streaming_bytes) if preview else (0, 0)
    host_parts = [
        Part("dense", "dense weights", 0 if dense_on_gpu else facts.dense_bytes,
             "copied to the GPU at load" if dense_on_gpu else "onnxruntime CPU"),
        experts_in_host_memory(facts.expert_bytes, config),
        Part("kv", "KV cache + state", 0 if dense_on_gpu else kv,
             "in GPU memory with the dense part" if dense_on_gpu else facts.kv_words(kv_tokens)),
    ]
    per_layer = [(info.model_layer, info.name, plan.slots.get(info.name, 0) if plan else 0,
                  info.spec.num_experts if info.spec else 0) for info in facts.experts]
    capacity = device.capacity if device.kind != "cpu" else 0
    others = min(device.others_bytes, capacity)
    ceiling = card_memory(capacity, others, config.gpu_device_mem_limit).ceiling  # this process's, as the load's
    device_parts: list[Part] = []
    reserve_bytes = None
    if device.kind != "cpu":
        device_parts = [
            Part("experts", "resident experts", resident_bytes,
                 counted(sum(p[2] for p in per_layer), "expert") + slot_words(facts.experts) + (
                     f"; with the host tier every slot array is mapped in {human_bytes(TIER_GRANULE)} granules"
                     if host_tier else "")),
            Part("dense", "dense weights", facts.dense_bytes if dense_on_gpu else 0,
                 "onnxruntime's CUDA execution provider" if dense_on_gpu
                 else f"on the CPU: {dense_cpu} ({human_bytes(facts.dense_bytes)} in host RAM)"),
            Part("kv", "KV cache", kv if dense_on_gpu else 0,
                 facts.kv_words(kv_tokens) if dense_on_gpu
                 else f"in host RAM with the dense part ({human_bytes(kv)})"),
            Part("workspace", "workspace", staging + streaming_bytes if stand_in else 0,
                 (f"prefill staging ring: waves of {counted(staged.wave_experts, 'expert')}, double-buffered" if staged
                  else "prefill staging ring")
                 + (f"; decode streaming slots {human_bytes(streaming_bytes)}" if streaming_bytes else "")),
            Part("others", "other processes and the driver", others, device.others_note or (
                "measured by NVML" if device.kind == "cuda" else "none on a simulated GPU")),
        ]
        used = sum(p.bytes for p in device_parts if p.key != "others")
        room = max(0, ceiling - staging)
        reserve_bytes = min(auto_reserve(config, room), room)  # a device below the reserve: all it has
        device_parts.append(Part("free", "free", max(0, ceiling - used),
                                 f"the automatic budget keeps {human_bytes(reserve_bytes)} free"
                                 if config.device_expert_bytes is None else ""))
        if others + ceiling < capacity:
            device_parts.append(Part("limit", "beyond gpu_device_mem_limit", capacity - others - ceiling, ""))
    if staged is not None and not error:
        note = f"page-locked; {counted(staged.pinned_experts, 'expert')} of {human_bytes(staged.staged_expert_bytes)}"
        host_parts.append(Part("pinned", "pinned staging ring", staged.pinned_bytes, note))
    statements = left_out + (list(plan.statements) if plan else [])
    if plan and staged is not None:
        statements.extend(staged.statements(cold=plan.leaves_cold))  # the sentences the engine adds to its plan
    if tier_said:  # ... then what it says of the host tier
        statements.append(tier_said)
    if streaming is not None:
        statements.extend(streaming.statements)  # ... then those of its streaming slots
    if device.kind != "cpu":
        if dense_on_gpu:
            statements.append("The dense part would run on the GPU with onnxruntime's CUDA execution provider, its KV "
                              "cache and state in GPU memory.")
        elif plan is None or config.mode != "disabled":  # (else the plan's first sentence says it runs there, and why)
            statements.append(f"Loaded with these settings, the dense part would stay on the CPU: {at_load}." if at_load
                              else f"The dense part would run on the CPU: {dense_cpu}.")
        need = sum(p.bytes for p in device_parts if p.key in ("experts", "dense", "kv", "workspace"))
        if need > ceiling and not error:  # nothing checks it without gpu_device_mem_limit: the load goes ahead
            # (mode=disabled applies no expert budget: every expert goes beside the dense part, or with it to the CPU;
            # a larger reserve leaves the experts less room, where mode=disabled refuses them: _plan_beside_dense)
            room = ("mode=auto keeps the experts that do not fit beside it on the CPU; gpu_device_mem_limit makes the "
                    "load keep the dense part, and every expert with it, on the CPU where it does not fit"
                    if config.mode == "disabled" else
                    "a larger reserve_device_bytes or a smaller device_expert_bytes leaves them room; "
                    "gpu_device_mem_limit makes the load keep the dense part on the CPU where it does not fit")
            statements.append(
                f"Together these need {human_bytes(need)} of the {device.label}, more than the {human_bytes(ceiling)} "
                f"it has for this model: the dense part and its KV cache at {facts.kv_words(kv_tokens)} would not fit "
                f"beside the experts ({room}).")
    mapped = host_parts[1].bytes  # the experts' pages the OS keeps for the mapped file (experts_in_host_memory)
    if config.allow_file_backing and mapped > host_available and not error:
        statements.append(f"The experts' {human_bytes(mapped)} in host memory are more than the "
                          f"{human_bytes(host_available)} available: the OS keeps what fits and reads the rest back "
                          "from the model file as routing needs them, slower than from RAM (host_expert_bytes bounds "
                          "what stays mapped).")
    if error:
        statements.insert(0, error)
    return Estimate(plan, error, per_layer, device_parts, host_parts, capacity, ceiling, staging, statements,
                    staged if not error else None, host_tier, reserve_bytes)


def dense_fit(facts: ModelFacts, device: DeviceChoice, config: OffloadConfig, planned: int) -> str | None:
    """Why the load would keep the dense part on the CPU once the offload plan took `planned` bytes of the device (its
    slots, staging and streaming slots), or None where it goes to the GPU: the load's own sums (ort_env.dense_arena),
    the arena that a model loaded earlier in this process registered on the device weighed as the load weighs it,
    nothing registered, said as the offload mode says it (planner.dense_cpu_words). The load's device counts the card's
    free memory under gpu_device_mem_limit (CudaDevice): other processes' memory is not within the limit."""
    if facts.dense_state_bytes is None:
        return None
    memory = card_memory(device.capacity, device.others_bytes, config.gpu_device_mem_limit)
    try:
        dense_arena(device.index, memory.limit, memory.ceiling - planned, facts.dense_state_bytes, facts.dense_bytes,
                    register=False)
    except DenseDoesNotFit as exc:
        return dense_cpu_words(str(exc), config.mode)
    return None


def layer_summary(per_layer: list[tuple[int, str, int, int]], miss_slots: list[int] | None = None) -> str:
    """'8 of 8 in every layer' or 'layers 0-3: 5 of 16; layer 4: 4 of 16' (a layer's slots of its experts); with the
    slots each layer leaves to copied misses (adaptive placement's miss_slots, placement.py), its resident experts and
    those slots apart: '6 of 16 in every layer (2 layers): 4 resident experts, 2 left for copied misses' or 'layer 0:
    6 of 16 (4 resident experts, 2 left for copied misses); layer 1: 3 of 16'."""
    if not per_layer:
        return "no expert layers"
    misses = miss_slots or [0] * len(per_layer)
    counts = [(r, e, m) for (_l, _n, r, e), m in zip(per_layer, misses)]
    if len(set(counts)) == 1:
        r, e, m = counts[0]
        return f"{r} of {e} in every layer ({counted(len(counts), 'layer')})" + (f": {slots_split(r, m)}" if m else "")
    groups: list[list] = []
    for (layer, _n, _r, _e), count in zip(per_layer, counts):
        if groups and groups[-1][2] == count and groups[-1][1] == layer - 1:
            groups[-1][1] = layer
        else:
            groups.append([layer, layer, count])
    parts = [(f"layer {a}" if a == b else f"layers {a}-{b}") + f": {r} of {e}" + (f" ({slots_split(r, m)})" if m else "")
             for a, b, (r, e, m) in groups]
    return "; ".join(parts)


def slots_split(slots: int, miss_slots: int) -> str:
    """'4 resident experts, 2 left for copied misses': what `slots` device slots hold where `miss_slots` of them are
    left to the miss policy's copies (which may hold an earlier copied expert)."""
    return f"{counted(slots - miss_slots, 'resident expert')}, {miss_slots} left for copied misses"
