"""The pinned host staging ring (session.moe.offload.pinned_bytes).

Every host -> device expert copy (placement swaps, misses copied into spare slots, prefill waves)
goes through a bounded ring of page-locked host memory: an expert is written into a free region
of the ring, copied from there asynchronously, and the region is reused once its copy has finished.
Copies from pinned memory run at the full PCIe rate (pageable copies ran at a third of it in
anchors.md's measurement), and the bound keeps page-locked memory, which the OS cannot swap, small.

'auto' sizes the ring for two prefill waves (prefill_wave_experts experts each, at most a layer's experts, which is
all one wave streams: double-buffered); an explicit value must hold at least one expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.offload.config import PREFIX, OffloadConfig
from engine.offload.planner import DeviceShort, OffloadPlanError
from engine.units import counted, human_bytes


def ring_bytes(config: OffloadConfig, expert_bytes: int, wave_experts: int) -> int:
    """The ring's size for the largest expert as staged (`expert_bytes`) and waves of at most `wave_experts`; refuses a
    ring that holds none."""
    if config.pinned_bytes is None:
        return 2 * wave_experts * expert_bytes
    if config.pinned_bytes < expert_bytes:
        raise OffloadPlanError(f"{PREFIX}pinned_bytes={config.pinned_bytes} holds no expert: "
                               f"it must be at least {expert_bytes} bytes (the largest expert)")
    return config.pinned_bytes


@dataclass(frozen=True)
class StagingPlan:
    """What the engine takes before it plans the expert slots."""
    pinned_bytes: int         # the pinned host ring every copy to the device goes through
    wave_experts: int         # cold experts streamed to the device per prefill wave
    device_bytes: int         # the device's double-buffered prefill staging ring
    staged_expert_bytes: int  # the largest expert as staged in the pinned ring
    auto_pinned_bytes: int = 0  # the ring pinned_bytes=auto takes with the other settings as they are

    @property
    def pinned_experts(self) -> int:
        return self.pinned_bytes // self.staged_expert_bytes if self.staged_expert_bytes else 0

    def statements(self, cold: bool = True) -> list[str]:
        """The sentences the plan gives about staging; `cold`: whether the plan leaves any expert cold (with every
        expert resident no prefill wave streams, though the ring stays for a later re-plan)."""
        said = []
        if self.wave_experts and cold:
            said.append(f"Cold experts used by many prompt tokens stream to the device in waves of {self.wave_experts}.")
        if self.pinned_bytes:
            said.append(f"Copies to the device go through a pinned staging ring of {human_bytes(self.pinned_bytes)} "
                        f"({counted(self.pinned_experts, 'expert')}).")
        return said


NO_STAGING = StagingPlan(0, 0, 0, 0)


def plan_staging(config: OffloadConfig, staged_expert_bytes: int, largest_slot_bytes: int,
                 device_available: int, host_available: int, layer_experts: int) -> StagingPlan:
    """The pinned ring (checked first: a ring that holds no expert is refused, and an explicit one beyond the
    `host_available` bytes of host memory, which page-locked memory would starve) and the device's
    double-buffered prefill staging ring (also used for every miss when cpu_execution is disabled).
    `staged_expert_bytes`: the largest expert as staged on the host (0: no node the GPU kernels run,
    nothing is staged); `largest_slot_bytes`: the largest device slot, since a wave holds its experts
    in slots of the kernels' layout (converted layouts are larger than the stored experts); `layer_experts`: the most
    experts of a node the GPU kernels run, the most a wave (one layer's cold experts) can hold."""
    if staged_expert_bytes == 0:
        return NO_STAGING
    most = min(config.prefill_wave_experts, layer_experts)
    pinned = ring_bytes(config, staged_expert_bytes, most)
    if config.pinned_bytes is not None and pinned > host_available:
        raise OffloadPlanError(f"{PREFIX}pinned_bytes={pinned} page-locks more than the {host_available} bytes of "
                               "host memory available")
    # A wave streams through the pinned ring double-buffered: an explicit pinned_bytes bounds it.
    through_ring = max(1, pinned // (2 * staged_expert_bytes))
    wave = min(most, through_ring, device_available // (2 * largest_slot_bytes))
    if wave == 0 and config.cpu_execution == "disabled":
        raise DeviceShort("cpu_execution=disabled needs device room to stage at least one expert "
                               f"({2 * largest_slot_bytes} bytes double-buffered)")
    return StagingPlan(pinned, wave, 2 * wave * largest_slot_bytes, staged_expert_bytes,
                       ring_bytes(config.updated(pinned_bytes=None), staged_expert_bytes, most))


class PinnedRing:
    """Byte accounting of the ring; the simulated device's ring (its copies finish at once, so
    what is in flight is what one transfer streams through the ring). The CUDA device's ring
    (cuda_device.CudaPinnedRing) holds real page-locked memory with the same counters."""

    kind = "accounted"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = 0
        self.high_water = 0
        self.bytes_copied = 0
        self.copies = 0

    def _account(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.high_water = max(self.high_water, self.in_use)

    def transfer(self, sizes: list[int]) -> None:
        """Stream these experts through the ring, as many at once as it holds (at least one)."""
        if not sizes:
            return
        if max(sizes) > self.capacity:
            raise OffloadPlanError(f"{PREFIX}pinned_bytes={self.capacity} holds no expert of {max(sizes)} bytes")
        in_flight = []
        for size in sizes:
            while in_flight and self.in_use + size > self.capacity:
                self.in_use -= in_flight.pop(0)  # the oldest copy finished: its region is free again
            self._account(size)
            in_flight.append(size)
            self.bytes_copied += size
            self.copies += 1
        self.in_use -= sum(in_flight)

    def info(self) -> dict:
        return {"kind": self.kind, "bytes": self.capacity, "in_use": self.in_use, "high_water": self.high_water,
                "bytes_copied": self.bytes_copied, "copies": self.copies}

    def close(self) -> None:
        self.in_use = 0
