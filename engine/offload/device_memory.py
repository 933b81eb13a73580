"""Byte accounting for a device: every allocation the engine makes is counted against the
device's free memory and the user's hard cap (gpu_device_mem_limit), with a high-water mark."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import WorkbenchError


# what the load counts against gpu_device_mem_limit for a dense part on the GPU (its caps, not what it allocated:
# engine.generation.LoadedModel)
DENSE_RESERVATION = "dense part (onnxruntime arena, dense weights, KV cache and state)"
# how the arena checks end where they keep the dense part on the CPU: what frees its room under the expert budgets
# (ort_env.dense_arena_limit), or lets the arena an earlier model registered fit (ort_env.shared_arena_cap);
# mode=disabled, where the budgets do not apply, says its own (planner.dense_cpu_words)
ARENA_BUDGET_HINT = " (raise reserve_device_bytes or lower device_expert_bytes)"
SHARED_ARENA_HINT = " (lower device_expert_bytes, or restart and load this model first)"


class DeviceMemoryError(WorkbenchError):
    """An allocation that would pass the device's memory or the user's limit."""


@dataclass
class DeviceMemory:
    capacity: int            # bytes the device has for this process
    limit: int = 0           # gpu_device_mem_limit; 0 = no limit
    card: int = 0            # the card's memory, other processes' included (0: not known)
    used: int = 0
    high_water: int = 0      # the most in use since the device was made
    run_peak: int = 0        # the most in use since mark(): a record's own peak, beside the lifetime mark
    by_purpose: dict[str, int] = field(default_factory=dict)
    run_peak_parts: dict[str, int] = field(default_factory=dict)  # by_purpose when run_peak was reached

    @property
    def ceiling(self) -> int:
        return min(self.capacity, self.limit) if self.limit else self.capacity

    @property
    def available(self) -> int:
        return max(0, self.ceiling - self.used)

    def reserve(self, nbytes: int, purpose: str) -> None:
        if nbytes < 0:
            raise ValueError("negative allocation")
        if self.used + nbytes > self.ceiling:
            what = "gpu_device_mem_limit" if self.limit and self.limit < self.capacity else "the device's memory"
            raise DeviceMemoryError(
                f"device allocation of {nbytes} bytes for {purpose} would exceed {what} "
                f"({self.used} of {self.ceiling} bytes in use)")
        self.used += nbytes
        self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) + nbytes
        self.high_water = max(self.high_water, self.used)
        if self.used > self.run_peak:
            self.run_peak = self.used
            self.run_peak_parts = dict(self.by_purpose)

    def mark(self) -> None:
        """A run starts: its peak (run_peak) counts from what is in use now."""
        self.run_peak = self.used
        self.run_peak_parts = dict(self.by_purpose)

    def release(self, nbytes: int, purpose: str) -> None:
        self.used -= nbytes
        self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) - nbytes


def card_memory(total: int, others: int, limit: int = 0) -> DeviceMemory:
    """What this process has of a card of `total` bytes on which other processes hold `others`: the memory they
    leave free, under gpu_device_mem_limit, which bounds this process's own allocations and so never counts theirs.
    The load's CudaDevice (the driver's free memory) and the budget panel's estimate (NVML's total and other
    processes, through its stand-in device) both plan against this."""
    return DeviceMemory(capacity=max(0, total - others), limit=limit, card=total)
