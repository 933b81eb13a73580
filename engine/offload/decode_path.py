"""Where a decode step's cold experts are computed: on the CPU while the GPU computes the resident ones (the hybrid
path), or on the GPU, read over PCIe from page-locked host memory inside the decode kernel (the host tier,
kernels/gpu/host_tier.py) (issue #4).

The CPU path costs the CPU kernel plus the host round trip of every partly resident layer (its inputs to the host,
routing, the miss policy, the merge on the device: ~300 µs a layer for Qwen3-30B-A3B-like on the H200 machine); the
tier costs the PCIe read of the cold experts and no host work (the layer runs as a fully resident one). Which one is
faster depends on the machine (PCIe against the CPU's memory bandwidth and cores) and on how many experts are cold:
on the H200 machine the tier decoded 1.02-1.85x as fast at 0 / 25 / 50% resident on Qwen3-30B-A3B-like and
1.08-1.40x on gpt-oss-20B-like, whose CPU kernel alone reads twice as fast as PCIe (RESULTS.md, twenty-seventh and
twenty-eighth sessions); a CPU with more memory bandwidth or a slower PCIe link can turn that round. So under
cpu_execution=auto the engine measures them (trials.py), the tier preferred on a tie: it leaves the CPU to the user's
other work. cpu_execution=disabled keeps cold experts off the CPU, so the tier is the decode path there;
cpu_execution=enabled keeps them on the CPU, so no tier is made. The simulated device simulates the tier
(devices.py: its bytes counted, its reads priced at PCIe's rate), so that its projections follow the same path.

A third path, "both": the tier, and a share of each token's cold pairs computed by the CPU at once
(kernels/cold_split.py: the share from the two sides' rates as measured in the engine). Routing stays on the device; a
kernel publishes it to page-locked host memory, where the host finds it a few µs later without a stream
synchronisation (kernels/gpu/published.py), and the CPU's part is added on the device. Each such layer waits for the
CPU's part and then for the host to issue the next dense segment, where the tier lets the host run ahead of the GPU:
the table counts that host work, as measured (HostGap), on the CPU's side.
On the H200 machine one layer alone ran 1.7x the tier for gpt-oss-20B-like at 0% resident and 1.4x for
Qwen3-30B-A3B-like; whole decodes 1.23x / 1.09x / 0.93x the tier at 0 / 25 / 50% for gpt-oss-20B-like and 0.83x at 0%
for Qwen3-30B-A3B-like, whose host work per layer outweighs its small experts (RESULTS.md, thirtieth session): under
cpu_execution=auto the trials time it beside the other two.

The tier pins every expert of a node in host memory in the kernels' layout (the residents' rows too, so eviction is
a pointer change), besides the weight file's mapping: it is made only where pinned_bytes is 'auto', host_expert_bytes
(where bounded) holds it and it takes at most HOST_SHARE of the host memory available, or where the decode path is
asked for as "tier" or "both". Under approximate routing none is made: it drops and substitutes experts on the host,
so its decode steps route there and compute cold experts on the CPU. Nor on a CUDA card whose dense part runs on the
CPU (no CUDA execution provider, a KV cache its attention cannot take, or onnxruntime's arena not fitting beside the
plan: OffloadEngine.dense_landed plans again): decode's inputs then never sit in GPU memory, and every decode step
takes the CPU path (HybridExpertNode.run).
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np
import psutil

from engine.errors import WorkbenchError
from engine.offload.config import OffloadConfig
from engine.offload.planner import expert_room, slots_device_bytes, under_limit
from engine.offload.trials import AbaTrials
from engine.units import duration_text, human_bytes
from kernels.gpu.host_tier import TIER_GRANULE

CPU, TIER, BOTH = "cpu", "tier", "both"
MODES = ("auto", CPU, TIER, BOTH)  # auto: from cpu_execution (trials under its auto); the others: that path, no trials
ASKED_TIER = (TIER, BOTH)  # the paths that read cold experts from the tier
# what each path does with cold experts, in the words the app shows
PATH_WORDS = {CPU: "computed on the CPU", TIER: "read by the GPU from host memory",
              BOTH: "read by the GPU from host memory, a share computed on the CPU at once"}
HOST_SHARE = 0.5  # of the host memory available, at most, goes to the tier unless asked for


def measured_words(measured_ms: dict[str, float]) -> str:
    """What the last trial measured, path by path: '30.0 ms read by the GPU, 20.0 ms on the CPU, 25.0 ms both'."""
    short = {TIER: "read by the GPU", CPU: "on the CPU", BOTH: "both"}
    return ", ".join(f"{duration_text(measured_ms[path] / 1e3)} {short[path]}" for path in short if path in measured_ms)


def checked_path(mode: str) -> str:
    """`mode` if it is one of MODES; else a WorkbenchError naming it."""
    if mode not in MODES:
        raise WorkbenchError(f"decode path '{mode}': one of {', '.join(MODES)}")
    return mode


def default_decode_path() -> str:
    """The decode path an engine takes when none is asked for: MOE_DECODE_PATH (benchmarks' A/Bs), else auto (an
    empty one too, as a shell's `MOE_DECODE_PATH=` leaves it: unset, not a path)."""
    return os.environ.get("MOE_DECODE_PATH") or "auto"


def host_available() -> int:
    """Host memory available now, in bytes (what the OS could give without swapping)."""
    return psutil.virtual_memory().available


class TierReadRate:
    """Bytes per second at which the GPU reads cold experts from the host tier in "both" steps, as measured there (an
    exponential average over launches, weight `keep` on the past); None until measured. A step's launch reads a few
    experts at the decode kernel's own rate (its fixed cost included, fewer blocks in flight for fewer experts, the
    CPU's share reading host memory meanwhile), which the start-up copy measurement does not give."""

    def __init__(self, keep: float = 0.9):
        self.keep = keep
        self.value: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.value = rate if self.value is None else self.keep * self.value + (1 - self.keep) * rate


class HostGap:
    """Seconds the host spends from a "both" layer's CPU part to the next layer's launch in the same decode step: the
    merge's queueing, the decoder's Python, the next dense segment's launch. The GPU's part of the layer runs beside
    it, the CPU's part before it, so the split's table counts it on the CPU's side (kernels/cold_split.py). The value
    is the lower quartile of the latest WINDOW gaps (0 until measured): a gap that also waited for the GPU (inside
    onnxruntime's run of a segment that synchronises) would otherwise push the CPU's share down, the GPU's part up,
    and the next gaps up with it. `measured` False (the simulated device, whose dense segments are the CPU doing a
    card's work): always 0."""

    WINDOW = 64

    def __init__(self, measured: bool = True):
        self.measured = measured
        self._gaps: deque[float] = deque(maxlen=self.WINDOW)
        self._left: tuple[int, float] | None = None  # (layer, when) the last CPU part of this step ended

    def arrived(self, layer: int, now: float, waited: bool = False) -> None:
        """A "both" step of `layer` starts at `now` (perf_counter): a gap where the layer before was one. `waited`:
        under launch ahead (engine.decoder), the host got to this layer's routing before the GPU published it: its
        launches of later layers fitted in the GPU's work towards this routing, and the CPU's part waited for the GPU,
        not the host (a gap of 0)."""
        if self._left is not None and self._left[0] == layer - 1:
            self._gaps.append(0.0 if waited else now - self._left[1])

    def left(self, layer: int, now: float) -> None:
        """The CPU's part of `layer`'s "both" step ended at `now`."""
        if self.measured:
            self._left = (layer, now)

    def step_ended(self) -> None:
        self._left = None  # the step's end and the next step's start are no layer's gap

    def clear(self) -> None:
        """Forget every gap: measured again from the next "both" steps."""
        self._gaps.clear()
        self._left = None

    @property
    def value(self) -> float:
        return float(np.percentile(self._gaps, 25)) if self._gaps else 0.0


class DecodePathTrials(AbaTrials):
    """The tier against the CPU path and "both", the tier in force first and winning ties."""

    def __init__(self, **settings):
        super().__init__(TIER, CPU, BOTH, **settings)


def tier_wanted(mode: str, config: OffloadConfig) -> bool:
    """Whether the decode path `mode` under `config` wants a host tier (before what the host can hold)."""
    if mode != "auto":
        return mode in ASKED_TIER
    return config.mode != "disabled" and config.cpu_execution != "enabled"


def tier_planned(mode: str, config: OffloadConfig, infos, device_kind: str | None, available: int,
                 dense_cpu: str | None = None) -> bool:
    """Whether a plan under `config` is made for a host tier (plan_offload's host_tier): one is wanted on a device
    that reads it (`dense_cpu`: tier_verdict's) and the host's `available` memory takes it. The slots then decide
    whether it is made (tier_verdict: none where every expert is resident, or where the device has no room for its
    mappings)."""
    return (tier_wanted(mode, config) and device_kind is not None and config.mode != "disabled"
            and not _dense_on_host(device_kind, dense_cpu) and not config.approximate_routing
            and config.async_max_tokens > 0 and _refusal(mode, config, tier_bytes(infos), available) is None)


def _dense_on_host(device_kind: str | None, dense_cpu: str | None) -> bool:
    """Whether decode's expert inputs stay in host memory on a device of `device_kind`: a CUDA card whose dense part
    runs on the CPU (`dense_cpu`, ort_env.dense_cpu_reason's). A decode step then routes on the host and computes cold
    experts on the CPU whatever the decode path (HybridExpertNode.run), so no step would read a host tier. The
    simulated device takes the inputs where they are, as a card with the dense part does."""
    return device_kind == "cuda" and dense_cpu is not None


def fixed_tier_path(mode: str, host_tier: bool) -> str | None:
    """The decode path every decode step takes where it reads cold experts from the host tier (`host_tier`: one is
    made): "tier" or "both" as asked. None where a decode step may compute cold experts on the CPU alone: no tier, or
    under "auto" the trials, which may choose the CPU path and come back to time it again (cpu_execution=disabled,
    the tier's path under "auto" too, computes no expert on the CPU either way)."""
    return mode if host_tier and mode in ASKED_TIER else None


def tier_bytes(infos) -> int:
    """Page-locked host memory a host tier maps: every expert of every node the GPU kernels run, in their layout."""
    return sum(info.spec.num_experts * info.gpu.slot_bytes for info in infos if info.gpu is not None)


def tier_verdict(mode: str, config: OffloadConfig, infos, slots: dict[str, int], device_kind: str | None,
                 available: int, device=None, dense_cpu: str | None = None,
                 beside_arena: str | None = None) -> tuple[bool, str]:
    """Whether a plan of `slots` per node gets a host tier on a device of `device_kind` ("cuda", "simulated": the
    simulated device counts the tier's bytes and prices its reads; None: no device), with `available` bytes of host
    memory free, and the sentence that tells the user about a wanted tier that is not made ('' where it is made or
    not wanted: the engine says what it made once it has). `device`, where given, holds no slots yet: a tier whose
    granule-rounded device mappings it has no room for is not made (a card's mapping would fail). `dense_cpu`: why the
    dense part runs on the CPU (ort_env.dense_cpu_reason, DenseDevice.reason), None where it runs on the card: on a
    CUDA card no tier is made then (_dense_on_host). `beside_arena`: the arena check's refusal beside the tier where
    the load put the dense part on the card without it (OffloadEngine.dense_landed): no tier is made then either."""
    if not tier_wanted(mode, config) or device_kind is None:
        return False, ""
    if config.mode == "disabled":  # asked for (tier_wanted): every expert runs where the dense part does
        return False, ("No host tier is made: offload is disabled, so every expert runs where the dense part runs "
                       f"(decode path '{mode}' does not apply).")
    if all(slots.get(info.name, 0) >= info.spec.num_experts for info in infos if info.gpu is not None):
        return False, ""  # every expert resident: nothing to read from the host
    if _dense_on_host(device_kind, dense_cpu):
        return False, dense_on_host_words(config, dense_cpu)
    if beside_arena is not None and device_kind == "cuda":
        return False, tier_beside_arena(config, beside_arena)
    if config.approximate_routing:  # (HybridExpertNode: an approximating step routes on the host)
        asked = ", ".join(f"{key}={getattr(config, key)}" for key in ("min_expert_weight", "tail_substitution_threshold")
                          if getattr(config, key) > 0)
        return False, (f"{without_tier(config)}: no host tier is made, since approximate routing ({asked}) picks each "
                       "token's experts on the host, where decode from the tier routes on the GPU.")
    if config.async_max_tokens == 0:  # (HybridExpertNode: a step that reads the tier overlaps the CPU's part)
        return False, (f"{without_tier(config)}: no host tier is made, since async_max_tokens=0 runs no step with the "
                       "CPU and the GPU at once, and only such a decode step reads the tier.")
    refusal = _refusal(mode, config, tier_bytes(infos), available) or _device_refusal(config, infos, slots, device)
    if refusal:
        return False, f"{without_tier(config)}: no host tier is made, since {refusal}."
    return True, ""


def _device_refusal(config: OffloadConfig, infos, slots: dict[str, int], device) -> str | None:
    """Why `device` cannot hold the tier's device mappings for `slots`, or None where it can (or no device is given).
    Under an automatic budget the reserve for KV cache and workspace stays free beside them (expert_room)."""
    if device is None:
        return None
    need, room = slots_device_bytes(infos, slots, host_tier=True), expert_room(config, device)
    if need <= room:
        return None
    beside = (" beside the reserve for KV cache and workspace (reserve_device_bytes)"
              if config.device_expert_bytes is None else "")
    return (f"its device mappings need {human_bytes(need)} (each slot array's device rows rounded up to the "
            f"{human_bytes(TIER_GRANULE)} mapping granule; {human_bytes(slots_device_bytes(infos, slots))} without the "
            f"tier), more than the {human_bytes(room)} the device has free for them{under_limit(device)}{beside}")


def dense_on_host_words(config: OffloadConfig, dense_cpu: str) -> str:
    """Why no host tier is made on a CUDA card whose dense part runs on the CPU for `dense_cpu` (_dense_on_host)."""
    return (f"{without_tier(config)}: no host tier is made, since the dense part runs on the CPU ({dense_cpu}), so "
            "decode's expert inputs never sit in GPU memory and no decode step could read the tier.")


def tier_beside_arena(config: OffloadConfig, refusal: str) -> str:
    """Why no host tier is made where onnxruntime's arena for the dense part fits on the card beside the expert slots
    but not beside the tier's device mappings (`refusal`: the arena check's with them, ort_env.dense_refusal): the load
    keeps the dense part on the card and the slots without the tier (OffloadEngine.dense_landed)."""
    return (f"{without_tier(config)}: no host tier is made, since onnxruntime's arena for the dense part fits on the "
            f"card beside the expert slots but not beside the tier's device mappings ({refusal}).")


def without_tier(config: OffloadConfig) -> str:
    """Where decode's cold experts go without a host tier (a sentence's start)."""
    return ("Cold experts are copied to the device before they run" if config.cpu_execution == "disabled"
            else "Cold experts are computed on the CPU")


def tier_preview(mode: str, config: OffloadConfig, infos, slots: dict[str, int], device_kind: str | None,
                 device=None, dense_cpu: str | None = None, beside_arena: str | None = None) -> tuple[bool, str]:
    """Whether the engine will make the host tier for a plan of `slots`, and what it will say (the budget estimate,
    inspect): the host memory the tier pins, why a wanted one is not made, or '' where none is wanted. `device`,
    `dense_cpu`, `beside_arena`: tier_verdict's."""
    made, said = tier_verdict(mode, config, infos, slots, device_kind, host_available(), device, dense_cpu,
                              beside_arena)
    return made, tier_sentence(mode, config, tier_bytes(infos)) if made else said


def tier_sentence(mode: str, config: OffloadConfig, nbytes: int) -> str:
    """What decode does with a host tier of `nbytes` (after the planner's sentence on where cold experts run)."""
    tier = f"a host tier of {human_bytes(nbytes)} of page-locked host memory"
    if mode == TIER:
        return f"Instead, decode reads cold experts on the GPU from {tier}, as asked (decode path 'tier')."
    if mode == BOTH and config.cpu_execution == "disabled":  # run as "tier" (OffloadEngine.decode_path_in_force)
        return (f"Instead, decode reads cold experts on the GPU from {tier}; decode path 'both' was asked, but "
                "cpu_execution=disabled leaves the CPU no share of them.")
    if mode == BOTH:
        return (f"Instead, decode reads cold experts on the GPU from {tier} while the CPU computes a share of them, "
                f"as asked (decode path 'both').")
    if config.cpu_execution == "disabled":
        return f"Instead, decode reads cold experts on the GPU from {tier} (cpu_execution=disabled)."
    return (f"Decode can also read cold experts on the GPU from {tier}: while decoding the engine times that against "
            f"the CPU and against both at once, and keeps the fastest.")


def _refusal(mode: str, config: OffloadConfig, nbytes: int, available: int) -> str | None:
    """Why a wanted host tier of `nbytes` is not made, with `available` bytes of host memory free; None where it is
    made. Asked for (mode "tier" or "both"), only the memory itself refuses it."""
    if nbytes > available:
        return (f"its {human_bytes(nbytes)} of page-locked experts exceed the host memory available "
                f"({human_bytes(available)})")
    if mode in ASKED_TIER:
        return None
    if config.pinned_bytes is not None:
        return (f"pinned_bytes={config.pinned_bytes} bounds page-locked memory to the staging ring, and the tier pins "
                f"{human_bytes(nbytes)}")
    if config.host_expert_bytes is not None and nbytes > config.host_expert_bytes:
        return (f"host_expert_bytes={config.host_expert_bytes} bounds the experts' host memory, and the tier pins "
                f"{human_bytes(nbytes)}")
    if nbytes > HOST_SHARE * available:
        return (f"its {human_bytes(nbytes)} of page-locked experts exceed {HOST_SHARE:.0%} of the host memory "
                f"available ({human_bytes(available)})")
    return None
