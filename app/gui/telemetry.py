"""The machine, sampled once a second in a small thread of its own (napari's status_checker shape).

CPU per core and in total, host memory (this process, other processes and the kernel, available) and the busiest
other processes through psutil; the GPU through NVML (nvidia-ml-py): memory used by this process
and by others (per process where the driver tells), free memory and utilisation. Without an
NVIDIA GPU the sample carries `gpu: None` and a `gpu_note` saying why, so the graphs can say so
instead of drawing zeros (`gpu_retrying`: NVML is asked again, engine.nvml.Nvml).
"""

from __future__ import annotations

import time

import psutil
from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot

from app.gui.competitors import ProcessWalk
from engine.host_load import cpu_numbers, our_cpus
from engine.nvml import Nvml


def others_memory(total: int, available: int, rss: int, file_backed: int) -> int:
    """Host memory neither available nor this process's: other processes' and the kernel's. This process's file pages
    (the model's mapped weights) are page cache, which `available` counts already: only the rest of its RSS is taken
    off, or a mapped model hid as much of the others' memory (0 beside a 0.5 GB model with 0.4 GB in other processes)."""
    return max(0, total - available - (rss - file_backed))


class SystemProbe:
    """One telemetry sample on demand; keeps the state psutil needs between calls."""

    def __init__(self, nvml: bool = True):
        self.me = psutil.Process()
        self.me.cpu_percent(None)
        psutil.cpu_percent(None, percpu=True)
        psutil.cpu_times_percent(None, percpu=True)  # (primes the steal shares: their own counter, not cpu_percent's)
        self.nvml = Nvml() if nvml else None
        self._walk = ProcessWalk(self.me.pid)
        self._top: tuple[list[dict], list[dict]] = ([], [])
        self._samples = 0

    SCAN_EVERY = 5           # walk every process (for names) once in this many samples...
    SCAN_WHEN_OTHERS = 0.5   # ...and at once when others take this many cores or host memory runs low

    def sample(self) -> dict:
        per_core = psutil.cpu_percent(None, percpu=True)
        steals = [getattr(times, "steal", 0.0) / 100.0 for times in psutil.cpu_times_percent(None, percpu=True)]
        ours = our_cpus(len(per_core))
        # (Linux only) the share of our CPUs' time the hypervisor gave other guests
        steal = sum(steals[cpu] for cpu in ours if cpu < len(steals)) / max(1, len(ours))
        memory = psutil.virtual_memory()
        try:
            own = self.me.memory_info()
            rss, file_backed = own.rss, getattr(own, "shared", 0)  # (shared: Linux's file-backed and shmem pages)
            this_cpu = self.me.cpu_percent(None) / 100.0
        except psutil.Error:
            rss, file_backed, this_cpu = 0, 0, 0.0
        # other processes' CPU on the CPUs this process may run on (a build pinned elsewhere does not compete),
        # without walking them: what those cores did, less this process and less the time the hypervisor gave other
        # guests (psutil counts steal as busy: a VM's steal read as other processes' work)
        others_cpu = max(0.0, sum(per_core[cpu] for cpu in ours) / 100.0 - this_cpu - steal * len(ours))
        low_memory = memory.available < 0.1 * memory.total
        if self._samples % self.SCAN_EVERY == 0 or others_cpu >= self.SCAN_WHEN_OTHERS or low_memory:
            numbers = cpu_numbers(len(per_core))  # (other processes' affinities name CPUs by number)
            self._top = self._walk.walk({numbers[index] for index in ours})
        self._samples += 1
        top_cpu, top_ram = self._top
        gpu = self.nvml.sample() if self.nvml else None
        note = "" if gpu else (self.nvml.note if self.nvml else "GPU sampling is off")
        return {
            "t": time.monotonic(), "wall": time.time(),
            "cpu_per_core": per_core, "cpu_total": sum(per_core) / max(1, len(per_core)), "cpu_ours": ours,
            "this_cpu_cores": this_cpu, "others_cpu_cores": others_cpu, "cpu_steal_share": steal,
            "ram_total": memory.total, "ram_available": memory.available, "ram_this": rss,
            "ram_others": others_memory(memory.total, memory.available, rss, file_backed),
            "top_cpu": top_cpu, "top_ram": top_ram, "gpu": gpu, "gpu_note": note,
            "gpu_retrying": bool(gpu is None and self.nvml and self.nvml.retrying),
        }


def failure_line(exc: Exception) -> str:
    """A sample that raised, in one line naming what raised (psutil.AccessDenied: /proc/stat)."""
    package = type(exc).__module__.split(".")[0]
    name = type(exc).__name__ if package == "builtins" else f"{package}.{type(exc).__name__}"
    what = f"{name}: {exc}" if str(exc) else name
    return f"Sampling the machine failed ({what}); the graphs resume when a sample works."


class Sampler(QObject):
    """Lives in its own QThread; a QTimer there takes a sample every `interval_ms`. A sample that raises is never worth
    a crash: `failed` says so once, until a sample works again."""

    sampled = Signal(dict)
    failed = Signal(str)
    _start = Signal()
    _stop = Signal()

    def __init__(self, probe: SystemProbe, interval_ms: int = 1000):
        super().__init__()
        self.interval_ms = interval_ms
        self._probe = probe
        self._timer: QTimer | None = None
        self._failing = False
        self._start.connect(self._begin)
        # Blocking: the timer must be stopped and freed in the thread that owns it.
        self._stop.connect(self._end, Qt.ConnectionType.BlockingQueuedConnection)

    @Slot()
    def _begin(self) -> None:
        if self._timer is None:
            self._timer = QTimer(self)
            self._timer.timeout.connect(self._tick)
        self._timer.start(self.interval_ms)

    @Slot()
    def _end(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer.setParent(None)
            self._timer = None

    @Slot()
    def _tick(self) -> None:
        try:
            sample = self._probe.sample()
        except Exception as exc:  # the next one comes in a second
            if not self._failing:
                self._failing = True
                self.failed.emit(failure_line(exc))
            return
        self._failing = False
        sample["sent"] = time.monotonic()  # (the tokens/s graph's clock: GraphsPanel.add_sample)
        self.sampled.emit(sample)


class SamplerThread:
    """Owns the sampler's thread. The probe is made here, on the caller's (the window's) thread: opening NVML loads
    its shared library (dlopen), and a dlopen on the telemetry thread while the window's thread built or collected Qt
    objects deadlocked the test suite (the dynamic loader's lock against the interpreter's)."""

    def __init__(self, interval_ms: int = 1000, nvml: bool = True):
        self.thread = QThread()
        self.thread.setObjectName("telemetry")
        self.sampler = Sampler(SystemProbe(nvml), interval_ms)
        self.sampler.moveToThread(self.thread)
        self.thread.start()
        self.sampler._start.emit()

    def stop(self) -> None:
        if self.thread.isRunning():
            self.sampler._stop.emit()
        self.thread.quit()
        self.thread.wait(5000)
