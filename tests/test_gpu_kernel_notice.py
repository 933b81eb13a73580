"""The GPU expert kernels' compile at a load's first slots (CudaDevice.ensure_kernels), said while it runs: NVRTC's
first compile of them takes 1-2 minutes, and the load showed nothing meanwhile (the window's progress bar stood still,
the command line printed nothing). A stand-in CuPy and kernel module (CPU only)."""
from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest

import engine.offload.cuda_device as cuda_device
import kernels.gpu._module as kernel_module
from engine.offload.devices import Bandwidths


class _Module:
    """A CUDA module whose first function takes `compile_s` (NVRTC compiles a source module then)."""

    def __init__(self, compile_s: float):
        self.compile_s, self.asked = compile_s, []

    def get_function(self, name: str):
        time.sleep(self.compile_s)
        self.compile_s = 0.0
        self.asked.append(name)


@pytest.fixture
def device(monkeypatch):
    """A CudaDevice over a stand-in CuPy (an sm_90 GPU, CuPy's cache in /cache/cupy) that records what it reports."""
    runtime = types.SimpleNamespace(memGetInfo=lambda: (70 << 30, 80 << 30),
                                    getDeviceProperties=lambda index: {"name": b"Stand-in GPU"})
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Stream=lambda non_blocking: object(),
                                   Device=lambda index: _Gpu(),
                                   compiler=types.SimpleNamespace(get_cache_dir=lambda: "/cache/cupy")),
        get_default_memory_pool=lambda: types.SimpleNamespace(set_limit=lambda size: None, free_all_blocks=lambda: None))
    monkeypatch.setattr(cuda_device, "_cupy", lambda: cupy)
    monkeypatch.setattr(cuda_device, "_measure_all", lambda cp: Bandwidths(pcie=50e9, hbm=3e12, cpu=100e9))
    monkeypatch.setattr(cuda_device, "_pool_caps", {})
    monkeypatch.setattr(cuda_device, "KERNEL_NOTICE_AFTER_S", 0.05)
    said: list[tuple[str, bool]] = []
    main = threading.current_thread()
    dev = cuda_device.CudaDevice(0, report=lambda text: said.append((text, threading.current_thread() is main)))
    dev.said = said
    return dev


class _Gpu(contextlib.nullcontext):
    compute_capability = "90"


def _modules(monkeypatch, module: _Module) -> list[str]:
    loaded = []

    def load_module(cc: str):
        loaded.append(cc)
        return module, "nvrtc"

    monkeypatch.setattr(kernel_module, "load_module", load_module)
    return loaded


def test_a_compile_that_takes_long_is_said_as_it_runs_and_where_its_kernels_are_kept(device, monkeypatch):
    module = _Module(compile_s=0.7)
    loaded = _modules(monkeypatch, module)
    device.ensure_kernels()
    assert loaded == ["90"] and module.asked == ["route_topk"]  # compiled now, not at the first GpuQMoE's launch
    (started, on_timer), (done, on_load) = device.said
    assert started == ("Compiling the GPU expert kernels for sm_90 (a first load on this GPU without a prebuilt "
                       "cubin: about 1-2 minutes; later loads take them from CuPy's cache in /cache/cupy).")
    assert not on_timer and on_load  # said while the load's thread waits on the compile
    assert done == device.kernels_note == ("The GPU expert kernels were compiled for sm_90 in 1 s; later loads take "
                                           "them from CuPy's cache in /cache/cupy.")
    device.ensure_kernels()  # the next slots: nothing to load again, nothing said
    assert loaded == ["90"] and len(device.said) == 2


def test_kernels_from_a_cubin_or_cupys_cache_load_without_a_word(device, monkeypatch):
    loaded = _modules(monkeypatch, _Module(compile_s=0.0))
    device.ensure_kernels()
    time.sleep(0.1)  # past the notice's time: it was called off
    assert loaded == ["90"] and device.said == [] and device.kernels_note == ""


def test_a_compile_that_fails_fails_the_load_after_saying_it_began(device, monkeypatch):
    class Broken(_Module):
        def get_function(self, name):
            time.sleep(0.2)
            raise RuntimeError("NVRTC Error: NVRTC_ERROR_COMPILATION (6)")

    _modules(monkeypatch, Broken(0))
    with pytest.raises(RuntimeError, match="NVRTC_ERROR_COMPILATION"):
        device.ensure_kernels()
    assert [text.split(" (")[0] for text, _ in device.said] == ["Compiling the GPU expert kernels for sm_90"]
    assert not device.kernels_ready and device.kernels_note == ""
