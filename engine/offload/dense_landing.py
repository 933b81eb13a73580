"""Where the load puts the dense part beside an offload plan made for it on a CUDA card, and what the plan does then.

One sequence for the load (LoadedModel with its OffloadEngine) and for inspect and the budget panel's estimate, which
follow it without loading (PlanPreview), so that the three cannot say different things. The plan is made for the dense
part on the card (mode=disabled puts every expert beside it); under gpu_device_mem_limit onnxruntime's arena may then
not fit beside the plan (ort_env.dense_refusal), and the dense part stays on the CPU:
- under mode=disabled the plan's slots are all it takes of the card, so this is known before they are made, and every
  expert is planned onto the CPU with it, none copied to the card only to be freed (arena_beside_every_expert);
- a host tier made for the dense part on the card would never be read, so the plan is made again without it; where
  the tier's device mappings (each slot array rounded up to the granule) held the room the arena lacked, the card is
  tried again, and the dense part runs there without the tier (land_dense, dense_landed).
"""

from __future__ import annotations

from typing import Callable

from engine.offload import decode_path as paths
from engine.offload.planner import OffloadPlanError, plan_offload
from engine.offload.streaming import plan_streaming


def planned_experts(config, experts) -> tuple[list, list[str]]:
    """Of a model's expert nodes, those a plan made without loading (inspect, the budget estimate) is made for: the
    nodes the engine runs, as the load's plan (OffloadEngine plans its runners; the load refuses a model with any
    other, LoadedModel), and a sentence for each node left out, naming it and why. Under mode=required a node left
    out refuses the plan, in the planner's words for what it cannot offload, and so does node_overrides naming one
    (the planner knows only the nodes it plans)."""
    left_out = [info for info in experts if info.spec is None]
    if config.mode == "required" and left_out:
        raise OffloadPlanError("offload mode 'required': " + "; ".join(info.unsupported for info in left_out))
    said = []
    for info in left_out:
        why = info.unsupported.removeprefix(f"node '{info.name}': ")
        if info.name in config.node_overrides:
            raise OffloadPlanError(f"node_overrides names '{info.name}', an expert node left out of the plan: {why}")
        said.append(f"Expert node '{info.name}' (layer {info.model_layer}) is left out of the plan: {why}; the load "
                    "refuses the model while it has this node.")
    return [info for info in experts if info.spec is not None], said


def land_dense(plan: DenseLanding, place: Callable[[str | None], str | None]) -> str | None:
    """Put the dense part where the load puts it beside `plan` and make the plan again for where it landed; returns why
    it runs on the CPU (None: on the card). `place(why)`: the load keeps it on the CPU for `why` where the plan was
    made for it there (ort_env.dense_cpu_reason, or the arena weighed beside every expert), else tries the card
    (choose_dense_device; inspect and the estimate: the arena check, nothing registered), and says why it stayed on
    the CPU, None where it went to the card."""
    why = place(plan.dense_cpu)
    beside_tier = plan.dense_landed(why)
    if beside_tier:  # planned again without the host tier, whose device mappings held the room the arena lacked
        why = place(None)
        plan.dense_landed(why, beside_tier)
    return why


class DenseLanding:
    """A plan made for the dense part (dense_cpu: why it runs on the CPU, None where on the card; dense_on_device:
    mode=disabled's experts beside it on the card), made again where the load puts it elsewhere. Its maker (the
    engine, PlanPreview) gives `config`, `host_tier` (the tier made) and these:
    _on_card(): whether the plan's device is a CUDA card, where onnxruntime's arena may not fit;
    _arena_check(ahead=0): why the load would keep the dense part on the CPU were the device to hold `ahead` bytes more
    than it holds now (ort_env.dense_refusal, nothing registered), None where the arena fits or this is not known;
    _plan_for_dense(): the plan made again for dense_cpu and dense_on_device, before its slots are made;
    _replan_for_dense(): the plan and its slots made again for them, the slots made before released;
    _say_of_tier(said): the plan's sentence on the host tier replaced by `said`, where it has one ('' where the
    plan without the tier made every expert resident)."""

    config: object
    dense_cpu: str | None
    dense_on_device: bool
    host_tier: bool
    arena_over_tier: str | None  # the arena check's refusal beside the tier where dense_landed put it on the card

    def arena_beside_every_expert(self, slot_bytes: int) -> None:
        """mode=disabled plans every expert beside the dense part on the card. Where onnxruntime's arena would not fit
        beside them, the load keeps the dense part on the CPU, and every expert goes there with it: the plan's slots
        (`slot_bytes`, not yet taken of the device) are all that mode=disabled takes of the device (no staging ring,
        streaming slots or tier), so this is known before they are made, and planned so. (Only a CUDA card has the
        arena: a stand-in device that takes the dense part is not weighed.)"""
        if not (self.dense_on_device and self.config.mode == "disabled" and self._on_card()):
            return
        why = self._arena_check(slot_bytes)
        if why:
            self.dense_cpu, self.dense_on_device = why, False
            self._plan_for_dense()

    def dense_landed(self, dense_cpu: str | None, beside_tier: str | None = None) -> str | None:
        """The load put the dense part on the CPU for `dense_cpu` (None: on the device). The plan was made for where it
        was meant to go, which onnxruntime's arena not fitting beside the plan can still change: a host tier made for
        a dense part that stayed on the CPU would never be read (decode_path.tier_verdict), and mode=disabled put
        every expert on the card beside a dense part that is not there, so the plan is made again, without the tier
        and with mode=disabled's experts on the CPU.
        Where the arena lacked the room the tier's device mappings took (each slot array rounded up to the granule),
        the plan without them may leave it enough: the arena check's refusal beside the tier is returned where it
        does, and the load tries the card again, then says where the dense part landed with that refusal as
        `beside_tier` (where it stays on the CPU all the same, the plan's sentence on the tier says why). (Under
        mode=disabled there is no second try: every expert on the CPU with the dense part alone on the card is
        mode=auto's plan with no expert budget, not offload disabled.)"""
        stayed = dense_cpu is not None and self._on_card()
        beside = stayed and self.dense_on_device and self.config.mode == "disabled"
        tiered = stayed and self.host_tier
        short = self._arena_check() if tiered else None
        self.dense_cpu = dense_cpu
        if stayed:
            self.dense_on_device = False  # (a later re-plan to mode=disabled puts every expert on the CPU too)
        if beside or tiered:
            self._replan_for_dense()
        if dense_cpu is None and beside_tier:  # on the card after all, beside the slots without the tier
            self.dense_on_device = True
            self.arena_over_tier = beside_tier
            self._say_of_tier(paths.tier_beside_arena(self.config, beside_tier))
        elif beside_tier:  # on the CPU for what the second try met (onnxruntime's arena not made), not the refusal
            # the plan without the tier was made for, which its mappings (gone since) brought about
            self._say_of_tier(paths.dense_on_host_words(self.config, dense_cpu))
        return short if short and self._arena_check() is None else None


class PlanPreview(DenseLanding):
    """The load's offload plan made without loading (inspect, the budget panel's estimate) for `experts` on `device`
    (None: no device), a card of `kind` or its stand-in, which holds the staging the engine takes before it plans; then
    make_slots. `decode_path`: the engine's (decode_path.py). `arena(ahead)`: _arena_check's, the device as the
    preview leaves it (None: nothing weighed). `arena_over_tier`: a loaded model's (OffloadEngine's) where the plan is
    its re-plan, which makes no host tier while the arena its load sized without the tier holds that room."""

    def __init__(self, config, experts, nodes, device, kind: str | None, whole_layers: bool, decode_path: str,
                 dense_cpu: str | None, arena: Callable[[int], str | None] | None = None,
                 arena_over_tier: str | None = None):
        self.config, self.experts, self.nodes, self.device, self.kind = config, experts, nodes, device, kind
        self.whole_layers, self.decode_path, self.arena = whole_layers, decode_path, arena
        self.dense_cpu, self.arena_over_tier = dense_cpu, arena_over_tier
        self.dense_on_device = device is not None and dense_cpu is None  # where mode=disabled puts every expert
        self.host_tier, self.tier_said, self.streaming = False, "", None
        self._plan_for_dense()

    def make_slots(self) -> None:
        """What the engine makes once it has planned: under mode=disabled the arena weighed beside every expert, then
        the host tier (tier_said: what the plan says of it, '' where nothing), the expert slots (with the tier: its
        mappings) and the decode streaming slots of layers left without slots in what they leave, reserved on the
        device."""
        self.arena_beside_every_expert(self.plan.device_bytes(self.experts))
        self.host_tier, self.tier_said = paths.tier_preview(self.decode_path, self.config, self.experts,
                                                            self.plan.slots, self.kind, self.device, self.dense_cpu,
                                                            self.arena_over_tier)
        self.device.memory.reserve(self.slot_bytes, "expert slots")
        self.streaming = plan_streaming(self.config, self.nodes, [self.plan.slots.get(node.info.name, 0)
                                                                  for node in self.nodes],
                                        self.device, paths.fixed_tier_path(self.decode_path, self.host_tier))

    @property
    def slot_bytes(self) -> int:
        """Device memory of the plan's slots (with the host tier: its mappings)."""
        return self.plan.device_bytes(self.experts, self.host_tier)

    @property
    def streaming_bytes(self) -> int:
        return sum(group.num_slots * group.slot_bytes for group in self.streaming.groups) if self.streaming else 0

    def place(self, why: str | None) -> str | None:
        """land_dense's `place` without loading: on the CPU for `why` where given, else where the arena check puts it
        (nothing registered)."""
        return why or self._arena_check()

    def _on_card(self) -> bool:
        return self.kind == "cuda"

    def _arena_check(self, ahead: int = 0) -> str | None:
        return self.arena(ahead) if self.arena is not None else None

    def _plan_for_dense(self) -> None:
        planned_tier = self.device is not None and self.arena_over_tier is None and paths.tier_planned(
            self.decode_path, self.config, self.experts, self.kind, paths.host_available(), self.dense_cpu)
        self.plan = plan_offload(self.config, self.experts, self.device, whole_layers=self.whole_layers,
                                 dense_on_device=self.dense_on_device, host_tier=planned_tier,
                                 dense_cpu=self.dense_cpu)

    def _replan_for_dense(self) -> None:
        self.device.memory.release(self.slot_bytes, "expert slots")
        self.streaming.close()
        self._plan_for_dense()
        self.make_slots()

    def _say_of_tier(self, said: str) -> None:
        if self.tier_said:
            self.tier_said = said
