"""The CUDA device: resident experts in GPU slots computed by the CuPy kernels (kernels/gpu),
copies on their own stream through a bounded ring of pinned host memory (pinned_bytes),
bandwidths measured at start-up (host streaming reads too: the miss policy's B_cpu), every
allocation capped."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
import weakref
from collections import deque

import numpy as np

from engine.errors import WorkbenchError, error_reason, gpu_out_of_memory, one_line
from engine.offload.device_memory import DeviceMemoryError, card_memory
from engine.offload.devices import GIB, Bandwidths
from engine.offload.cuda_step import (HostCopies, MergeBufferPool, RoutedBuffers, SplitBuffers, StepBufferPool,
                                      StepBuffers)
from engine.offload.host_copy import take_rows
from engine.offload.host_register import HostRegistration, mapping_regions
from engine.offload.staging import PinnedRing
from engine.records.schema import FALLBACK_NOTE
from engine.units import duration_text
from kernels.gpu.published import PublishTimeout

ALIGN = 256  # byte alignment of every array placed in the pinned ring
# how long a "both" layer's gated merge waits on the device for the CPU's part before it gives up (merge_split then
# adds the part as without the gate): far beyond a warm layer's ~0.1-1 ms, short enough not to look like a hang
GATE_TIMEOUT_S = 1.0
# the GPU expert kernels still loading after this long are being compiled by NVRTC (a prebuilt cubin, or CuPy's cache
# of an earlier compile, loads in well under a second): the load says so then (CudaDevice.ensure_kernels)
KERNEL_NOTICE_AFTER_S = 2.0


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class NoCudaDevice(WorkbenchError):
    """No usable NVIDIA GPU: CuPy missing, no driver, or no device."""


def _cupy():
    try:
        import cupy
    except ModuleNotFoundError:
        raise NoCudaDevice("the CUDA GPU needs CuPy (install with `make install` on a machine with an NVIDIA "
                           "driver)") from None
    except ImportError as exc:  # CuPy 13 installed, its libraries not found
        raise NoCudaDevice(_cupy_load_failure(exc) or f"CuPy does not load ({one_line(exc)})") from None
    return cupy


def _cupy_load_failure(exc: Exception) -> str | None:
    """What is missing where CuPy is installed but its libraries do not load (CuPy 13 raises from `import cupy`, later
    CuPy at its first use), from its message: a banner whose "Original error:" line names the library; None for
    another failure."""
    lines = [line.strip() for line in str(exc).splitlines()]
    if "Failed to import CuPy." not in lines:
        return None
    after = lines.index("Original error:") + 1 if "Original error:" in lines else len(lines)
    original = lines[after] if after < len(lines) else "no reason given"
    if "libcuda.so" in original:
        library = original.split("ImportError: ", 1)[-1].split(":", 1)[0]
        return (f"no NVIDIA driver: CuPy cannot load {library}, the driver's library (install the NVIDIA driver, or "
                "run on the CPU)")
    return (f"CuPy is installed but does not load ({original}): make clean install installs the CuPy build this "
            "driver runs")


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def _driver_problem(cp) -> str | None:
    """Where there is no NVIDIA driver (its version reads 0) or it runs an older CUDA major than this CuPy's runtime
    (cupy-cuda13x on a CUDA 12 driver): said so; None otherwise."""
    try:
        driver, runtime = cp.cuda.runtime.driverGetVersion(), cp.cuda.runtime.runtimeGetVersion()
    except Exception:
        return None
    if not driver:
        return "no NVIDIA driver: CUDA finds none (install the NVIDIA driver, or run on the CPU)"
    if driver // 1000 >= runtime // 1000:
        return None
    return (f"the NVIDIA driver runs CUDA {_cuda_version(driver)}, older than the CUDA {_cuda_version(runtime)} this "
            "CuPy is built for (make clean install installs the builds this driver runs, or update the driver)")


def _visible_devices() -> str:
    """Where CUDA_VISIBLE_DEVICES is set, that it hides the GPUs it does not list (CUDA then finds none, or fewer)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r} hides every GPU it does not list)"


def _check_device(cp, index: int) -> None:
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except AttributeError as exc:  # a cupy folder without its files (one of two builds uninstalled after the other)
        raise NoCudaDevice(f"CuPy is installed incompletely ({exc}): make clean install installs it again") from None
    except Exception as exc:  # cudaErrorNoDevice, driver missing or too old, CuPy's libraries missing
        raise NoCudaDevice(_cupy_load_failure(exc) or _driver_problem(cp)
                           or f"no CUDA device: {error_reason(exc)}{_visible_devices()}") from None
    if count <= index:
        raise NoCudaDevice(f"no CUDA device {index}: {count} found{_visible_devices()}")
    problem = _nvrtc_problem(cp)
    if problem:
        raise NoCudaDevice(problem)


def _nvrtc_problem(cp) -> str | None:
    """Where CuPy cannot load NVRTC, CUDA's runtime compiler: said so, naming the library; None where it loads.
    Without it no GPU code runs, a prebuilt cubin of kernels/gpu or not: CuPy compiles its own kernels (the bandwidth
    probe's copies, cupy.full) with it, and its kernel cache asks NVRTC's version before a cached kernel is used.
    CuPy loads the library at its first NVRTC call, which fails with "CuPy failed to load libnvrtc.so.12: OSError:
    ..."."""
    try:
        cp.cuda.nvrtc.getVersion()
    except Exception as exc:
        reason = error_reason(exc)
        failed = re.match(r"CuPy failed to load (\S+?):", reason)
        library = f"{failed.group(1)}, NVRTC," if failed else f"NVRTC ({reason}),"
        return (f"the GPU kernels cannot be compiled: CuPy cannot load {library} CUDA's runtime compiler (install the "
                "cuda12 or cuda13 extra, which brings it: make clean install)")
    return None


def _cuda_errors(cp) -> tuple[type, ...]:
    """CuPy's errors of the runtime, the driver and its memory pool (those the stand-in CuPy of a test has)."""
    found = (getattr(getattr(cp.cuda, module, None), name, None) for module, name in (
        ("runtime", "CUDARuntimeError"), ("driver", "CUDADriverError"), ("memory", "OutOfMemoryError")))
    return tuple(error for error in found if isinstance(error, type))


def open_cuda_device(mem_limit: int = 0, index: int = 0, report=None, kernels: bool = False) -> "CudaDevice":
    """report: CudaDevice's (what a long load is doing). kernels: the GPU expert kernels loaded too (ensure_kernels),
    for a load that offloads experts: a GPU whose kernels NVRTC or the driver refuse is refused here, before the
    engine is built, not at its first slots."""
    cp = _cupy()
    _check_device(cp, index)
    try:
        device = CudaDevice(index, mem_limit, report)
    except _cuda_errors(cp) as exc:  # found but not usable: busy (exclusive-process mode), its memory taken ...
        reason = f"{type(exc).__name__}: {error_reason(exc)}"
        raise NoCudaDevice(f"CUDA device {index} cannot be opened ({reason})") from None
    if kernels:
        try:
            device.ensure_kernels()
        except NoCudaDevice:
            device.forget_cap()  # now, not once the error's traceback, which holds the device, is dropped
            raise
    return device


def cuda_device_or_cpu(mem_limit: int, mode: str, report=None, kernels: bool = True) -> tuple["CudaDevice | None", str]:
    """The CUDA device, or, where it cannot be used, None and the note that every expert runs on the CPU instead, as
    the window and the command line load; only mode=required refuses (the device's own error). report: CudaDevice's.
    With `kernels` the GPU expert kernels are loaded with it (a compile NVRTC fails, a module the driver refuses: the
    GPU is unusable too); a prebuilt cubin or CuPy's cache of them loads in well under a second, a first compile takes
    1-2 minutes that a load's first slots would take anyway."""
    try:
        return open_cuda_device(mem_limit=mem_limit, report=report, kernels=kernels), ""
    except WorkbenchError as exc:
        if mode == "required":
            raise
        return None, FALLBACK_NOTE.format(exc)


# GPU index -> why its GPU expert kernels were refused in this process (ensure_kernels): the same source, NVRTC and
# driver fail the same way, after NVRTC's 1-2 minutes, at every later load (cuda_device_problem says it too)
_kernels_refused_for: dict[int, str] = {}
# GPU index -> (time.perf_counter at its start, architecture, CuPy's cache folder) of a first compile of its GPU expert
# kernels under way, once its notice is said (ensure_kernels)
_kernels_compiling: dict[int, tuple[float, str, str]] = {}


def kernels_compile_wait(index: int = 0) -> str:
    """Where the GPU expert kernels' first compile runs now for device `index` (past its notice), what a stop of the
    load waits on, as a clause ("the GPU expert kernels' first compile ... later loads"): NVRTC's compile cannot be
    interrupted, and the kernels it makes are kept for the next load; '' where none runs. For any thread (the GUI's)."""
    compiling = _kernels_compiling.get(index)
    if compiling is None:
        return ""
    started, cc, cache = compiling
    return (f"the GPU expert kernels' first compile for sm_{cc} ends: it cannot be interrupted ("
            f"{duration_text(time.perf_counter() - started)} so far, about 1-2 minutes in all), and CuPy's cache in "
            f"{cache} keeps the kernels for later loads")


def cuda_device_problem(index: int = 0) -> str:
    """Why open_cuda_device would refuse device `index` ('' when CuPy and the device are there), without opening it.

    For a thread other than the engine's (the GUI's): opening a CudaDevice measures the host's streaming reads with a
    Numba parallel loop, and GNU OpenMP then keeps a pool of threads for the calling thread for good. Beside the
    engine thread's pool that makes every waiting thread sleep after 100 spins instead of GOMP_SPINCOUNT's, so each
    CPU expert kernel call pays to wake its threads (21 against 90 µs for a small call on the H200 machine,
    NOTES-overhead.md, twelfth session). Opening also times copies through 256 MiB of pinned host memory and 512 MiB
    of GPU memory. Where a load in this process found the GPU's expert kernels refused: why."""
    try:
        _check_device(_cupy(), index)
    except NoCudaDevice as exc:
        return str(exc)
    return _kernels_refused_for.get(index, "")


def _kernel_errors(cp) -> tuple[type, ...]:
    """What loading the GPU expert kernels raises where this GPU cannot have them: NVRTC failing to compile them
    (CuPy's CompileException, with NVRTC's log; NVRTCError: an option or architecture it does not take) or the driver
    refusing the module (CUDADriverError: PTX from an NVRTC newer than the driver ...), besides the runtime's."""
    found = (getattr(getattr(cp.cuda, module, None), name, None) for module, name in (
        ("compiler", "CompileException"), ("nvrtc", "NVRTCError"), ("driver", "CUDADriverError")))
    return tuple(error for error in found if isinstance(error, type)) + _cuda_errors(cp)


def _kernels_refused(exc: Exception, gpu: str) -> str:
    """Why the GPU expert kernels cannot be had for `gpu` (its architecture and name), on one line: NVRTC's first
    error line of its log (its temporary file's folder left out), or NVRTC's, the driver's or the runtime's error."""
    reason = f"{type(exc).__name__}: {error_reason(exc)}"
    if type(exc).__name__ == "CompileException":
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines if re.search(r"\berror\b", line)), lines[0] if lines else "no log")
        return f"NVRTC cannot compile the GPU expert kernels for {gpu}: {re.sub(r'^[^ (]*/', '', first)}"
    if type(exc).__name__ == "NVRTCError":
        return f"NVRTC cannot compile the GPU expert kernels for {gpu} ({reason})"
    if type(exc).__name__ == "CUDADriverError":
        newer = " (made by an NVRTC newer than the driver: update the NVIDIA driver)" if (
            "UNSUPPORTED_PTX_VERSION" in reason) else ""
        return f"the NVIDIA driver refuses the GPU expert kernels for {gpu} ({reason}){newer}"
    return f"the GPU expert kernels cannot be loaded for {gpu} ({reason})"


def _kernel_cache_dir(cp) -> str:
    """Where CuPy keeps the kernels NVRTC compiled for later processes (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    try:
        return str(cp.cuda.compiler.get_cache_dir())
    except Exception:  # noqa: BLE001 - a CuPy without the function: its documented default
        return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def _measure_bandwidths(cp, probe_bytes: int = 256 << 20) -> tuple[float, float]:
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
    return pcie, hbm


def _measure_all(cp) -> Bandwidths:
    """PCIe and HBM, then the host's streaming reads (the CPU kernels' B_cpu for the miss policy)."""
    from engine.offload.host_bandwidth import stream_read_bandwidth

    pcie, hbm = _measure_bandwidths(cp)
    # the probe's buffers, which no accounting counts, go back to the driver (its GPU blocks would otherwise stay
    # cached in CuPy's pool, counted against the pool's limit and beside onnxruntime's arena)
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    return Bandwidths(pcie=pcie, hbm=hbm, cpu=stream_read_bandwidth())


# GPU index -> {id of an open CudaDevice: its gpu_device_mem_limit (0: none)}, changed and applied under the lock: a
# device opens on the engine's thread while another's finalizer runs on whichever thread drops it (reentrant: a
# collection on the thread holding it may finalise one)
_pool_caps: dict[int, dict[int, int]] = {}
_caps_lock = threading.RLock()


def _cap_pool(cp, index: int) -> None:
    """Set CuPy's memory pool limit on GPU `index` from the devices open on it. The pool is the process's, shared by
    every model loaded (side-by-side loads B beside A), so one device's cap cannot be the pool's: the pool's limit is
    the sum of the open devices' caps, and none while any of them has none. Each device's own cap is its
    DeviceMemory's; the pool's limit is the backstop for what that accounting does not see."""
    caps = list(_pool_caps.get(index, {}).values())
    with cp.cuda.Device(index):
        cp.get_default_memory_pool().set_limit(size=0 if 0 in caps or not caps else sum(caps))


def _set_cap(cp, index: int, key: int, cap: int) -> None:
    with _caps_lock:
        _pool_caps.setdefault(index, {})[key] = cap
        _cap_pool(cp, index)


def _forget_cap(cp, index: int, key: int) -> None:
    with _caps_lock:
        _pool_caps.get(index, {}).pop(key, None)
        _cap_pool(cp, index)


class CudaPinnedRing(PinnedRing):
    """The pinned staging ring in page-locked host memory (cupy.cuda.alloc_pinned_memory). Regions
    are handed out in order, wrapping at the end; a region still being copied from (its event not
    yet reached) is waited for before it is written again."""

    kind = "pinned"

    def __init__(self, cp, capacity: int):
        super().__init__(capacity)
        self.cp = cp
        self._memory = cp.cuda.alloc_pinned_memory(capacity)
        self.buffer = np.frombuffer(self._memory, np.uint8, capacity)
        self._head = 0
        self._flight: deque = deque()  # (start, end, event) of copies issued from the ring

    def _retire(self, start: int = 0, end: int = 0) -> None:
        """Forget finished copies; wait for those overlapping [start, end)."""
        kept = deque()
        for region in self._flight:
            r_start, r_end, event = region
            if r_start < end and start < r_end:
                event.synchronize()
            elif not event.done:
                kept.append(region)
                continue
            self.in_use -= r_end - r_start
        self._flight = kept

    def take(self, nbytes: int) -> tuple[int, int]:
        """A region of `nbytes` (rounded up to ALIGN) free to write: (start, end)."""
        nbytes = _round_up(nbytes)
        if nbytes > self.capacity:
            raise DeviceMemoryError(f"the pinned staging ring ({self.capacity} bytes) cannot hold a copy of {nbytes} bytes")
        start = self._head if self._head + nbytes <= self.capacity else 0
        end = start + nbytes
        self._retire(start, end)
        self._head = end
        self._account(nbytes)
        return start, end

    def view(self, start: int, array: np.ndarray) -> np.ndarray:
        """`array` copied into the ring at `start`; returns the pinned copy."""
        pinned = self.buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(pinned, array, casting="no")
        return pinned

    def issued(self, start: int, end: int, stream) -> None:
        """Copies from [start, end) were issued on `stream`: the region is busy until they finish."""
        self._flight.append((start, end, stream.record()))
        self.bytes_copied += end - start
        self.copies += 1

    def wait_all(self) -> None:
        for _start, _end, event in self._flight:
            event.synchronize()
        self._retire()

    def close(self) -> None:
        self.wait_all()
        self.buffer = None
        self._memory = None
        self.cp.get_default_pinned_memory_pool().free_all_blocks()
        self.in_use = 0


def gather_wave(ring: CudaPinnedRing, tensors: dict, experts: np.ndarray, num_experts: int):
    """The rows of `experts` of every per-expert tensor, gathered into one region of the pinned ring:
    (tensors for a GpuQMoE of the wave alone, local ids 0..n-1; region start; region end)."""
    per_expert = {name: t for name, t in tensors.items()
                  if t is not None and t.ndim >= 1 and t.shape[0] == num_experts}
    sizes = {name: _round_up(len(experts) * (t.nbytes // num_experts)) for name, t in per_expert.items()}
    start, end = ring.take(sum(sizes.values()))
    wave_tensors, offset = dict(tensors), start
    for name, t in per_expert.items():
        rows = ring.buffer[offset:offset + len(experts) * (t.nbytes // num_experts)]
        rows = rows.view(t.dtype).reshape((len(experts),) + t.shape[1:])
        take_rows(t, experts, rows)
        wave_tensors[name] = rows.view(_WholeWave)
        offset += sizes[name]
    return wave_tensors, start, end


def staged_bytes(runner) -> int:
    """Bytes one expert of the node takes in the pinned ring (no CuPy): the larger of its stored rows (a prefill
    wave gathers those, gather_wave) and its packed kernel layout (a load into a slot: GpuQMoE.pack_expert of the
    converted layout when the stored one is converted, kernels.gpu.convert), each array aligned. Raises
    UnsupportedLayout for a node the GPU kernels refuse (the engine stages none of those)."""
    from kernels.gpu import convert, layout

    info = runner.info
    num_experts = info.spec.num_experts
    raw = sum(_round_up(t.nbytes // num_experts) for t in runner.tensors.values()
              if t is not None and t.ndim >= 1 and t.shape[0] == num_experts)
    conv = convert.for_gpu(info.spec, runner.tensors)
    packed = 0
    for lay in layout.make_layouts(conv.spec, conv.tensors):
        arrays = [lay.w_bytes, lay.s_len * lay.sdtype.itemsize]
        arrays += [lay.s_len] if lay.has_zp else []
        arrays += [lay.NP * 4] if lay.has_bias else []
        arrays += [lay.s_len * 2] if lay.has_h else []
        packed += sum(_round_up(n) for n in arrays)
    return max(raw, packed, _round_up(info.bytes_per_expert))


def _on_compute_stream(method):
    """Run a CudaSlots method with the device's compute stream current. CuPy's current stream is per thread and
    defaults to the legacy null stream, on which a CUDA graph cannot be captured (GpuQMoE.run_staged)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.device.compute_stream:
            return method(self, *args, **kwargs)
    return run


class CudaSlots:
    """One expert node's slots in GPU memory (a GpuQMoE holding `num_slots` experts). A prefill
    wave gets a short-lived GpuQMoE of its own, inside the staging bytes the engine reserved."""

    device_inputs = True  # a dense part on the GPU may hand this node's inputs over in GPU memory
    # a "both" step launched again as the last one goes straight onto the dense part's stream (_launch_split_again);
    # False: every launch through the compute stream (bench_offload_ab's slots.split_on_dense=0)
    split_on_dense = True

    def __init__(self, device: "CudaDevice", runner, num_slots: int):
        self.device, self.runner = device, runner
        self.name = runner.info.name
        gpu = runner.info.gpu
        if gpu is None:  # the planner gives such nodes no slots; GpuQMoE would refuse them too
            raise ValueError(f"{self.name}: {runner.info.gpu_unsupported}")
        self.expert_bytes = gpu.slot_bytes  # one slot in the kernels' layout (converted, fp16 block-scale copy)
        self.read_bytes = gpu.read_bytes    # what the kernels read of one resident expert
        self.wave_bytes = gpu.wave_bytes    # what a prefill wave copies per expert (converted rows)
        self.num_slots = 0
        self._reserved = 0  # device bytes reserved for the slots (with the host tier: its granule-rounded mappings)
        self.gpu = None
        # every expert also in page-locked host memory, read there by decode launches where it is in no slot
        # (GpuQMoE's host tier); set by OffloadEngine.host_tier, which resizes the slots after
        self.host_tier = False
        self._wave = None
        self._launched = None  # the GpuQMoE of the last launch (this node's, a wave's or the streaming slots'): merges
        # (where its host seconds go, host seconds so far) of a decode launch until its merge or collect: the streaming
        # slots' launch_s for a streamed launch, this node's slot launches' otherwise
        self._launch_host: tuple | None = None
        # host seconds to issue one load (the miss policy's prepare_s): pooled over every node whose slots take
        # experts of this size, so that a node's first copies are priced too, and the slot weighing
        # (OffloadEngine._weigh_miss_slots, which asks one node per layer shape) reads more than one copy's figure
        self._issue = device.load_issue.setdefault(self.expert_bytes, RecentHostSeconds())
        # host seconds of a decode launch from the slots with its merge or collect (the miss policy's launch_s where
        # copies would be the step's only device work), pooled the same way
        self._launching = device.slot_launch.setdefault(self.expert_bytes, RecentHostSeconds())
        self._step_buffers = StepBufferPool(device.cp, runner.info.spec.hidden_size)
        self._prefill = None  # (host activations, their device copy, the results' device sum) until flush
        self._routed: RoutedBuffers | None = None  # launch_routed's kept buffers (decode sizes)
        self._views: tuple | None = None  # (x, logits, router weights, their views) of the last launch_routed
        self._split: SplitBuffers | None = None  # launch_split's kept buffers
        self._merges = MergeBufferPool(device.cp, runner.info.spec.hidden_size)  # merge_on_device's, by shape
        self._host_copies = HostCopies(device.cp)
        # orders two streams (no timing: cheaper to record and wait on); one, recorded again at each use: a wait
        # takes the event as last recorded when the wait is queued
        self._ordering = device.cp.cuda.Event(disable_timing=True)
        self._copied = device.cp.cuda.Event(disable_timing=True)  # the same, for loads on the copy stream
        self._loads_pending = False  # loads issued that the compute stream has not been made to wait for
        self._direct_known: tuple | None = None  # (the registration, _direct's answer) once it has finished
        self.wave_gather_s = 0.0  # of stage()'s seconds, those spent gathering rows into the pinned ring (benchmarks)
        # called with the experts whose rows a copy has read from the mapped weight file on the host, once read: the
        # engine's bounded host cache releases their pages (HostExpertCache.release_after_read)
        self.after_file_read = lambda experts: None
        self.resize(num_slots)

    def _direct(self) -> bool:
        """The node's expert weights lie in the registered (page-locked) file mapping, in a layout the GPU reads
        as stored: copies go straight from there (host_register.py) instead of through the pinned ring."""
        registration = self.device.host_registration
        known = self._direct_known
        if known is not None and known[0] is registration:
            return known[1]
        direct = (registration is not None and not self.runner.info.gpu.conversion
                  and registration.covers(self.runner.tensors["fc1_experts_weights"]))
        if registration is not None and registration.ready.is_set():
            # final once the registration has finished: asked at every copied miss (covers: ~10 µs a call)
            self._direct_known = (registration, direct)
        return direct

    def _make(self, slots: int, resident: list[int], tensors: dict | None = None):
        """A GpuQMoE of `slots` slots for this node's experts (with the host tier where host_tier is set), or for a
        prefill wave's `tensors`."""
        from kernels.gpu.qmoe import GpuQMoE

        self.device.ensure_kernels()
        try:
            return GpuQMoE(self.runner.info.spec, self.runner.tensors if tensors is None else tensors, device=self.device.index,
                           num_slots=max(1, slots), resident=resident, host_tier=self.host_tier and tensors is None)
        except self.device.cp.cuda.memory.OutOfMemoryError as exc:
            raise DeviceMemoryError(f"{self.name}: the GPU ran out of memory for {slots} expert slots ({exc})") from None

    @_on_compute_stream
    def resize(self, num_slots: int) -> None:
        """New, empty slots (the engine uploads the residents again). With the host tier the node's GpuQMoE is made
        even without slots (it reads every expert from host memory), and the device part of its mappings, rounded up
        to the mapping granule, is what is reserved."""
        self.release()
        what = f"expert slots of {self.name}"
        self.device.memory.reserve(num_slots * self.expert_bytes, what)
        self._reserved = num_slots * self.expert_bytes
        self.num_slots = num_slots
        if not (num_slots or self.host_tier):
            return
        try:
            self.gpu = self._make(num_slots, [])
        except Exception:  # out of device memory, or the host tier's mapping refused (HostTierError): nothing kept
            self.release()
            raise
        if self.host_tier and not self._direct():  # the tier was filled with every expert, read from the file
            self.after_file_read(range(self.runner.info.spec.num_experts))
        if self.gpu.tier is not None and self.gpu.tier.device_bytes > self._reserved:
            extra = self.gpu.tier.device_bytes - self._reserved
            try:
                self.device.memory.reserve(extra, what)
            except DeviceMemoryError:
                self.release()
                raise
            self._reserved += extra

    def release(self) -> None:
        """No slots and no GpuQMoE: the device memory they took given back (a re-plan frees every node's first; a
        resize to 0 would make the host tier's GpuQMoE, packing its host rows, only to drop it)."""
        self.device.memory.release(self._reserved, f"expert slots of {self.name}")
        self._reserved = 0
        if self.gpu is not None:
            self.device.quiesce()
        if self._launched is self.gpu:
            self._launched = None  # nor kept by the last launch: a host tier's memory goes with its GpuQMoE
        self.gpu = None
        self.num_slots = 0

    @property
    def host_tier_bytes(self) -> int:
        """Page-locked host memory the host tier maps for this node (0 without it)."""
        return self.gpu.tier.host_bytes if self.gpu is not None and self.gpu.tier is not None else 0

    @property
    def reads_cold(self) -> bool:
        """Whether a decode launch from the slots also computes the experts in no slot (read from the host tier)."""
        return self.host_tier and self.gpu is not None

    def load(self, slot: int, expert: int) -> float:
        """Copy the expert into the slot on the copy stream: straight from the registered mapping and converted on
        the GPU, or converted to the kernel layout on the host and written into the pinned ring first. The compute
        stream waits for the copies before the node's next launch (one wait for all the loads of a step)."""
        started = time.perf_counter()
        self._copy_in(self.gpu, slot, expert)
        # recorded here, not at the launch: a safe point's swaps are issued layer after layer on the one copy stream,
        # and an event recorded at this node's launch would make it wait for the later layers' copies too
        self._copied.record(self.device.copy_stream)
        self._loads_pending = True
        seconds = time.perf_counter() - started  # host seconds before the copy runs
        self._issue.add(seconds)
        return seconds

    @property
    def prepare_s(self) -> float:
        """The miss policy's host seconds to ready one expert for its copy: the median of recent loads of experts
        this size on this device (RecentHostSeconds)."""
        return self._issue.value

    @property
    def launch_s(self) -> float:
        """The miss policy's host seconds of a decode launch from the slots and its merge: what copies cost a step
        with no resident expert routed, whose device part they alone would make (RecentHostSeconds, pooled as
        prepare_s)."""
        return self._launching.value

    @_on_compute_stream
    def stream(self, streaming: "CudaStreamingSlots", experts: list[int]) -> float:
        """Copy decode misses into the shared streaming slots (0, 1, ...) for this node's next launch(streamed=...);
        their earlier contents are no longer valid. Returns the host seconds."""
        started = time.perf_counter()
        streaming.gpu.set_source(self.runner.info.spec, self.runner.tensors)
        copy = self.device.copy_stream
        copy.wait_event(streaming.released)  # no slot is overwritten while a launch still reads it
        issuing = time.perf_counter()
        for slot, expert in enumerate(experts):
            self._copy_in(streaming.gpu, slot, expert)
        streaming.issue.add((time.perf_counter() - issuing) / max(1, len(experts)))
        self._order_after_copies()
        return time.perf_counter() - started

    def _copy_in(self, gpu, slot: int, expert: int) -> None:
        """Issue the copy of this node's expert into `gpu`'s slot on the copy stream."""
        ring = self.device.pinned
        if self._direct():
            # straight from the registered file mapping, put in the kernel layout on the GPU: the host only issues it.
            # Its pages are not released: the DMA reads them after this returns, and page-locked they stay in memory.
            gpu.upload_expert_device(expert, slot, stream=self.device.copy_stream)
            return
        if ring is None:
            with self.device.copy_stream:  # (a copy from pageable memory returns once its source is read)
                gpu.upload_expert(expert, slot, stream=self.device.copy_stream, packed=gpu.pack_expert(expert))
        else:
            packed = gpu.pack_expert(expert)
            sizes = [_round_up(a.nbytes) for proj in packed.values() for a in proj.values()]
            start, end = ring.take(sum(sizes))
            pinned, offset = {}, start
            for name, proj in packed.items():
                pinned[name] = {}
                for key, array in proj.items():
                    pinned[name][key] = ring.view(offset, array)
                    offset += _round_up(array.nbytes)
            with self.device.copy_stream:
                gpu.upload_expert(expert, slot, stream=self.device.copy_stream, packed=pinned)
            ring.issued(start, end, self.device.copy_stream)
        self.after_file_read((expert,))  # packed on the host: the file's rows are read

    def _order_after_copies(self) -> None:
        """Kernels queued on the compute stream from now on see the copies issued so far."""
        self._copied.record(self.device.copy_stream)
        self.device.cp.cuda.get_current_stream().wait_event(self._copied)
        self._loads_pending = False

    def _order_after_loads(self) -> None:
        """Before a launch that reads the node's slots (on the compute stream): the loads issued since the last one
        are waited for, once (the event recorded after the last of them: load)."""
        if self._loads_pending:
            self.device.cp.cuda.get_current_stream().wait_event(self._copied)
            self._loads_pending = False

    @_on_compute_stream
    def stage(self, experts: np.ndarray) -> float:
        """Copy a wave of cold experts to the GPU: their raw rows gathered into the pinned ring,
        copied from there and converted on the GPU in one batch (a GpuQMoE of the wave alone,
        local ids 0..n-1)."""
        started = time.perf_counter()
        experts = np.asarray(experts, dtype=np.int64)
        direct = self._direct()
        ring = None if direct else self.device.pinned  # registered: the wave's rows go over from the mapping
        num_experts = self.runner.info.spec.num_experts
        tensors = self.runner.tensors
        if ring is None:
            wave_tensors = tensors
            resident = [int(e) for e in experts]
        else:
            wave_tensors, start, end = gather_wave(ring, tensors, experts, num_experts)
            resident = list(range(len(experts)))
        self.wave_gather_s += time.perf_counter() - started
        try:
            self._wave = (self._make(len(experts), resident, wave_tensors), None if ring is None else experts)
        finally:
            if ring is not None:  # the wave's GpuQMoE synchronised its uploads: the region is free again
                ring.issued(start, end, self.device.cp.cuda.get_current_stream())
        if not direct:  # the rows were read from the file: gathered into the ring, or uploaded by the wave's GpuQMoE
            self.after_file_read(experts.tolist())
        return time.perf_counter() - started

    @_on_compute_stream
    def launch(self, x2d: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, streamed=None):
        """Compute `expert_ids` (-1: skipped) on the device: from this node's slots, a staged prefill wave, or
        (`streamed`) the streaming slots stream() just filled. Returns the pending work for collect."""
        started = time.perf_counter()
        cp = self.device.cp
        gpu, local = self.gpu if streamed is None else streamed.gpu, None
        if self._wave is not None:
            (gpu, local), self._wave = self._wave, None
        self._launched = gpu
        if local is not None:  # the wave's GpuQMoE numbers its experts 0..n-1
            position = np.clip(np.searchsorted(local, expert_ids), 0, len(local) - 1)
            expert_ids = np.where((expert_ids >= 0) & (local[position] == expert_ids), position, -1)
        if streamed is None:
            self._order_after_loads()
        if x2d.shape[0] <= gpu.decode_max_tokens and x2d.dtype in (np.float32, np.float16):
            # decode: kept pinned and device buffers, one copy in, kernels that zero the output (cuda_step.py)
            with gpu.device:
                buffers = self._step_buffers.take(x2d.shape[0], expert_ids.shape[1])
                start, stop = buffers.start, buffers.stop
                buffers.upload(x2d, expert_ids, weights, cp.cuda.get_current_stream())
                start.record()
                gpu.run_staged(buffers.x, buffers.ids, buffers.w, buffers.out)
                stop.record()
                if streamed is not None:
                    streamed.released.record()
                # finished by the merge or collect
                self._launch_host = (self._launching if streamed is None else streamed.launching,
                                     time.perf_counter() - started)
            return buffers, start, stop
        # prefill: the node's launches of one run (its residents, then every wave) share one upload of the
        # activations and one device accumulator, brought back once by flush()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        x_dev, total = self._prefill_buffers(x2d)
        start.record()
        gpu.run_experts(x_dev, expert_ids, weights, out=total)
        stop.record()
        return None, start, stop

    def _prefill_buffers(self, x2d: np.ndarray):
        """The device copy of `x2d` and the float32 sum of its launches' results, made at the first launch
        with this very array (held until flush, so its identity cannot be reused meanwhile). A copy and a
        read-back per wave cost more than the wave's kernels (Qwen3-30B-A3B-like, 2,048 tokens: 16 MB each
        way, 12 waves per layer)."""
        if self._prefill is None or self._prefill[0] is not x2d:
            cp = self.device.cp
            with cp.cuda.Device(self.device.index):
                self._prefill = (x2d, cp.asarray(x2d), cp.zeros(x2d.shape, cp.float32))
        return self._prefill[1], self._prefill[2]

    @_on_compute_stream
    def collect(self, pending, out: np.ndarray) -> float:
        """The launch's device seconds; a decode launch's result is added to `out` now, a prefill launch's
        at flush()."""
        result, start, stop = pending
        cp = self.device.cp
        if isinstance(result, StepBuffers):
            out += result.download(cp.cuda.get_current_stream())  # waits for the kernels
            self._step_buffers.give_back(result)
        else:
            stop.synchronize()
        seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3
        self._finish_launch(0.0)  # the wait for the device is not host work
        return seconds

    # --- fully resident layers, inputs in GPU memory (the dense part on the GPU): no host round trip ---------

    def holds(self, x) -> bool:
        """Whether `x` lies in GPU memory (a dense part on the GPU left it there): launch_routed takes it, and a
        decode step's result goes back there (merge_on_device)."""
        return isinstance(x, self.device.cp.ndarray)

    def to_host(self, *arrays) -> tuple:
        """`arrays` on the host: those in GPU memory copied over (on the dense part's stream, which made them;
        one wait), the others as they are."""
        cp = self.device.cp
        if not any(isinstance(a, cp.ndarray) for a in arrays):
            return arrays
        stream = self.device.dense_stream or self.device.compute_stream
        with cp.cuda.Device(self.device.index):
            return tuple(self._host_copies.fetch(arrays, stream))

    @_on_compute_stream
    def launch_routed(self, x, logits, router_weights):
        """Every expert of the node resident and the inputs in GPU memory: route and compute on the device, the
        result left there for the next dense segment. No host synchronisation: the compute stream waits for the
        dense part's stream, and the dense part's stream for the launch (one event each way). Returns (the result
        in x's dtype and shape, the pending statistics for routed_done: the routed ids come back with them)."""
        cp = self.device.cp
        spec = self.runner.info.spec
        tokens = x.size // spec.hidden_size
        compute, dense = cp.cuda.get_current_stream(), self.device.dense_stream
        with cp.cuda.Device(self.device.index):
            if dense is not None:  # first: anything below may read the dense part's outputs
                compute.wait_event(dense.record(self._ordering))
            self._order_after_loads()
            x2d, logits, weights = self._routed_views(x, logits, router_weights, tokens)
            buffers = self._routed
            if buffers is None or buffers.key != RoutedBuffers.key_of(tokens, x.dtype):
                buffers = RoutedBuffers(cp, tokens, spec.hidden_size, x.dtype, spec.k)
                if tokens <= self.gpu.decode_max_tokens:
                    self._routed = buffers  # kept: the same pointers at every decode step (CUDA graph replays)
            buffers.start.record(compute)
            self.gpu.run_routed(x2d, logits, buffers.out32, buffers.out, weights, ids_out=buffers.ids)
            buffers.copy_ids(compute)
            buffers.stop.record(compute)
            if dense is not None:
                dense.wait_event(buffers.stop)
        return buffers.result(x.shape), buffers

    def _routed_views(self, x, logits, router_weights, tokens: int) -> tuple:
        """x [T, H], the router logits and weights [T, E] (contiguous) for run_routed: views of the dense part's kept
        output buffers, made once while the same (contiguous) arrays come back at every step (CuPy's reshape costs
        µs a call); a copy, made at every call, where one is not contiguous."""
        cached = self._views
        if cached is not None and cached[0] is x and cached[1] is logits and cached[2] is router_weights:
            return cached[3]
        cp = self.device.cp
        views = (cp.ascontiguousarray(x).reshape(tokens, -1), cp.ascontiguousarray(logits).reshape(tokens, -1),
                 None if router_weights is None else cp.ascontiguousarray(router_weights).reshape(tokens, -1))
        inputs = (x, logits, router_weights)
        if all(a is None or a.flags.c_contiguous for a in inputs):
            self._views = (*inputs, views)
        return views

    # --- partly resident layers whose cold experts the GPU and the CPU share (decode path "both") ---------------

    @property
    def splits_rows(self) -> bool:
        """Whether launch_split splits a pair by rows where the split's rows table says (GpuQMoE.splits_rows) and the
        CPU kernel computes the pair's other rows (CpuQMoE.splits_rows: its fused decode kernel; GpuQMoE's says
        nothing of the node's layout there)."""
        return self.gpu.splits_rows and bool(getattr(self.runner.kernel, "splits_rows", False))

    def launch_split(self, x, logits, router_weights, cpu_take: np.ndarray,
                     split_rows: np.ndarray | None = None) -> SplitBuffers:
        """A decode step of a partly resident layer, inputs in GPU memory, with the host tier: routed on the device,
        where the CPU takes the last cpu_take[c] of a token's c cold pairs (kernels/cold_split.py), and with
        split_rows[c] > 0 the rows of the GPU's last cold pair from split_rows[c] on, and the GPU's decode kernels the
        others at once, resident or read from the tier; the routing and x are published to the host (split_routing
        waits for them). Returns the pending step: launched again as the last one on the dense part's stream where it
        can be (_launch_split_again), else on the compute stream (_launch_split)."""
        tables = (cpu_take, split_rows)
        again = self._launch_split_again(x, logits, router_weights, tables) if self.split_on_dense else None
        return again if again is not None else self._launch_split(x, logits, router_weights, tables)

    def _launch_split_again(self, x, logits, router_weights, tables: tuple) -> SplitBuffers | None:
        """The last launch's graph again, queued on the dense part's stream, where that launch queued its gated merge
        in its graph (every later "both" step of a decode), no load of this node is pending (the compute stream would
        wait for it) and the inputs are that launch's arrays; None otherwise. A graph runs on whichever stream it is
        launched on, and this one's work is ordered by that stream alone: the dense segment before it, the next one
        after its merge. That saves the compute stream's round trip (two event records, two waits, the stream's and
        the device's contexts: the host's time in a layer that waits for the host)."""
        split, dense = self._split, self.device.dense_stream
        if dense is None or split is None or split.merge is None or self._loads_pending:
            return None
        tokens = x.size // self.runner.info.spec.hidden_size
        x2d, logits, weights = self._routed_views(x, logits, router_weights, tokens)
        published = split.published
        graph = self.gpu.split_graph(x2d, logits, split.out32, published, weights, stop=split.stop,
                                     merged=split.merge.sum, timeout_s=GATE_TIMEOUT_S)
        if graph is None:
            return None
        published.set_cpu_take(tables[0], dense, tables[1])
        split.start.record(dense)
        launched_at = time.perf_counter()  # before the launch: a host held after it counts towards a late gate
        self.gpu.relaunch_split(graph, published, dense)
        split.stream, split.launched_at, split.merged_again = dense, launched_at, False
        return split

    @_on_compute_stream
    def _launch_split(self, x, logits, router_weights, tables: tuple) -> SplitBuffers:
        """launch_split on the compute stream, which waits for the dense part's, as in launch_routed; the dense part's
        waits for merge_split."""
        cp = self.device.cp
        spec = self.runner.info.spec
        tokens = x.size // spec.hidden_size
        compute, dense = cp.cuda.get_current_stream(), self.device.dense_stream
        with cp.cuda.Device(self.device.index):
            if dense is not None:
                compute.wait_event(dense.record(self._ordering))
            self._order_after_loads()
            x2d, logits, weights = self._routed_views(x, logits, router_weights, tokens)
            split = self._split
            fresh = split is None or split.key != SplitBuffers.key_of(tokens, x.dtype)
            if fresh:
                split = self._split = SplitBuffers(cp, tokens, spec.hidden_size, spec.k, x.dtype)
                split.sum_buffers = self._merges.take(tokens, x.dtype)  # the same key: taken once, not at each launch
            split.published.set_cpu_take(tables[0], compute, tables[1])
            split.start.record(compute)
            # the gated merge, queued now (in the launch's graph), goes on as soon as the host raises the gate
            # (merge_split); `stop` marks the GPU's part done, before the merge. Not at new buffers' first launch:
            # the host's first step of a shape compiles (Numba: the CPU kernel, the accounts), for longer than the
            # merge waits, and the GPU would spin that long before merge_split made the merge again.
            split.merge = split.sum_buffers if self.gpu.gated_merge and not fresh else None
            # before the launch: a host held after it (a capture's deferred garbage collection) counts towards a late
            # gate, as the merge's own timeout counts from before its gate
            launched_at = time.perf_counter()
            self.gpu.run_routed_split(x2d, logits, split.out32, split.published, weights, stop=split.stop,
                                      merged=None if split.merge is None else split.merge.sum,
                                      timeout_s=GATE_TIMEOUT_S)
            split.stream = compute
            if split.merge is not None:
                split.launched_at, split.merged_again = launched_at, False
                if dense is not None:
                    dense.wait_event(compute.record(self._ordering))
        return split

    def split_routing(self, pending: SplitBuffers, idle=None) -> tuple:
        """(x [T, H], every routed expert id [T, k], the pairs the CPU computes (int32 [T, k], coded as
        kernels/cold_split.py's split_cold_rows), the weights [T, k]) on
        the host once launch_split's routing is published: a spin of a few µs after the routing kernel, no stream
        synchronisation, with `idle`'s work meanwhile (PublishedRouting.wait). x and the weights are views the next
        launch overwrites."""
        published = pending.published
        try:
            # not the stream: the gated merge queued behind it waits for this host
            pending.routing_wait_s = published.wait(pending.stop, idle)
        except PublishTimeout as exc:
            raise WorkbenchError(f"{self.name}: the GPU's routing of a decode step never reached the host ({exc})") \
                from None
        return published.x, published.ids.copy(), published.on_cpu.copy(), published.w

    def routing_waited(self, pending: SplitBuffers) -> bool:
        """Whether split_routing found the routing still to come (the host was there first)."""
        return pending.routing_wait_s > 0.0

    def split_part(self, pending: SplitBuffers) -> np.ndarray | None:
        """Where the CPU adds its part of launch_split's step, once split_routing has returned: with the gated merge
        the published block's float32 [T, H], zeroed, which the merge queued behind the launch reads over PCIe (the
        routing's flag says the GPU is past the last merge that read it); else None (the caller's own buffer)."""
        if pending.merge is None:
            return None
        part = pending.published.part
        part.fill(0.0)
        return part

    def merge_split(self, pending: SplitBuffers, cpu_part: np.ndarray | None, like, ahead: bool = False):
        """launch_split's result in GPU memory for the next dense segment: the GPU's part plus the CPU's (float32
        [T, H] on the host, or None), added in like's dtype on the device; the dense part's stream waits for it, the
        host for nothing. With the gated merge, queued at the launch, the host only raises the gate (cpu_part, where
        there is one, is split_part's buffer). Returns (the result in like's shape, the launch's events for
        merged_done). `ahead`: later work is queued behind the merge already, so a gate raised late is left to the
        caller (split_gate_late) instead of merged again here, which would wait for that work."""
        if pending.merge is not None:
            published = pending.published
            if cpu_part is None:
                published.part.fill(0.0)
            published.open_gate()
            pending.gate_late = time.perf_counter() - pending.launched_at > GATE_TIMEOUT_S / 2  # may have given up
            if pending.gate_late and not ahead:
                self._merge_again_if_gate_failed(pending)
            return pending.merge.result(like.shape), (pending.start, pending.stop)
        merge = pending.sum_buffers
        self._merge_after(pending, merge, cpu_part)
        return merge.result(like.shape), (pending.start, pending.stop)

    def split_result(self, pending: SplitBuffers, like):
        """Where launch_split queued the gated merge: its result in like's shape (GPU memory, written once the gate is
        raised, in stream order), known before the host's part; else None."""
        return None if pending.merge is None else pending.merge.result(like.shape)

    def split_gate_late(self, pending: SplitBuffers) -> bool:
        """Whether merge_split raised the gated merge's gate after the merge may have stopped waiting for it."""
        return pending.merge is not None and pending.gate_late

    def split_gate_on_device(self, pending: SplitBuffers) -> bool:
        """Whether the launch's merge waits for its gate on the GPU, so that any thread may raise it (the host-part
        worker): a gated merge queued at the launch, on a GPU whose merge waits on the device."""
        return pending.merge is not None and getattr(self.gpu, "gate_waits_on_device", False)

    def split_gate_failed(self, pending: SplitBuffers) -> bool:
        """Whether the latest launch's gated merge gave up waiting for the gate (it left the GPU's part alone); read
        once the merge has run."""
        published = pending.published
        return pending.merge is not None and published.gate_failed() == published.launched & 0xFFFFFFFF

    def split_gate_gave_up(self, pending: SplitBuffers) -> bool:
        """Whether the latest launch's gated merge gave up waiting for the gate and its sum was not made again: the
        device's own word, read once the merge has run (a step's logits on the host). split_gate_late, which decides
        at the gate from the host's clock, is the fast path's guess of the same."""
        return self.split_gate_failed(pending) and not pending.merged_again

    def abandon_split(self, pending: SplitBuffers) -> None:
        """Let a gated merge go on without the CPU's part (its step failed on the host): the GPU is not held until
        the gate's timeout."""
        if pending.merge is not None:
            pending.published.part.fill(0.0)
            pending.published.open_gate()

    @_on_compute_stream
    def _merge_after(self, pending: SplitBuffers, merge, cpu_part: np.ndarray | None) -> None:
        """merge.sum = launch_split's GPU part + the CPU's (or None) by merge_sum, queued on the compute stream after
        the CPU's part exists; the dense part's stream waits for it."""
        compute, dense = self.device.cp.cuda.get_current_stream(), self.device.dense_stream
        with self.device.cp.cuda.Device(self.device.index):
            if cpu_part is not None:
                merge.upload(cpu_part, compute, to_sum=False)
            merge.combine(pending.out32, cpu_part is not None, self.gpu.merge_sum)
            if dense is not None:
                dense.wait_event(compute.record(self._ordering))

    def _merge_again_if_gate_failed(self, pending: SplitBuffers) -> None:
        """After a CPU part that took the host longer than the gated merge waits (a first call's compilation, a
        paused host): once the merge has run, if it gave up (it left the GPU's part alone), the CPU's part is added
        by merge_sum, as without the gate, in stream order before the next dense segment."""
        pending.stream.synchronize()  # the stream the launch, and its merge, went to
        if self.split_gate_failed(pending):
            self._merge_after(pending, pending.merge, pending.published.part)
            pending.merged_again = True

    @_on_compute_stream
    def merge_on_device(self, pending, cpu_part: np.ndarray | None, like):
        """A decode step's result left in GPU memory for the next dense segment: the device's part (launch's
        pending, or None) plus the CPU's (float32 [T, H] on the host, or None), added and converted to like's dtype
        on the GPU. The CPU's part goes over from pinned memory, asynchronously; the dense part's stream waits for
        an event after the addition, the host for nothing. Returns (the result in like's shape, the launch's events
        for merged_done, or None)."""
        started = time.perf_counter()
        cp = self.device.cp
        compute, dense = cp.cuda.get_current_stream(), self.device.dense_stream
        hidden = self.runner.info.spec.hidden_size
        with cp.cuda.Device(self.device.index):
            merge = self._merges.take(like.size // hidden, like.dtype)
            buffers = device_out = None
            if pending is not None:
                buffers, start, stop = pending
                if buffers is None:  # launched into the prefill accumulator (inputs the decode path does not take)
                    device_out, self._prefill = self._prefill[2], None
                else:
                    device_out = buffers.out
            if cpu_part is not None:
                merge.upload(cpu_part, compute, to_sum=device_out is None)
            merge.combine(device_out, cpu_part is not None, None if device_out is None else self._launched.merge_sum)
            if dense is not None:
                dense.wait_event(compute.record(self._ordering))
            if buffers is not None:  # its next use is the next step's launch, after the host has waited
                self._step_buffers.give_back(buffers)
        self._finish_launch(time.perf_counter() - started)
        return merge.result(like.shape), None if pending is None else (start, stop)

    def _finish_launch(self, seconds: float) -> None:
        """A decode launch's host seconds, with those of its merge or collect, to the streaming slots' launch_s (a
        streamed launch) or to this node's (launch_s)."""
        if self._launch_host is not None:
            sink, launched = self._launch_host
            sink.add(launched + seconds)
            self._launch_host = None

    def merged_done(self, timing) -> float:
        """Once the launch is done (merged_ready; at the latest at the step's end): its device seconds (0 without
        one)."""
        if timing is None:
            return 0.0
        start, stop = timing
        stop.synchronize()
        return self.device.cp.cuda.get_elapsed_time(start, stop) / 1e3

    def merged_ready(self, timing) -> bool:
        """Whether merged_done would not wait: no launch, or its stop event passed (a query, no wait)."""
        return timing is None or timing[1].done

    def routed_ready(self, pending: RoutedBuffers) -> bool:
        """Whether routed_done would not wait: the launch's stop event passed, and with it the routed ids' copy."""
        return pending.stop.done

    def routed_done(self, pending: RoutedBuffers) -> tuple[np.ndarray, float, float]:
        """Once the launch is done (routed_ready; at the latest at the step's end): (the routed experts' ids [T, k] on
        the host, the launch's device seconds, 0: no stand-in)."""
        pending.stop.synchronize()
        return pending.host_ids, self.device.cp.cuda.get_elapsed_time(pending.start, pending.stop) / 1e3, 0.0

    @_on_compute_stream
    def flush(self, out: np.ndarray) -> None:
        """Add the prefill launches' summed results to `out` (one copy back) and free their buffers."""
        if self._prefill is not None:
            out += self.device.cp.asnumpy(self._prefill[2])
            self._prefill = None


class RecentHostSeconds:
    """Host seconds of a repeated step of the decode path, for the miss policy: the median of the last 16 calls, the
    first left out. A first call pays one-time costs (the pack kernel's loading, a graph's capture) and a pause of the
    host can inflate any call; an inflated figure would make the policy stop copying, and with no copy it would
    never be measured again (seen on the H200: no copy in a whole benchmark after the first)."""

    def __init__(self):
        self._recent: deque = deque(maxlen=16)
        self._calls = 0
        self.value = 0.0

    def add(self, seconds: float) -> None:
        if self._calls:
            self._recent.append(seconds)
            ordered = sorted(self._recent)
            self.value = ordered[len(ordered) // 2]
        self._calls += 1


class CudaStreamingSlots:
    """The decode streaming slots on the GPU (streaming.py): one GpuQMoE of `num_slots` empty slots, shared by the
    nodes of one layout (CudaSlots.stream points it at a node's tensors before copying)."""

    def __init__(self, device: "CudaDevice", runner, num_slots: int):
        from kernels.gpu.qmoe import GpuQMoE

        self.device, self.num_slots = device, num_slots
        self.slot_bytes = runner.info.device_bytes_per_expert
        # the miss policy's prepare_s and launch_s: host seconds to issue one copy into the slots, and of the launch
        # that computes them and the merge of its result (CudaSlots.stream / launch / merge_on_device)
        self.issue = RecentHostSeconds()
        self.launching = RecentHostSeconds()
        device.ensure_kernels()
        device.memory.reserve(num_slots * self.slot_bytes, "decode streaming slots")
        try:
            with device.compute_stream:
                self.gpu = GpuQMoE(runner.info.spec, runner.tensors, device=device.index, num_slots=num_slots,
                                   resident=[])
        except device.cp.cuda.memory.OutOfMemoryError as exc:
            device.memory.release(num_slots * self.slot_bytes, "decode streaming slots")
            raise DeviceMemoryError(f"the GPU ran out of memory for {num_slots} decode streaming slots ({exc})") from None
        # recorded on the compute stream after each launch that reads the slots: copies into them wait for it
        self.released = device.cp.cuda.Event(disable_timing=True)

    @property
    def prepare_s(self) -> float:
        return self.issue.value

    @property
    def launch_s(self) -> float:
        return self.launching.value

    def close(self) -> None:
        if self.gpu is not None:
            self.device.quiesce()
        self.gpu = None
        self.device.memory.release(self.num_slots * self.slot_bytes, "decode streaming slots")


class CudaDevice:
    kind = "cuda"

    def __init__(self, index: int = 0, mem_limit: int = 0, report=None):
        """report: called with a sentence on what the load is doing where it takes long with nothing else to show
        (the kernels compiling: ensure_kernels); from another thread than the load's."""
        cp = _cupy()
        self.cp, self.index = cp, index
        self.report = report or (lambda _text: None)
        self.kernels_ready = False
        self.kernels_note = ""  # where this device's load compiled the kernels: how long it took, where they are kept
        with cp.cuda.Device(index):
            # the model dropped before this load gave its slots back to CuPy's pool, which keeps them cached, not to
            # the driver: returned first, or the driver's free memory leaves them out, as if other processes held them
            cp.get_default_memory_pool().free_all_blocks()
            free, total = cp.cuda.runtime.memGetInfo()
            props = cp.cuda.runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            self.copy_stream = cp.cuda.Stream(non_blocking=True)
            self.compute_stream = cp.cuda.Stream(non_blocking=True)  # every expert kernel and result copy
            self.dense_stream = None  # onnxruntime's stream when the dense part runs on this GPU (LoadedModel)
        # A hard cap on CuPy's allocations (exceeding it is an OutOfMemoryError, never a crash), for as long as this
        # device lives; not while its probe runs: the probe's 512 MiB are given back at once and are not the model's,
        # and another model's cap in force (side by side) may leave no room for them
        self.forget_cap = weakref.finalize(self, _forget_cap, cp, index, id(self))
        _set_cap(cp, index, id(self), 0)
        try:
            with cp.cuda.Device(index):
                self.bandwidths = _measure_all(cp)
        except BaseException:
            self.forget_cap()
            raise
        _set_cap(cp, index, id(self), mem_limit)
        self.memory = card_memory(total, total - free, mem_limit)
        self.host_registration = None  # the experts' file mapping, page-locked in the background (register_experts)
        self.name = f"{name} ({total / GIB:.0f} GiB)"
        self.pinned: CudaPinnedRing | None = None
        self._staged_bytes: dict[str, int] = {}
        self.load_issue: dict[int, RecentHostSeconds] = {}  # per slot size: host seconds of loads (CudaSlots)
        self.slot_launch: dict[int, RecentHostSeconds] = {}  # per slot size: ... of decode launches and merges

    def ensure_kernels(self) -> None:
        """The GPU expert kernels loaded for this GPU's architecture before the first GpuQMoE asks for them
        (kernels.gpu._module: a prebuilt cubin, else NVRTC through CuPy, whose cache keeps them for later loads). A
        first compile takes 1-2 minutes with no progress to show: where the kernels are not ready after
        KERNEL_NOTICE_AFTER_S, `report` says what runs, and once they are, how long it took and where they are kept
        (also kept as kernels_note). Kernels NVRTC cannot compile, or that the driver refuses, are a NoCudaDevice."""
        if self.kernels_ready:
            return
        from kernels.gpu._module import load_module

        cp = self.cp
        with cp.cuda.Device(self.index):
            cc = str(cp.cuda.Device(self.index).compute_capability)
            if self.index in _kernels_refused_for:
                raise NoCudaDevice(_kernels_refused_for[self.index])
            cache = _kernel_cache_dir(cp)
            noticed = threading.Event()

            def notice() -> None:
                noticed.set()
                _kernels_compiling[self.index] = (started, cc, cache)
                self.report(f"Compiling the GPU expert kernels for sm_{cc} (a first load on this GPU without a "
                            f"prebuilt cubin: about 1-2 minutes; later loads take them from CuPy's cache in {cache}).")

            timer = threading.Timer(KERNEL_NOTICE_AFTER_S, notice)
            timer.daemon = True
            started = time.perf_counter()
            timer.start()
            try:
                module, _how = load_module(cc)
                module.get_function("route_topk")  # a module made from source is compiled at its first function
            except _kernel_errors(cp) as exc:
                refused = _kernels_refused(exc, f"sm_{cc}, the {self.name}")
                if not gpu_out_of_memory(exc):  # (memory may be there at the next load)
                    _kernels_refused_for[self.index] = refused
                raise NoCudaDevice(refused) from None
            finally:
                timer.cancel()
                timer.join()  # (a notice under way is said before the note below)
                _kernels_compiling.pop(self.index, None)
        self.kernels_ready = True
        if noticed.is_set():
            self.kernels_note = (f"The GPU expert kernels were compiled for sm_{cc} in "
                                 f"{duration_text(time.perf_counter() - started)}; later loads take them from CuPy's "
                                 f"cache in {cache}.")
            self.report(self.kernels_note)

    def register_experts(self, source, infos, owner) -> HostRegistration:
        """Page-lock the data files holding the experts of `infos` for direct copies (host_register.py), in the
        background, for as long as `owner` (the loaded model) lives."""
        self.host_registration = HostRegistration(self.cp, self.index, mapping_regions(source, infos), owner)
        return self.host_registration

    def unregister_experts(self, why: str) -> None:
        """Undo register_experts for good (HostRegistration.undo): copies go through the pinned ring again, and
        CudaSlots._direct, seeing no registration, says so. The copies still reading the mapping finish first."""
        self.quiesce()
        self.host_registration.undo(why)
        self.host_registration = None

    def staging_bytes_per_expert(self, runner) -> int:
        """Bytes one expert takes in the pinned ring (staged_bytes: stored rows for prefill waves,
        the converted kernel layout for loads into slots)."""
        name = runner.info.name
        if name not in self._staged_bytes:
            self._staged_bytes[name] = staged_bytes(runner)
        return self._staged_bytes[name]

    def set_pinned_ring(self, nbytes: int) -> None:
        """(Re)allocate the pinned staging ring; 0 = none. Waits for copies still reading the old one."""
        if self.pinned is not None and self.pinned.capacity == nbytes:
            return
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None
        if nbytes:
            with self.cp.cuda.Device(self.index):
                self.pinned = CudaPinnedRing(self.cp, nbytes)

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidths.pcie

    def quiesce(self) -> None:
        """Wait for the work queued on every stream of the GPU (loads, launches, onnxruntime's). Slots are freed only
        after this: a load still queued on the copy stream writes the slots and the expert -> slot map, and CuPy's pool
        hands freed memory out again at once, for the compute stream (on the H200 a re-plan's new slots, zeroed under
        a pending pack_expert launch, gave an illegal address)."""
        with self.cp.cuda.Device(self.index):
            self.cp.cuda.runtime.deviceSynchronize()

    def create_slots(self, runner, num_slots: int) -> CudaSlots:
        return CudaSlots(self, runner, num_slots)

    def create_streaming_slots(self, runner, num_slots: int) -> CudaStreamingSlots:
        return CudaStreamingSlots(self, runner, num_slots)


class _WholeWave(np.ndarray):
    """A wave's rows in the pinned ring. The GPU layout code takes `rows[experts]` (an index array);
    for a run of consecutive rows that is a slice of these rows (no pageable copy), so the upload
    reads pinned memory."""

    def __getitem__(self, index):
        base = self.view(np.ndarray)
        if isinstance(index, np.ndarray) and index.ndim == 1 and index.size and index.dtype.kind in "iu":
            first = int(index[0])
            if 0 <= first and first + index.size <= base.shape[0] \
                    and np.array_equal(index, np.arange(first, first + index.size)):
                return base[first:first + index.size]
        return base[index]
