"""The CUDA device: resident experts in GPU slots computed by the CuPy kernels (kernels/gpu),
copies on their own stream, bandwidths measured at start-up, every allocation capped."""

from __future__ import annotations

import time

import numpy as np

from engine.errors import WorkbenchError
from engine.offload.device_memory import DeviceMemory, DeviceMemoryError
from engine.offload.devices import GIB, Bandwidths


class NoCudaDevice(WorkbenchError):
    """No usable NVIDIA GPU: CuPy missing, no driver, or no device."""


def _cupy():
    try:
        import cupy
    except ImportError:
        raise NoCudaDevice("--device cuda needs CuPy (install with `make install` on a machine with an NVIDIA driver)") from None
    return cupy


def open_cuda_device(mem_limit: int = 0, index: int = 0) -> "CudaDevice":
    cp = _cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorNoDevice, driver missing or too old
        raise NoCudaDevice(f"no CUDA device: {str(exc).splitlines()[0]}") from None
    if count <= index:
        raise NoCudaDevice(f"no CUDA device {index}: {count} found")
    return CudaDevice(index, mem_limit)


def _measure_bandwidths(cp, probe_bytes: int = 256 << 20) -> Bandwidths:
    """Host->device from pinned memory and device->device copies, timed with events."""
    host = cp.cuda.alloc_pinned_memory(probe_bytes)
    host_view = np.frombuffer(host, np.uint8, probe_bytes)
    host_view[:] = 1
    a = cp.empty(probe_bytes, cp.uint8)
    b = cp.empty(probe_bytes, cp.uint8)
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(copy) -> float:
        copy()  # warm-up
        start.record()
        for _ in range(3):
            copy()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / 1e3 / 3

    pcie = probe_bytes / timed(lambda: a.set(host_view))
    hbm = 2 * probe_bytes / timed(lambda: b.__setitem__(slice(None), a))  # read + write
    return Bandwidths(pcie=pcie, hbm=hbm)


class CudaSlots:
    """One expert node's slots in GPU memory (a GpuQMoE holding `num_slots` experts). A prefill
    wave gets a short-lived GpuQMoE of its own, inside the staging bytes the engine reserved."""

    def __init__(self, device: "CudaDevice", runner, num_slots: int):
        self.device, self.runner = device, runner
        self.name = runner.info.name
        self.expert_bytes = runner.info.bytes_per_expert
        self.num_slots = 0
        self.gpu = None
        self._wave = None
        self.resize(num_slots)

    def _make(self, slots: int, resident: list[int]):
        from kernels.gpu.qmoe import GpuQMoE

        try:
            return GpuQMoE(self.runner.info.spec, self.runner.tensors, device=self.device.index,
                           num_slots=max(1, slots), resident=resident)
        except self.device.cp.cuda.memory.OutOfMemoryError as exc:
            raise DeviceMemoryError(f"{self.name}: the GPU ran out of memory for {slots} expert slots ({exc})") from None

    def resize(self, num_slots: int) -> None:
        """New, empty slots (the engine uploads the residents again)."""
        self.device.memory.release(self.num_slots * self.expert_bytes, f"expert slots of {self.name}")
        self.gpu = None
        self.device.memory.reserve(num_slots * self.expert_bytes, f"expert slots of {self.name}")
        self.gpu = self._make(num_slots, []) if num_slots else None
        self.num_slots = num_slots

    def load(self, slot: int, expert: int) -> float:
        started = time.perf_counter()
        with self.device.copy_stream:
            self.gpu.upload_expert(expert, slot, stream=self.device.copy_stream)
        # Kernels on the compute stream must see the copy: order them after it.
        self.device.cp.cuda.get_current_stream().wait_event(self.device.copy_stream.record())
        return time.perf_counter() - started

    def stage(self, experts: np.ndarray) -> float:
        """Copy a wave of cold experts to the GPU (converted there in one batch)."""
        started = time.perf_counter()
        self._wave = self._make(len(experts), [int(e) for e in experts])
        return time.perf_counter() - started

    def launch(self, x2d: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray):
        cp = self.device.cp
        gpu, self._wave = (self._wave, None) if self._wave is not None else (self.gpu, None)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        out = gpu.run_experts(cp.asarray(x2d), expert_ids, weights,
                              out=cp.zeros((x2d.shape[0], x2d.shape[1]), cp.float32))
        stop.record()
        return out, start, stop

    def collect(self, pending, out: np.ndarray) -> float:
        result, start, stop = pending
        out += self.device.cp.asnumpy(result)  # waits for the kernels
        return self.device.cp.cuda.get_elapsed_time(start, stop) / 1e3


class CudaDevice:
    kind = "cuda"

    def __init__(self, index: int = 0, mem_limit: int = 0):
        cp = _cupy()
        self.cp, self.index = cp, index
        with cp.cuda.Device(index):
            free, total = cp.cuda.runtime.memGetInfo()
            props = cp.cuda.runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            if mem_limit:
                # A hard cap on every CuPy allocation: exceeding it is an OutOfMemoryError, never a crash.
                cp.get_default_memory_pool().set_limit(size=mem_limit)
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
            self.bandwidths = _measure_bandwidths(cp)
        self.memory = DeviceMemory(capacity=free, limit=mem_limit)
        self.name = f"{name} ({total / GIB:.0f} GiB)"

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidths.pcie

    def create_slots(self, runner, num_slots: int) -> CudaSlots:
        return CudaSlots(self, runner, num_slots)
