"""Page-locking the experts' file mapping (engine/offload/host_register.py) against a stand-in for CuPy's runtime
that records the registrations, and the GPU layout code's row copies without a host gather (layout._rows_to_xp)
against a stand-in array module. The CUDA side runs in tests/test_offload_cuda.py (marker gpu)."""

from __future__ import annotations

import gc
import mmap
import threading
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

from engine.generation import LoadedModel
from engine.offload.host_register import AVAILABLE_SHARE, READ_ONLY, HostRegistration, mapping_regions
from engine.writer import WriterSpec, write_model
from kernels.gpu.layout import _rows_to_xp


class FakeRuntime:
    """`gate`: each cudaHostRegister call waits for it (a large mapping's registration, seconds long)."""

    def __init__(self, fail_after: int | None = None, gate: threading.Event | None = None):
        self.registered: dict[int, tuple[int, int]] = {}
        self.unregistered: list[int] = []
        self.fail_after = fail_after
        self.gate = gate

    def hostRegister(self, address, size, flags):
        if self.gate is not None:
            self.gate.wait()
        if self.fail_after is not None and len(self.registered) >= self.fail_after:
            raise RuntimeError("cudaErrorNotSupported: operation not supported\nmore lines")
        self.registered[address] = (size, flags)

    def hostUnregister(self, address):
        del self.registered[address]
        self.unregistered.append(address)


def fake_cp(runtime: FakeRuntime):
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=lambda index: nullcontext()))


class Owner:
    pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_model(tmp_path_factory.mktemp("register") / "m",
                         WriterSpec(layers=2, num_experts=4, top_k=2, hidden_size=64, inter_size=64, seed=5))
    return LoadedModel.open(folder)


def _first_expert_node(model):
    return next(step for step in model.decoder.steps if hasattr(step, "tensors"))


def test_regions_are_the_whole_page_aligned_data_files_holding_experts(model):
    source = model.folder.onnx
    regions = mapping_regions(source, model.folder.experts)
    locations = {source.external_location(name) for info in model.folder.experts for name in info.weight_inputs.values()}
    assert len(regions) == len(locations) == 1
    mapping, address, size = regions[0]
    assert address % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0 and len(mapping) <= size < len(mapping) + mmap.PAGESIZE


def test_registration_covers_the_expert_tensors_and_ends_with_its_owner(model):
    runtime, owner = FakeRuntime(), Owner()
    registration = HostRegistration(fake_cp(runtime), 0, mapping_regions(model.folder.onnx, model.folder.experts), owner)
    assert registration.ready.wait(10) and registration.registered
    (address, (size, flags)), = runtime.registered.items()
    assert flags & READ_ONLY and size == registration.total
    weights = _first_expert_node(model).tensors["fc1_experts_weights"]  # a view of the mapping
    assert registration.covers(weights) and registration.covers(weights[1])
    assert not registration.covers(np.array(weights))  # a copy in RAM: not registered
    assert "page-locked" in registration.describe()
    del owner
    gc.collect()
    assert runtime.registered == {}  # undone with the owner


def test_a_refused_registration_is_undone_and_reported(model):
    regions = mapping_regions(model.folder.onnx, model.folder.experts)
    regions = regions + [(regions[0][0], regions[0][1] + regions[0][2], mmap.PAGESIZE)]  # a second region fails
    runtime, owner = FakeRuntime(fail_after=1), Owner()
    registration = HostRegistration(fake_cp(runtime), 0, regions, owner)
    assert registration.ready.wait(10) and not registration.registered
    assert runtime.registered == {}  # the first region was unregistered again
    assert registration.reason == "cudaHostRegister refused the experts' mapping (cudaErrorNotSupported: operation not supported)"
    assert not registration.covers(_first_expert_node(model).tensors["fc1_experts_weights"])
    assert "staging ring" in registration.describe()


def test_an_undone_registration_is_unregistered_once_and_reported(model):
    """undo (host_expert_bytes bounded on the loaded model) unregisters every region at once; the owner's end later
    has nothing left to undo."""
    runtime, owner = FakeRuntime(), Owner()
    registration = HostRegistration(fake_cp(runtime), 0, mapping_regions(model.folder.onnx, model.folder.experts), owner)
    assert registration.ready.wait(10) and registration.registered
    registered = list(runtime.registered)
    registration.undo("host_expert_bytes was bounded on the loaded model")
    assert runtime.registered == {} and runtime.unregistered == registered
    assert not registration.registered
    assert not registration.covers(_first_expert_node(model).tensors["fc1_experts_weights"])
    assert "no longer page-locked" in registration.describe()
    del owner
    gc.collect()
    assert runtime.unregistered == registered


def test_no_registration_beyond_the_available_memory(model):
    runtime = FakeRuntime()
    regions = mapping_regions(model.folder.onnx, model.folder.experts)
    total = sum(size for _, _, size in regions)
    registration = HostRegistration(fake_cp(runtime), 0, regions, Owner(), available=int(total / AVAILABLE_SHARE) - 1)
    assert registration.ready.is_set() and not registration.registered and runtime.registered == {}
    assert "exceed 80% of the memory available" in registration.reason


class FakeDeviceArray(np.ndarray):
    sets = 0

    def set(self, host, stream=None):
        FakeDeviceArray.sets += 1
        assert host.flags.c_contiguous and stream == "stream"
        self[...] = host


class FakeXp:
    ndarray = FakeDeviceArray

    class cuda:
        @staticmethod
        def get_current_stream():
            return "stream"

    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype).view(FakeDeviceArray)


@pytest.mark.parametrize("experts,copies", [([5], 1), ([2, 3, 4], 1), ([6, 1, 3], 3)], ids=["one", "run", "scattered"])
def test_rows_go_over_per_expert_or_per_run_without_a_host_gather(experts, copies):
    arr = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8, 3, 5)
    FakeDeviceArray.sets = 0
    rows = _rows_to_xp(FakeXp, arr, np.array(experts))
    assert np.array_equal(np.asarray(rows), arr[experts]) and FakeDeviceArray.sets == copies
