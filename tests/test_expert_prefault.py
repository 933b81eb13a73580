"""Mapping the experts' pages after load (engine/expert_prefault.py): what is populated, how much, and when not."""

from __future__ import annotations

import bisect
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from engine.expert_prefault import CHUNK, ExpertPrefault, expert_ranges
from engine.generation import LoadedModel
from engine.offload import OffloadConfig, SimulatedDevice
from engine.writer import WriterSpec, write_model

SPEC = WriterSpec(layers=2, num_experts=16, top_k=2, hidden_size=512, inter_size=512, seed=41, dense_accuracy_level=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("prefault") / "m", SPEC)


def expert_tensor_bytes(model) -> int:
    source = model.folder.onnx
    return sum(source.nbytes(name) for info in model.folder.experts for name in info.weight_inputs.values())


def test_ranges_cover_every_expert_tensor_once_in_chunks(folder, monkeypatch):
    model = LoadedModel.open(folder)
    monkeypatch.setattr("engine.expert_prefault.CHUNK", 100_000)
    ranges = expert_ranges(model.folder.onnx, model.folder.experts)
    assert sum(length for _, _, length in ranges) == expert_tensor_bytes(model)
    assert max(length for _, _, length in ranges) <= 100_000
    by_tensor: dict[str, int] = {}
    for name, start, length in ranges:
        assert start == by_tensor.get(name, 0)  # contiguous, in order, no overlap
        by_tensor[name] = start + length
    assert CHUNK >= 1 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_a_loaded_model_maps_its_experts_in_the_background(folder):
    model = LoadedModel.open(folder)
    assert model.prefault is not None and model.prefault.done.wait(30)
    assert model.prefault.supported  # Linux 5.14+
    total = expert_tensor_bytes(model)
    assert model.prefault.populated_bytes == total


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_populated_pages_are_this_process_memory(folder):
    """A model whose experts were not populated (host memory bounded): populating them by hand grows this
    process's resident memory by their size, before any expert ran."""
    process = psutil.Process()
    model = LoadedModel.open(folder, offload=OffloadConfig(host_expert_bytes=1 << 20), device=SimulatedDevice(1 << 30))
    assert model.prefault is None
    total = expert_tensor_bytes(model)
    before = process.memory_info().rss
    prefault = ExpertPrefault(model.folder.onnx, model.folder.experts).start()
    assert prefault.done.wait(30) and prefault.populated_bytes == total
    assert process.memory_info().rss - before >= 0.9 * total


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_populating_lets_other_threads_run(folder):
    """The populate call lets go of the interpreter: while another thread maps an expert tensor's pages (released
    first, so that each call has pages to map), this thread keeps running. mmap.madvise held it for the whole call,
    which stalled the engine's decode and the GUI while a model's experts were mapped after load.

    The switch interval is raised for the test so that the interpreter changes threads only where one lets go of it
    (this thread at each sleep(0), the other in a call that releases it): a tick of this thread inside a call's
    window then proves the call let go, and with a call that holds the interpreter no window has one. How many
    windows see a tick depends on the OS scheduling this thread (2 of 20 on a loaded CI runner), so the calls go on
    until a few have, within a bound."""
    model = LoadedModel.open(folder, offload=OffloadConfig(host_expert_bytes=1 << 20), device=SimulatedDevice(1 << 30))
    source = model.folder.onnx
    name = max((n for info in model.folder.experts for n in info.weight_inputs.values()), key=source.nbytes)
    size = source.nbytes(name)
    wanted, ticks, done = 3, [], threading.Event()
    outcome = {"windows": 0, "ran": 0, "supported": True}

    def populate():
        deadline = time.perf_counter() + 5
        try:
            while outcome["ran"] < wanted and time.perf_counter() < deadline:
                source.release_pages(name, 0, size)
                ticks.clear()  # only this window's, so that the list stays short
                started = time.perf_counter()
                ok = source.populate_pages(name, 0, size)
                ended = time.perf_counter()
                if not ok:
                    outcome["supported"] = False
                    break
                outcome["windows"] += 1
                outcome["ran"] += bisect.bisect_left(ticks, ended) > bisect.bisect_right(ticks, started)
        finally:
            done.set()  # an error in this thread fails the test (pytest reports it) instead of hanging it

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread = threading.Thread(target=populate)
        thread.start()
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)  # lets the other thread back in once its call returns
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    if not outcome["supported"]:
        pytest.skip("this kernel cannot populate a mapping (MADV_POPULATE_READ: Linux 5.14+)")
    assert outcome["ran"] >= wanted, f"this thread ran during {outcome['ran']} of {outcome['windows']} populate calls"


def test_population_stops_at_the_available_memory(folder):
    model = LoadedModel.open(folder)
    total = expert_tensor_bytes(model)
    limited = ExpertPrefault(model.folder.onnx, model.folder.experts, available=total)  # 80% of it
    assert 0 < sum(length for _, _, length in limited.ranges) <= 0.8 * total


def test_no_population_where_host_memory_is_bounded_or_every_expert_is_on_the_device(folder):
    device = SimulatedDevice(1 << 30)
    bounded = LoadedModel.open(folder, offload=OffloadConfig(host_expert_bytes=1 << 20), device=device)
    assert bounded.prefault is None
    resident = LoadedModel.open(folder, offload=OffloadConfig(), device=SimulatedDevice(1 << 30))
    assert resident.offload.plan.placement_mode == "all_resident" and resident.prefault is None
    hybrid = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))
    assert hybrid.prefault is not None


def test_a_replan_to_every_expert_resident_that_the_device_cannot_hold_keeps_the_population_running(folder,
                                                                                                   monkeypatch):
    """A re-plan to every expert resident stops the population (nothing would be copied from the file) before it
    makes the slots; where the device then has less free than planned, the configuration in force comes back
    (4361d23), and with it the population it runs with. It stayed stopped, so the hybrid model's copies and CPU
    kernels read cold pages again."""
    from engine.offload.device_memory import DeviceMemoryError
    from engine.offload.devices import SimulatedSlots
    from engine.offload.planner import all_resident_bytes

    model = LoadedModel.open(folder, offload=OffloadConfig(device_expert_bytes=0), device=SimulatedDevice(1 << 30))
    engine = model.offload
    assert model.prefault is not None and engine.prefault is model.prefault

    real_resize = SimulatedSlots.resize

    def short_of_memory(self, num_slots):
        if num_slots > self.num_slots:  # the new plan's slots (the plan in force has none)
            raise DeviceMemoryError(f"{self.name}: the device has no room for {num_slots} expert slots")
        real_resize(self, num_slots)

    monkeypatch.setattr(SimulatedSlots, "resize", short_of_memory)
    with pytest.raises(DeviceMemoryError, match="no room for"):
        engine.reconfigure(engine.config.updated(device_expert_bytes=all_resident_bytes(model.folder.experts)))
    assert engine.plan.placement_mode != "all_resident"
    assert engine.prefault is not None and engine.prefault is model.prefault  # it was None, the stopped one model's
    assert engine.prefault.done.wait(30) and engine.prefault.populated_bytes == expert_tensor_bytes(model)


TRUNCATED_PREFAULT = """
import sys
from pathlib import Path
from engine.expert_prefault import ExpertPrefault
from engine.generation import LoadedModel
folder = Path(sys.argv[1])
model = LoadedModel.open(folder)
assert model.prefault.done.wait(30)
data = folder / "model.onnx.data"
data.write_bytes(data.read_bytes()[:4096])
prefault = ExpertPrefault(model.folder.onnx, model.folder.experts).start()
assert prefault.done.wait(30)
print(prefault.supported, prefault.populated_bytes, getattr(prefault, "error", None))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_a_population_on_a_data_file_truncated_since_the_load_names_the_truncation(folder, tmp_path):
    """Populating pages past the end of a data file cut short since the load fails the call (EFAULT, where a read
    would raise SIGBUS): the population recorded that the system cannot populate. It names the file and the
    truncation, in check_mapped_files' words. In a process of its own, so that a crash fails the test."""
    copy = tmp_path / "m"
    shutil.copytree(folder, copy)
    whole = (copy / "model.onnx.data").stat().st_size
    result = subprocess.run([sys.executable, "-c", TRUNCATED_PREFAULT, str(copy)], cwd=Path(__file__).parents[1],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines() == [
        f"True 0 {copy / 'model.onnx.data'}: truncated since the model was loaded: it has 4096 bytes of the {whole} "
        "its initializers take; load the model again"]
