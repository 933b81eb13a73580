"""The GPU expert kernels' compile as a load opens the GPU (CudaDevice.ensure_kernels), said while it runs: NVRTC's
first compile of them takes 1-2 minutes, and the load showed nothing meanwhile (the window's progress bar stood still,
the command line printed nothing); kernels that cannot be had make the GPU unusable, said in one line. A stand-in CuPy
and kernel module (CPU only)."""
from __future__ import annotations

import contextlib
import re
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


class CompileException(Exception):
    """CuPy's (cupy.cuda.compiler): its message is NVRTC's whole log."""

    def __init__(self, msg, source, name, options, backend="nvrtc"):
        super().__init__()
        self._msg = msg

    def __str__(self):
        return self._msg


class CUDADriverError(RuntimeError):
    pass


def stand_in_cupy(monkeypatch):
    """A stand-in CuPy: one sm_90 GPU, NVRTC there, CuPy's cache in /cache/cupy, and the errors of its compiler and
    driver; the bandwidth probe measures nothing."""
    runtime = types.SimpleNamespace(memGetInfo=lambda: (70 << 30, 80 << 30), getDeviceCount=lambda: 1,
                                    getDeviceProperties=lambda index: {"name": b"Stand-in GPU"})
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Stream=lambda non_blocking: object(),
                                   Device=lambda index: _Gpu(), nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 8)),
                                   driver=types.SimpleNamespace(CUDADriverError=CUDADriverError),
                                   compiler=types.SimpleNamespace(get_cache_dir=lambda: "/cache/cupy",
                                                                  CompileException=CompileException)),
        get_default_memory_pool=lambda: types.SimpleNamespace(set_limit=lambda size: None, free_all_blocks=lambda: None))
    monkeypatch.setattr(cuda_device, "_cupy", lambda: cupy)
    monkeypatch.setattr(cuda_device, "_measure_all", lambda cp: Bandwidths(pcie=50e9, hbm=3e12, cpu=100e9))
    monkeypatch.setattr(cuda_device, "_pool_caps", {})
    monkeypatch.setattr(cuda_device, "_kernels_refused_for", {})
    monkeypatch.setattr(cuda_device, "KERNEL_NOTICE_AFTER_S", 0.05)
    return cupy


@pytest.fixture
def device(monkeypatch):
    """A CudaDevice over the stand-in CuPy that records what it reports."""
    stand_in_cupy(monkeypatch)
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
    assert done == device.kernels_note
    # (as every time is said, units.duration_text: it said "in 1 s" for the 0.7 s compile)
    assert re.fullmatch(r"The GPU expert kernels were compiled for sm_90 in (7\d\d ms|\d\.\d\d s); later loads take "
                        r"them from CuPy's cache in /cache/cupy\.", done), done
    device.ensure_kernels()  # the next slots: nothing to load again, nothing said
    assert loaded == ["90"] and len(device.said) == 2


def test_kernels_from_a_cubin_or_cupys_cache_load_without_a_word(device, monkeypatch):
    loaded = _modules(monkeypatch, _Module(compile_s=0.0))
    device.ensure_kernels()
    time.sleep(0.1)  # past the notice's time: it was called off
    assert loaded == ["90"] and device.said == [] and device.kernels_note == ""


class Refused(_Module):
    """A module whose first function raises `error` (after `compile_s`)."""

    def __init__(self, error: Exception, compile_s: float = 0.0):
        super().__init__(compile_s)
        self.error = error

    def get_function(self, name):
        time.sleep(self.compile_s)
        raise self.error


NVRTC_LOG = ("/tmp/tmpk3x9/5f1e0c_2.cubin.cu(412): warning #177-D: variable \"errors\" was declared but never "
             "referenced\n"
             "\n/tmp/tmpk3x9/5f1e0c_2.cubin.cu(988): error: identifier \"__nv_fp8_e4m3\" is undefined\n"
             "\n/tmp/tmpk3x9/5f1e0c_2.cubin.cu(990): error: expected a \";\"\n\n"
             "2 errors detected in the compilation of \"/tmp/tmpk3x9/5f1e0c_2.cubin.cu\".\n")
COMPILE_FAILED = ("NVRTC cannot compile the GPU expert kernels for sm_90, the Stand-in GPU (80 GiB): "
                  "5f1e0c_2.cubin.cu(988): error: identifier \"__nv_fp8_e4m3\" is undefined")


def test_a_compile_that_fails_refuses_the_device_in_one_line_after_saying_it_began(device, monkeypatch):
    """NVRTC failing on the kernels raised CuPy's CompileException, whose message is NVRTC's whole log (warnings, each
    error, the temporary file's path): the load failed on that, its first line a warning. It is now a NoCudaDevice
    naming the architecture, the GPU and NVRTC's first error."""
    _modules(monkeypatch, Refused(CompileException(NVRTC_LOG, "source", "kern.cu", ()), compile_s=0.2))
    with pytest.raises(cuda_device.NoCudaDevice) as refused:
        device.ensure_kernels()
    assert str(refused.value) == COMPILE_FAILED
    assert [text.split(" (")[0] for text, _ in device.said] == ["Compiling the GPU expert kernels for sm_90"]
    assert not device.kernels_ready and device.kernels_note == ""


def test_a_module_the_driver_refuses_refuses_the_device_in_one_line(device, monkeypatch):
    """NVRTC newer than the driver makes PTX the driver cannot load: said with what to do."""
    _modules(monkeypatch, Refused(CUDADriverError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled "
                                                   "with an unsupported toolchain.")))
    with pytest.raises(cuda_device.NoCudaDevice) as refused:
        device.ensure_kernels()
    assert str(refused.value) == (
        "the NVIDIA driver refuses the GPU expert kernels for sm_90, the Stand-in GPU (80 GiB) (CUDADriverError: "
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with an unsupported toolchain.) (made by an "
        "NVRTC newer than the driver: update the NVIDIA driver)")


def test_kernels_that_cannot_be_had_fall_back_to_the_cpu_under_auto_and_are_refused_under_required(monkeypatch):
    """The kernels were loaded at the load's first slots, after the engine was built: under mode=auto the load failed
    on CuPy's multi-line error, where every other unusable GPU runs the experts on the CPU with the reason said. The
    device opened for a load has its kernels loaded with it: under auto the load goes on without it, under required
    it is refused, in one line."""
    stand_in_cupy(monkeypatch)
    _modules(monkeypatch, Refused(CompileException(NVRTC_LOG, "source", "kern.cu", ())))
    assert cuda_device.cuda_device_or_cpu(0, "auto") == (
        None, f"The CUDA GPU was asked for but cannot be used ({COMPILE_FAILED}); every expert runs on the CPU "
              "instead.")
    with pytest.raises(cuda_device.NoCudaDevice) as refused:
        cuda_device.cuda_device_or_cpu(0, "required")
    assert str(refused.value) == COMPILE_FAILED
    assert cuda_device._pool_caps == {0: {}}  # (the devices refused hold no cap on CuPy's pool)


def test_a_device_opened_for_a_load_has_its_kernels_loaded(monkeypatch):
    stand_in_cupy(monkeypatch)
    module = _Module(compile_s=0.0)
    loaded = _modules(monkeypatch, module)
    device, note = cuda_device.cuda_device_or_cpu(0, "auto")
    assert note == "" and device.kernels_ready and loaded == ["90"] and module.asked == ["route_topk"]


def test_kernels_refused_once_are_refused_at_once_at_the_next_load(monkeypatch):
    """The kernel module of a failed compile stays cached, uncompiled: every later load in the process (the window's
    next load under mode=auto) ran NVRTC's 1-2 minutes again for the same failure, with the same source, NVRTC and
    driver. The refusal is kept for the process; a GPU's memory running out while the module loads is not kept."""
    stand_in_cupy(monkeypatch)
    loaded = _modules(monkeypatch, Refused(CompileException(NVRTC_LOG, "source", "kern.cu", ())))
    for _load in range(2):
        assert cuda_device.cuda_device_or_cpu(0, "auto") == (
            None, f"The CUDA GPU was asked for but cannot be used ({COMPILE_FAILED}); every expert runs on the CPU "
                  "instead.")
    assert loaded == ["90"]
    monkeypatch.setattr(cuda_device, "_kernels_refused_for", {})
    loaded = _modules(monkeypatch, Refused(CUDADriverError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")))
    for _load in range(2):
        assert cuda_device.cuda_device_or_cpu(0, "auto")[0] is None
    assert loaded == ["90", "90"]
