"""Where resident experts live. The simulated device has the same interface as a GPU: byte
accounting, per-node slots, a copy-cost model; it computes with the CPU kernels, so CI (no GPU)
and "what if I had an 8 GB card?" run the real offload logic.

It stands in for the CUDA device, so it counts what the CUDA device would: a slot takes an expert in
the GPU kernels' layout (ExpertNodeInfo.gpu, converted layouts included), copies move that layout,
and nodes the GPU kernels refuse get no slots (the planner decides, for both devices).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.offload.device_memory import card_memory
from engine.offload.staging import PinnedRing
from engine.units import human_bytes
from kernels.cold_split import device_spans, gpu_rows_of_split, split_cold_rows
from kernels.cpu.routing import route

GIB = 1 << 30
# A decode kernel reads experts in page-locked host memory (the host tier) at this share of the pinned copy's rate
# (RESULTS.md, twenty-seventh session: 0.90-0.92 on the H200 machine)
TIER_READ_SHARE = 0.9


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second, measured at start-up on a real device, assumed on the simulated one."""
    pcie: float = 25e9        # host -> device copies from pinned memory, bytes/s
    hbm: float = 1000e9       # device reads of resident weights, bytes/s
    cpu: float = 40e9         # CPU expert kernels reading host weights (decode), bytes/s
    cpu_flops: float = 500e9  # CPU expert kernels on many tokens (prefill), FLOP/s


class SimulatedSlots:
    """One expert node's slots on the simulated device: slot -> expert, computed by the CPU kernel.

    The interface every device's slots share: resize(n); load(slot, expert) -> copy seconds;
    stage(experts) -> copy seconds (the prefill staging ring); launch(x2d, ids, weights) -> pending
    work (asynchronous on a real GPU), then collect(pending, out) adds it into `out` and returns
    the device seconds. Every copy goes through the device's pinned staging ring.

    `standin_s` adds up the wall time launch() spends computing the "device" experts with the CPU kernel,
    synchronously: what a real card would not cost the host (the hybrid node moves it into its layer's
    LayerStats.standin_s; engine/offload/projection.py takes it out of the measured time).
    """

    def __init__(self, device: "SimulatedDevice", runner, num_slots: int):
        self.device, self.name, self.kernel = device, runner.info.name, runner.kernel
        gpu = runner.info.gpu
        if gpu is None:
            raise ValueError(f"{self.name}: {runner.info.gpu_unsupported}")
        self.expert_bytes = gpu.slot_bytes  # device memory per slot, and what a load copies (the packed expert)
        self.read_bytes = gpu.read_bytes    # what computing one resident expert reads from device memory
        self.wave_bytes = gpu.wave_bytes    # what a prefill wave copies per expert
        self.stored_bytes = runner.info.bytes_per_expert  # a wave's rows as gathered into the pinned ring
        self.tier_device_bytes = gpu.tier_device_bytes
        self.num_experts = runner.info.spec.num_experts
        self.num_slots = 0
        self._reserved = 0  # device bytes reserved for the slots (with the host tier: its granule-rounded mappings)
        # every expert also in host memory, read there by decode launches where it is in no slot (CudaSlots' host
        # tier): its bytes counted, its reads priced at TIER_READ_SHARE of PCIe; set by the offload engine
        self.host_tier = False
        self._held = np.full(0, -1)  # the expert each slot holds: what a routed launch reads from device memory
        self.standin_s = 0.0
        self._merged: dict = {}  # merge_on_device's results, by shape and dtype
        # called with the experts the stand-in has read from the mapped weight file, once read: a card reads them in
        # its own memory, so the engine's bounded host cache releases their pages (HostExpertCache.release_after_read)
        self.after_file_read = lambda experts: None
        self.resize(num_slots)

    def resize(self, num_slots: int) -> None:
        """New, empty slots. With the host tier, what CudaSlots reserves for them: the tier's device mappings, each
        slot array rounded up to the mapping granule (a mapping even without slots)."""
        self.release()
        need = self.tier_device_bytes(num_slots) if self.host_tier else num_slots * self.expert_bytes
        self.device.memory.reserve(need, f"expert slots of {self.name}")
        self._reserved = need
        self.num_slots = num_slots
        self._held = np.full(num_slots, -1)

    def release(self) -> None:
        """No slots (and no tier mappings): their device memory given back."""
        self.device.memory.release(self._reserved, f"expert slots of {self.name}")
        self._reserved = 0
        self.num_slots = 0
        self._held = np.full(0, -1)

    @property
    def reads_cold(self) -> bool:
        """Whether a decode launch from the slots also computes the experts in no slot (read from the host tier)."""
        return self.host_tier

    @property
    def host_tier_bytes(self) -> int:
        """Host memory the host tier would hold for this node (0 without it): every expert in the kernels' layout."""
        return self.num_experts * self.expert_bytes if self.host_tier else 0

    def load(self, slot: int, expert: int) -> float:
        """Copy one expert into a slot; returns the modelled copy time."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"{self.name}: slot {slot} of {self.num_slots}")
        self.device.through_pinned([self.expert_bytes])
        self._held[slot] = expert
        return self.device.copy_seconds(self.expert_bytes)

    def stream(self, streaming: "SimulatedStreamingSlots", experts: list[int]) -> float:
        """Copy decode misses into the shared streaming slots for the next launch(streamed=...); returns the
        modelled copy time."""
        if len(experts) > streaming.num_slots:
            raise IndexError(f"{self.name}: {len(experts)} experts for {streaming.num_slots} streaming slots")
        self.device.through_pinned([self.expert_bytes] * len(experts))
        return self.device.copy_seconds(len(experts) * self.expert_bytes)

    def stage(self, experts: np.ndarray) -> float:
        """Copy cold experts into the staging ring for one wave; returns the modelled copy time."""
        self.device.through_pinned([self.stored_bytes] * len(experts))
        return self.device.copy_seconds(len(experts) * self.wave_bytes)

    def launch(self, x2d: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, streamed=None):
        """Compute `expert_ids` (-1: skipped) on the "device" (the CPU kernel; from this node's slots, a staged wave
        or the streaming slots alike); returns (the result, the modelled device seconds) for collect."""
        started = time.perf_counter()
        partial = np.zeros((x2d.shape[0], self.kernel.spec.hidden_size), np.float32)
        self.kernel.run_experts(x2d, expert_ids, weights, out=partial)
        read = set(expert_ids[expert_ids >= 0].tolist())
        self.after_file_read(read)
        self.standin_s += time.perf_counter() - started
        return partial, len(read) * self.read_bytes / self.device.bandwidths.hbm

    def collect(self, pending, out: np.ndarray) -> float:
        partial, seconds = pending
        out += partial
        return seconds

    def flush(self, out: np.ndarray) -> None:
        """Results a device may hold back until the node's last collect (CudaSlots: prefill); here none."""

    # Inputs and results in the device's memory (CudaSlots.holds); here NumPy is device memory.
    def holds(self, x) -> bool:
        return True

    def merge_on_device(self, pending, cpu_part: np.ndarray | None, like: np.ndarray):
        """The CPU's part of a decode step (or None) added to the device's (launch's pending, or None), in like's
        dtype and shape, and the pending device seconds for merged_done."""
        hidden = self.kernel.spec.hidden_size
        total = np.zeros((like.size // hidden, hidden), np.float32) if cpu_part is None else cpu_part.copy()
        seconds = 0.0
        if pending is not None:
            partial, seconds = pending
            total += partial
        key = (like.shape, like.dtype.str)
        result = self._merged.get(key)  # kept, as CudaSlots keeps its: the next segment finds the same array
        if result is None:
            result = self._merged[key] = np.empty(like.shape, like.dtype)
        np.copyto(result, total.reshape(like.shape), casting="same_kind")
        return result, seconds

    def merged_done(self, seconds: float) -> float:
        return seconds

    def merged_ready(self, seconds: float) -> bool:
        """Whether merged_done would not wait (CudaSlots: the launch's stop event); here nothing runs apart."""
        return True

    def to_host(self, *arrays) -> tuple:
        return arrays

    def launch_routed(self, x: np.ndarray, logits: np.ndarray, router_weights):
        """Route and compute every expert on the "device" (the CPU kernel); returns (the result in x's dtype and
        shape, what routed_done gives back: the routed ids, the modelled device seconds, the stand-in's wall time)."""
        started = time.perf_counter()
        spec = self.kernel.spec
        x2d = x.reshape(-1, spec.hidden_size)
        ids, weights = route(np.asarray(logits).reshape(x2d.shape[0], -1), spec, router_weights)
        out = np.zeros((x2d.shape[0], spec.hidden_size), np.float32)
        self.kernel.run_experts(x2d, ids, weights, out=out)
        read = set(ids.ravel().tolist())
        self.after_file_read(read)
        seconds = self._read_seconds(read)
        result = out.astype(x.dtype, copy=False).reshape(x.shape)
        return result, (ids, seconds, time.perf_counter() - started)

    def routed_done(self, pending) -> tuple[np.ndarray, float, float]:
        return pending

    @property
    def splits_rows(self) -> bool:
        """Whether launch_split splits a pair by rows where the split's rows table says (CudaSlots.splits_rows): the
        stand-in kernel computes a part of an expert's rows."""
        return bool(getattr(self.kernel, "splits_rows", False))

    def launch_split(self, x: np.ndarray, logits: np.ndarray, router_weights, cpu_take: np.ndarray,
                     split_rows: np.ndarray | None = None) -> tuple:
        """CudaSlots.launch_split on the "device": routed here, the CPU's pairs (and a pair split by rows) chosen by
        route_split's rule (kernels/cold_split.py), the others computed with the CPU kernel as the stand-in and priced
        as the GPU reads them (residents at HBM's rate, cold experts at the tier's). Returns the pending step for
        split_routing and merge_split."""
        started = time.perf_counter()
        spec = self.kernel.spec
        x2d = np.array(x, copy=True).reshape(-1, spec.hidden_size)  # the dense part may reuse its buffers
        ids, weights = route(np.asarray(logits).reshape(x2d.shape[0], -1), spec, router_weights)
        held = np.isin(ids, self._held[self._held >= 0])
        on_cpu = split_cold_rows(~held, cpu_take, np.zeros_like(cpu_take) if split_rows is None else split_rows)
        partial = np.zeros((x2d.shape[0], spec.hidden_size), np.float32)
        spans = device_spans(ids, on_cpu, spec.num_experts, spec.inter_size)
        self.kernel.run_experts(x2d, np.where(on_cpu == 1, -1, ids), weights, out=partial, spans=spans)
        read = set(ids[on_cpu != 1].tolist())
        self.after_file_read(read)
        # a split pair (always cold) is read up to its rows alone, as the GPU's decode kernels read it
        unread = int(np.count_nonzero(on_cpu > 1)) - gpu_rows_of_split(on_cpu, spec.inter_size)
        seconds = self._read_seconds(read, unread)
        self.standin_s += time.perf_counter() - started
        return x2d, ids, on_cpu, weights, partial, seconds

    def _read_seconds(self, experts: set, unread: float = 0.0) -> float:
        """Modelled device seconds of a routed launch reading `experts`: those in a slot at HBM's rate, with the host
        tier the others at TIER_READ_SHARE of PCIe, less `unread` cold experts' worth (the CPU's rows of split
        pairs)."""
        bw = self.device.bandwidths
        cold = len(experts - set(self._held.tolist())) if self.host_tier else 0
        return self.read_bytes * ((len(experts) - cold) / bw.hbm + (cold - unread) / (TIER_READ_SHARE * bw.pcie))

    def split_routing(self, pending: tuple, idle=None) -> tuple:
        """(x, every routed id, the CPU's pairs as split_cold_rows codes them, the weights) of launch_split's step
        (routed already: no wait, so nothing for `idle`)."""
        return pending[:4]

    def routing_waited(self, pending: tuple) -> bool:
        return False  # (routed at the launch)

    def split_part(self, pending: tuple) -> None:
        """CudaSlots.split_part: no gated merge here, the CPU's part goes into the caller's buffer."""
        return None

    def merge_split(self, pending: tuple, cpu_part: np.ndarray | None, like: np.ndarray, ahead: bool = False):
        """launch_split's GPU part plus the CPU's (or None), in like's dtype and shape, and its modelled seconds."""
        return self.merge_on_device(pending[4:], cpu_part, like)

    def split_result(self, pending: tuple, like: np.ndarray) -> None:
        """CudaSlots.split_result: no merge is queued at the launch here, the result comes from merge_split."""
        return None

    def split_gate_late(self, pending: tuple) -> bool:
        return False  # (no gate)

    def split_gate_gave_up(self, pending: tuple) -> bool:
        return False  # (no gate)

    def abandon_split(self, pending: tuple) -> None:
        """CudaSlots.abandon_split: nothing waits for the host here."""

    def routed_ready(self, pending) -> bool:
        """Whether routed_done would not wait (CudaSlots: the launch's stop event); here nothing runs apart."""
        return True


class SimulatedStreamingSlots:
    """The decode streaming slots on the simulated device (streaming.py): their bytes, counted."""

    def __init__(self, device: "SimulatedDevice", runner, num_slots: int):
        self.device, self.num_slots = device, num_slots
        self.slot_bytes = runner.info.device_bytes_per_expert
        self.prepare_s = 0.0  # no host work readies a simulated copy ...
        self.launch_s = 0.0   # ... or launches it (its stand-in compute is taken out of the projection)
        device.memory.reserve(num_slots * self.slot_bytes, "decode streaming slots")

    def close(self) -> None:
        self.device.memory.release(self.num_slots * self.slot_bytes, "decode streaming slots")


class SimulatedDevice:
    kind = "simulated"

    def __init__(self, total_bytes: int = 8 * GIB, mem_limit: int = 0, bandwidths: Bandwidths = Bandwidths(),
                 name: str | None = None, others_bytes: int = 0):
        # others_bytes: what other processes hold on the card stood in for (the budget panel's estimate)
        self.total_bytes, self.others_bytes = total_bytes, others_bytes
        self.memory = card_memory(total_bytes, others_bytes, mem_limit)
        self.bandwidths = bandwidths
        self.name = name or f"simulated GPU, {human_bytes(total_bytes)}"
        self.pinned: PinnedRing | None = None  # set by the offload engine (pinned_bytes)

    def beside(self, mem_limit: int = 0) -> "SimulatedDevice":
        """The same card for another model loaded beside this device's (side by side's B): what this device holds now
        is held there, as a CudaDevice opened beside another sees the driver's free memory."""
        return SimulatedDevice(self.total_bytes, mem_limit, self.bandwidths, self.name,
                               self.others_bytes + self.memory.used)

    def staging_bytes_per_expert(self, runner) -> int:
        """Bytes one expert of this node takes in the pinned staging ring: as the CUDA device counts them."""
        from engine.offload.cuda_device import staged_bytes

        return staged_bytes(runner)

    def set_pinned_ring(self, nbytes: int) -> None:
        """(Re)size the pinned staging ring; 0 = none. Counters start again with a new size."""
        if self.pinned is not None and self.pinned.capacity == nbytes:
            return
        if self.pinned is not None:
            self.pinned.close()
        self.pinned = PinnedRing(nbytes) if nbytes else None

    def through_pinned(self, sizes: list[int]) -> None:
        if self.pinned is not None:
            self.pinned.transfer(sizes)

    def quiesce(self) -> None:
        """CudaDevice.quiesce: nothing is ever queued here (the stand-in computes at once)."""

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidths.pcie

    def create_slots(self, runner, num_slots: int) -> SimulatedSlots:
        return SimulatedSlots(self, runner, num_slots)

    def create_streaming_slots(self, runner, num_slots: int) -> SimulatedStreamingSlots:
        return SimulatedStreamingSlots(self, runner, num_slots)
