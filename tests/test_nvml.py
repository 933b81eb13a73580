"""The NVIDIA GPU through NVML (engine/nvml.py) with a stand-in for nvidia-ml-py, and the run records' peaks
that come from it (this process's VRAM) and from the staging ring (pinned memory)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import engine.nvml as nvml
from engine.offload.device_memory import DeviceMemory
from engine.records.scenarios import PeakSampler, pinned_bytes


class FakeNvml:
    """nvidia-ml-py's surface that engine.nvml.Nvml uses."""

    def __init__(self, processes, hide_per_process=False):
        self.processes = processes
        self.hide = hide_per_process

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return "gpu0"

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA Test GPU"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=80 << 30, used=30 << 30, free=50 << 30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=42)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=None if self.hide else used) for pid, used in self.processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return []


def test_nvml_sample_splits_this_process_from_others(monkeypatch):
    import os

    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(os.getpid(), 6 << 30), (os.getppid(), 20 << 30)]))
    sample = nvml.Nvml().sample()
    assert sample["name"] == "NVIDIA Test GPU" and sample["util"] == 42.0
    assert sample["this"] == 6 << 30 and sample["others"] == 24 << 30 and sample["free"] == 50 << 30
    assert sample["top"][0]["bytes"] == 20 << 30 and sample["per_process"]
    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(os.getpid(), 0)], hide_per_process=True))
    hidden = nvml.Nvml().sample()
    assert not hidden["per_process"] and hidden["this"] == 0 and hidden["others"] == 30 << 30


def test_in_a_containers_pid_namespace_this_process_vram_is_not_counted_as_the_others(monkeypatch):
    """NVML gives the host's pids: in a container none is this process's, though one of them is this process. Its
    20 GiB read as another process's ("Other processes hold 20.0 GiB of the GPU's 80.0 GiB: pid 999999999"), a
    warning about the model's own memory while it generated."""
    from tests.test_gui_parts import warned

    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(999_999_999, 20 << 30)]))  # no such pid on this system
    sample = nvml.Nvml().sample()
    assert not sample["per_process"] and sample["this"] == 0 and sample["top"] == []
    calm = {"cpu_per_core": [10.0] * 8, "others_cpu_cores": 0.0, "ram_total": 100, "ram_available": 50}
    assert warned(dict(calm, gpu=sample)) == []


class DriverReserves(FakeNvml):
    """A card whose driver holds `reserved` bytes of no process's beside the processes' own."""

    def __init__(self, processes, reserved):
        super().__init__(processes)
        self.reserved = reserved

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = self.reserved + sum(used for _pid, used in self.processes)
        return SimpleNamespace(total=8 << 30, used=used, free=(8 << 30) - used)


def test_the_drivers_own_reservations_are_not_another_process_holding_vram(monkeypatch):
    """On an 8 GiB card, the driver's 600 MiB (there with nothing running) and a 300 MiB process read as other
    processes holding 900 MiB, over the warning's 10%: 'Other processes hold 900.0 MiB of the GPU's 8.0 GiB'. What
    NVML lists under other processes counts; the card's memory left to this one (the budget panel's) keeps all."""
    from tests.test_gui_parts import warned

    calm = {"cpu_per_core": [10.0] * 8, "others_cpu_cores": 0.0, "ram_total": 100, "ram_available": 50}
    monkeypatch.setattr(nvml, "pynvml", DriverReserves([(os.getpid(), 5 << 30), (os.getppid(), 300 << 20)], 600 << 20))
    sample = nvml.Nvml().sample()
    assert sample["others"] == 900 << 20 and sample["listed"] == 300 << 20 and sample["per_process"]
    assert warned(dict(calm, gpu=sample)) == []
    monkeypatch.setattr(nvml, "pynvml", DriverReserves([(os.getpid(), 5 << 30), (os.getppid(), 1 << 30)], 600 << 20))
    busy = nvml.Nvml().sample()
    assert [text.split(":")[0] for text in warned(dict(calm, gpu=busy))] == [
        "Other processes hold 1.0 GiB of the GPU's 8.0 GiB"]


class WithDisplay(DriverReserves):
    """A card that also draws the screen: `drawing` are NVML's graphics processes."""

    def __init__(self, processes, drawing):
        super().__init__(processes + drawing, 0)
        self.computing, self.drawing = processes, drawing

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.computing]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.drawing]


def test_the_display_server_drawing_the_window_is_not_another_process_competing_for_vram(monkeypatch):
    """The display server (here pid 1) drawing the chat on an 8 GiB card held 900 MiB, and the banner said 'Other
    processes hold 900.0 MiB of the GPU's 8.0 GiB' with it named, a competitor no one pauses. A process that only
    draws is left out; one that computes and draws counts, once."""
    from tests.test_gui_parts import warned

    calm = {"cpu_per_core": [10.0] * 8, "others_cpu_cores": 0.0, "ram_total": 100, "ram_available": 50}
    monkeypatch.setattr(nvml, "pynvml", WithDisplay([(os.getpid(), 5 << 30)], [(1, 900 << 20)]))
    sample = nvml.Nvml().sample()
    assert sample["others"] == 900 << 20 and sample["listed"] == 0 and sample["top"] == [] and sample["per_process"]
    assert warned(dict(calm, gpu=sample)) == []
    monkeypatch.setattr(nvml, "pynvml", WithDisplay([(os.getpid(), 5 << 30), (os.getppid(), 1 << 30)],
                                                    [(1, 900 << 20), (os.getppid(), 1 << 30)]))
    both = nvml.Nvml().sample()
    assert both["listed"] == 1 << 30 and [p["pid"] for p in both["top"]] == [os.getppid()]


class Hides(WithDisplay):
    """WithDisplay whose NVML gives no memory (None) for the processes in `hidden`, as drivers do for some."""

    def __init__(self, processes, drawing, hidden):
        super().__init__(processes, drawing)
        self.hidden = hidden

    def _listed(self, processes):
        return [SimpleNamespace(pid=pid, usedGpuMemory=None if pid in self.hidden else used) for pid, used in processes]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return self._listed(self.computing)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self._listed(self.drawing)


def test_a_display_process_whose_memory_nvml_hides_leaves_the_vram_warning_on(monkeypatch):
    """A driver that hides the display server's memory made the whole sample's split unknown (per_process off): the
    warning went unsaid beside another process holding 1 GiB of an 8 GiB card, and the graphs said they did not know
    this process's. What only draws is left out anyway; the warning judges what NVML lists, and where a process that
    computes is hidden it says what is known as at least that much."""
    from tests.test_gui_parts import warned

    calm = {"cpu_per_core": [10.0] * 8, "others_cpu_cores": 0.0, "ram_total": 100, "ram_available": 50}
    me, other = os.getpid(), os.getppid()
    monkeypatch.setattr(nvml, "pynvml", Hides([(me, 5 << 30), (other, 1 << 30)], [(1, 900 << 20)], hidden={1}))
    sample = nvml.Nvml().sample()
    assert sample["per_process"] and sample["this"] == 5 << 30 and sample["listed"] == 1 << 30
    assert [text.split(":")[0] for text in warned(dict(calm, gpu=sample))] == [
        "Other processes hold 1.0 GiB of the GPU's 8.0 GiB"]
    monkeypatch.setattr(nvml, "pynvml", Hides([(me, 5 << 30), (other, 1 << 30), (1, 900 << 20)], [], hidden={1}))
    computing = nvml.Nvml().sample()
    assert not computing["per_process"] and computing["listed"] == 1 << 30
    assert [text.split(":")[0] for text in warned(dict(calm, gpu=computing))] == [
        "Other processes hold at least 1.0 GiB of the GPU's 8.0 GiB"]


def test_no_nvidia_gpu_says_why(monkeypatch):
    class Missing(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "pynvml", Missing([]))
    probe = nvml.Nvml()
    assert probe.sample() is None and "NVML Shared Library Not Found" in probe.note


class FakeCudaDevice:
    kind, index = "cuda", 0
    memory = DeviceMemory(capacity=80 << 30, used=5 << 30, high_water=7 << 30)


def test_records_take_this_process_vram_from_nvml(monkeypatch):
    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(os.getpid(), 6 << 30), (999_999_999, 20 << 30)]))
    with PeakSampler(FakeCudaDevice(), interval=0.01) as peaks:
        pass
    # the run's own device peak: 5 GiB held throughout; the device's mark from before the run (7 GiB) stays its own
    assert peaks.process_device_bytes == 6 << 30 and peaks.device_bytes == 5 << 30
    assert FakeCudaDevice.memory.high_water == 7 << 30
    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(os.getpid(), 6 << 30)], hide_per_process=True))
    with PeakSampler(FakeCudaDevice(), interval=0.01) as hidden:
        pass
    assert hidden.process_device_bytes is None  # the driver hides per-process memory: unknown, not 0
    monkeypatch.setattr(nvml, "pynvml", FakeNvml([(999_999_999, 6 << 30)]))
    with PeakSampler(FakeCudaDevice(), interval=0.01) as other_namespace:
        pass
    assert other_namespace.process_device_bytes is None  # this pid not listed (a container's pid namespace)
    with PeakSampler(SimpleNamespace(kind="simulated", memory=FakeCudaDevice.memory), interval=0.01) as simulated:
        pass
    assert simulated.process_device_bytes is None and simulated.device_bytes == 5 << 30


def test_records_take_pinned_memory_from_the_staging_ring():
    def model(info):
        return SimpleNamespace(offload=SimpleNamespace(pinned_info=lambda: info))

    assert pinned_bytes(model({"kind": "pinned", "bytes": 256 << 20, "in_use": 0})) == 256 << 20
    assert pinned_bytes(model({"kind": "accounted", "bytes": 256 << 20})) is None  # the simulated device's ring
    assert pinned_bytes(model({})) is None
    assert pinned_bytes(SimpleNamespace(offload=None)) is None


def test_a_missing_nvml_library_is_looked_for_once(monkeypatch):
    """nvidia-ml-py loads the library (a dlopen) at every nvmlInit while it is missing; a dlopen on the telemetry
    thread while the window's thread built Qt objects deadlocked the suite. Where it was not found, later readers
    (the records' sampler, the environment) say so without looking again."""
    class LibraryNotFound(Exception):
        pass

    class NoLibrary(FakeNvml):
        NVMLError_LibraryNotFound = LibraryNotFound
        tries = 0

        def nvmlInit(self):
            NoLibrary.tries += 1
            raise LibraryNotFound("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "_library_missing", {})
    monkeypatch.setattr(nvml, "pynvml", NoLibrary([]))
    first, second = nvml.Nvml(), nvml.Nvml()
    assert NoLibrary.tries == 1 and first.note == second.note == "no NVIDIA GPU (NVML Shared Library Not Found)"
    from engine.records.environment import gpus

    assert gpus() == [] and NoLibrary.tries == 1

    class NoDriver(NoLibrary):  # another failure (the driver not loaded): the library was found, tried each time
        def nvmlInit(self):
            NoLibrary.tries += 1
            raise RuntimeError("Driver Not Loaded")

    monkeypatch.setattr(nvml, "pynvml", NoDriver([]))
    nvml.Nvml(), nvml.Nvml()
    assert NoLibrary.tries == 3


class NotReadyYet(FakeNvml):
    """NVML whose nvmlInit fails `failures` times (the driver not loaded yet, or being reloaded), then works."""

    def __init__(self, failures):
        super().__init__([(os.getpid(), 6 << 30)])
        self.failures, self.inits = failures, 0

    def nvmlInit(self):
        self.inits += 1
        if self.inits <= self.failures:
            raise RuntimeError("Driver Not Loaded")


def test_nvml_not_ready_yet_is_asked_again_and_read_once_it_answers(monkeypatch):
    """NVML that failed to open once (not ready yet at the window's start, a driver reload) was given up for good:
    the graphs said 'no NVIDIA GPU (Driver Not Loaded)' for as long as the window ran, with the GPU answering a
    second later. It is asked again every RETRY_AFTER_S, and the note says so."""
    now = [100.0]
    monkeypatch.setattr(nvml.Nvml, "clock", staticmethod(lambda: now[0]))
    fake = NotReadyYet(failures=2)
    monkeypatch.setattr(nvml, "pynvml", fake)
    probe = nvml.Nvml()
    assert probe.note == "no NVIDIA GPU (Driver Not Loaded); NVML is asked again in 5 s" and probe.retrying
    assert probe.sample() is None and fake.inits == 1  # not before the 5 s
    now[0] += 5
    assert probe.sample() is None and fake.inits == 2 and probe.retrying
    now[0] += 5
    sample = probe.sample()
    assert sample["name"] == "NVIDIA Test GPU" and sample["this"] == 6 << 30 and fake.inits == 3
    assert probe.note == "" and not probe.retrying


def test_nvml_is_asked_a_bounded_number_of_times_then_given_up_with_why(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(nvml.Nvml, "clock", staticmethod(lambda: now[0]))
    fake = NotReadyYet(failures=1000)
    monkeypatch.setattr(nvml, "pynvml", fake)
    probe = nvml.Nvml()
    for _ in range(3 * nvml.RETRIES):
        now[0] += nvml.RETRY_AFTER_S
        assert probe.sample() is None
    assert fake.inits == nvml.RETRIES + 1 and not probe.retrying
    assert probe.note == ("no NVIDIA GPU (Driver Not Loaded); NVML was asked 13 times, 5 s apart, and is no longer "
                          "asked (restart MoE Workbench to read the GPU)")


def test_nvml_that_stops_answering_is_opened_again_and_its_tries_start_over_once_it_answers(monkeypatch):
    """A driver reload mid-run: the GPU's handle is opened again (nvmlInit, the handle looked up anew), not asked
    through the old one for good."""
    now = [0.0]
    monkeypatch.setattr(nvml.Nvml, "clock", staticmethod(lambda: now[0]))
    fake = NotReadyYet(failures=0)
    monkeypatch.setattr(nvml, "pynvml", fake)
    probe = nvml.Nvml()
    answers = FakeNvml.nvmlDeviceGetMemoryInfo

    def lost(handle):
        raise RuntimeError("GPU is lost")

    for _ in range(2):  # twice, more than RETRIES failures in all: each reading gives back the whole count
        monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", lost)
        for _ in range(nvml.RETRIES):
            assert probe.sample() is None and probe.retrying
            assert probe.note == "NVML stopped answering (GPU is lost); NVML is asked again in 5 s"
            now[0] += nvml.RETRY_AFTER_S
        monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", lambda handle: answers(fake, handle))
        assert probe.sample()["used"] == 30 << 30
    assert fake.inits == 1 + 2 * nvml.RETRIES


def test_a_lasting_failure_is_not_asked_again(monkeypatch):
    """The library missing (a dlopen each time, init), or CUDA_VISIBLE_DEVICES naming no GPU: no retry, no 'asked
    again' in the note."""
    monkeypatch.setattr(nvml.Nvml, "clock", staticmethod(lambda: 1e9))
    fake = NotReadyYet(failures=0)
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    probe = nvml.Nvml()
    assert probe.sample() is None and probe.sample() is None and fake.inits == 1 and not probe.retrying
    assert probe.note == "no NVIDIA GPU (CUDA_VISIBLE_DEVICES='' leaves this process no GPU 0)"


def test_a_process_is_named_by_its_script_or_module_never_by_inline_code():
    class Proc:
        def __init__(self, *args):
            self.args = args

        def cmdline(self):
            return list(self.args)

    assert nvml.describe(Proc("python3", "/opt/bench_qmoe_cpu.py", "--shape", "A"), "python3") == "python3 bench_qmoe_cpu.py"
    assert nvml.describe(Proc("python", "-m", "app"), "python") == "python app"
    code = "import numpy as np, time; a = np.ones((3 << 30) // 8); time.sleep(60)"
    assert nvml.describe(Proc("python", "-c", code), "python") == "python -c"  # was 'python  8); time.sleep(60)'
    assert nvml.describe(Proc("bash", "-c", "make -j8"), "bash") == "bash -c"
    assert nvml.describe(Proc("firefox", "-P"), "firefox") == "firefox"


class TwoGpus(FakeNvml):
    """A machine of two GPUs; this process's 6 GiB on the second."""

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle):
        return {"gpu0": b"NVIDIA A", "gpu1": b"NVIDIA B"}[handle]

    def nvmlDeviceGetUUID(self, handle):
        return {"gpu0": "GPU-0a1b2c3d-0000", "gpu1": "GPU-9f8e7d6c-1111"}[handle]

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = {"gpu0": 70 << 30, "gpu1": 6 << 30}[handle]
        return SimpleNamespace(total=80 << 30, used=used, free=(80 << 30) - used)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=6 << 30)] if handle == "gpu1" else []


def test_the_gpu_sampled_is_the_one_cuda_visible_devices_gives_this_process(monkeypatch):
    """NVML numbers every GPU of the machine, CUDA only those CUDA_VISIBLE_DEVICES lists: with
    CUDA_VISIBLE_DEVICES=1 the model ran on the machine's second GPU while the graphs, the budget panel and the run
    records read the first, another user's 70 GiB ('Other processes hold 70.0 GiB of the GPU's 80.0 GiB') and none
    of this process's."""
    monkeypatch.setattr(nvml, "pynvml", TwoGpus([]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.Nvml().sample()["name"] == "NVIDIA A"
    for visible in ("1", "1,0", "GPU-9f8e7d6c-1111", "GPU-9f8e"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        sample = nvml.Nvml().sample()
        assert sample["name"] == "NVIDIA B" and sample["this"] == 6 << 30 and sample["others"] == 0, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert nvml.Nvml(1).sample()["name"] == "NVIDIA A"
    for visible, why in (("", "CUDA_VISIBLE_DEVICES='' leaves this process no GPU 0"),
                         ("GPU-ffff", "no GPU's UUID starts with CUDA_VISIBLE_DEVICES's 'GPU-ffff'")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        hidden = nvml.Nvml()
        assert hidden.sample() is None and hidden.note == f"no NVIDIA GPU ({why})"


def test_a_gpu_nvml_cannot_read_leaves_the_run_record_whole(monkeypatch):
    """A run's record lists the machine's GPUs after the run was measured: where NVML answered nvmlInit but not about
    one GPU (reset, fallen off the bus: 'GPU is lost'), the error left gpus() and the record job failed, its measured
    run lost. The GPUs it reads are listed, the one it cannot read with why."""
    from engine.records.environment import gpus

    class OneLost(FakeNvml):
        def nvmlDeviceGetCount(self):
            return 2

        def nvmlDeviceGetHandleByIndex(self, index):
            return f"gpu{index}"

        def nvmlDeviceGetMemoryInfo(self, handle):
            if handle == "gpu1":
                raise RuntimeError("GPU is lost")
            return super().nvmlDeviceGetMemoryInfo(handle)

        def nvmlSystemGetDriverVersion(self):
            return "580.65"

        def nvmlShutdown(self):
            pass

    monkeypatch.setattr(nvml, "_library_missing", {})
    monkeypatch.setattr(nvml, "pynvml", OneLost([]))
    found = gpus()
    assert found == [{"name": "NVIDIA Test GPU", "memory_bytes": 80 << 30, "driver": "580.65"},
                     {"error": "GPU 1: NVML cannot read it (RuntimeError: GPU is lost)"}]
    from app.gui.record_report import _gpus

    assert _gpus({"gpus": found}) == ("NVIDIA Test GPU (80.0 GiB, driver 580.65); GPU 1: NVML cannot read it "
                                      "(RuntimeError: GPU is lost)")
