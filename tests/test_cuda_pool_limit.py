"""gpu_device_mem_limit caps CuPy's memory pool, which is the whole process's: every model loaded shares it (the
side-by-side comparison loads B beside A). A stand-in CuPy (CPU only) records the limits set."""
from __future__ import annotations

import contextlib
import gc
import threading
import types
import weakref

import pytest

import engine.offload.cuda_device as cuda_device
from engine.offload.devices import Bandwidths


class _Pool:
    def __init__(self):
        self.limits: list[int] = []
        self.freed = 0

    def set_limit(self, size: int) -> None:
        self.limits.append(size)

    def free_all_blocks(self) -> None:
        self.freed += 1


@pytest.fixture
def pool(monkeypatch):
    pool = _Pool()
    runtime = types.SimpleNamespace(memGetInfo=lambda: (70 << 30, 80 << 30),
                                    getDeviceProperties=lambda index: {"name": b"Stand-in GPU"})
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda index: contextlib.nullcontext(),
                                   Stream=lambda non_blocking: object()),
        get_default_memory_pool=lambda: pool)
    monkeypatch.setattr(cuda_device, "_cupy", lambda: cupy)
    measured = []

    def measure(cp):
        measured.append(list(pool.limits))  # the limits in force while the probe allocates
        return Bandwidths(pcie=50e9, hbm=3e12, cpu=100e9)

    monkeypatch.setattr(cuda_device, "_measure_all", measure)
    monkeypatch.setattr(cuda_device, "_pool_caps", {})
    pool.measured = measured
    return pool


def test_the_pool_limit_is_the_sum_of_the_open_devices_caps(pool):
    a = cuda_device.CudaDevice(0, mem_limit=3 << 30)
    assert pool.limits[-1] == 3 << 30
    b = cuda_device.CudaDevice(0, mem_limit=1 << 30)
    assert pool.limits[-1] == 4 << 30  # B's cap must not shrink A's allocations to B's
    del b
    gc.collect()
    assert pool.limits[-1] == 3 << 30
    del a
    gc.collect()
    assert pool.limits[-1] == 0  # nothing open: the process is unlimited again


def test_a_device_without_a_cap_lifts_the_pools_limit_while_it_lives(pool):
    capped = cuda_device.CudaDevice(0, mem_limit=2 << 30)
    uncapped = cuda_device.CudaDevice(0)
    assert pool.limits[-1] == 0  # its DeviceMemory still caps the capped device's own reservations
    assert capped.memory.limit == 2 << 30 and uncapped.memory.limit == 0
    del uncapped
    gc.collect()
    assert pool.limits[-1] == 2 << 30


def test_a_reload_without_a_cap_is_not_held_to_the_last_ones(pool):
    first = cuda_device.CudaDevice(0, mem_limit=200 << 10)  # far below the probe's 512 MiB
    del first
    gc.collect()
    cuda_device.CudaDevice(0)
    assert pool.limits[-1] == 0


def test_the_start_up_probe_runs_before_the_cap(pool):
    device = cuda_device.CudaDevice(0, mem_limit=200 << 10)
    assert pool.measured == [[0]]  # no limit while its 512 MiB were allocated
    assert pool.limits == [0, 200 << 10] and device.memory.limit == 200 << 10


def test_a_second_devices_probe_is_not_held_to_the_first_ones_cap(pool):
    """Side by side, B's device opens while A's holds the pool to A's cap, which A's slots may fill: B's probe (512 MiB
    of its own) ran under that cap and failed with CuPy's out-of-memory error, and B could not load."""
    a = cuda_device.CudaDevice(0, mem_limit=200 << 10)
    b = cuda_device.CudaDevice(0, mem_limit=300 << 10)
    assert pool.measured[1][-1] == 0  # no limit while B's probe allocated
    assert pool.limits[-1] == 500 << 10 and (a.memory.limit, b.memory.limit) == (200 << 10, 300 << 10)


def test_a_failed_probe_leaves_the_open_devices_cap(pool, monkeypatch):
    a = cuda_device.CudaDevice(0, mem_limit=200 << 10)

    def fail(cp):
        raise RuntimeError("cudaErrorLaunchFailure")

    monkeypatch.setattr(cuda_device, "_measure_all", fail)
    with pytest.raises(RuntimeError) as failed:  # its traceback, kept, keeps the half-opened device
        cuda_device.CudaDevice(0, mem_limit=300 << 10)
    assert pool.limits[-1] == 200 << 10 and a.memory.limit == 200 << 10 and failed.traceback


def test_a_device_dropped_on_another_thread_while_one_opens(pool):
    """A device's cap goes on whichever thread drops it (a finalizer: the window's, a collection's) while the engine's
    thread opens another. The dropping thread's limit, worked out before the new cap was there, was set after it: the
    pool held to A's cap alone while A and the new device were open, and the new model's slots failed to allocate."""
    a = cuda_device.CudaDevice(0, mem_limit=1 << 30)
    dropped = [cuda_device.CudaDevice(0, mem_limit=2 << 30)]
    setting, go = threading.Event(), threading.Event()
    record = pool.set_limit

    def set_limit(size):
        if threading.current_thread().name == "dropping":
            setting.set()
            go.wait(10)
        record(size)

    pool.set_limit = set_limit
    dropping = threading.Thread(target=dropped.clear, name="dropping")
    dropping.start()
    assert setting.wait(10)
    opened = []
    opening = threading.Thread(target=lambda: opened.append(cuda_device.CudaDevice(0, mem_limit=4 << 30)))
    opening.start()
    opening.join(1.0)  # done meanwhile, or waiting for the dropping thread
    go.set()
    dropping.join(10)
    opening.join(10)
    assert len(opened) == 1 and a.memory.limit == 1 << 30
    assert pool.limits[-1] == 5 << 30  # A's cap and the new device's


def test_a_reload_counts_the_dropped_models_memory_still_cached_in_the_pool_as_free(pool):
    """The model loaded before (dropped just before this load) gave its slots back to CuPy's pool, which keeps them
    cached, not to the driver: the device read the driver's free memory before the probe freed them, counted them as
    other processes' memory, and planned the new load without them (mode=required refused a budget that fits)."""
    cached = {"bytes": 30 << 30}  # the dropped model's 30 GiB of slots, cached in the pool

    def free_all_blocks():
        cached["bytes"] = 0
        pool.freed += 1

    pool.free_all_blocks = free_all_blocks
    cuda_device._cupy().cuda.runtime.memGetInfo = lambda: ((75 << 30) - cached["bytes"], 80 << 30)
    device = cuda_device.CudaDevice(0)
    assert device.memory.capacity == 75 << 30  # 5 GiB other processes hold; the pool's cached blocks are free


def test_a_gpu_tests_devices_are_closed_before_the_next_test(pool):
    """conftest's teardown of each gpu test (tests/gpu_state.py): a device the test left in a reference cycle, and one
    still referenced (a failed test's traceback, which pytest keeps), no longer lift the pool's limit for the next
    test's capped device."""
    from tests.gpu_state import release_gpu_state

    was_enabled = gc.isenabled()
    gc.disable()  # the cycle stays until a collection: only release_gpu_state's
    try:
        in_a_cycle = cuda_device.CudaDevice(0)
        in_a_cycle.itself = in_a_cycle
        del in_a_cycle
        kept = cuda_device.CudaDevice(0)
        dead = weakref.proxy(cuda_device.CudaDevice(0))  # (among the objects it looks through)
        release_gpu_state()
        capped = cuda_device.CudaDevice(0, mem_limit=64 << 10)  # the next test's
        assert pool.limits[-1] == 64 << 10 and cuda_device._pool_caps == {0: {id(capped): 64 << 10}}
        assert kept.memory.limit == 0 and capped.memory.limit == 64 << 10
        with pytest.raises(ReferenceError):
            dead.memory
    finally:
        if was_enabled:
            gc.enable()
