"""cuda_device_problem: whether a CUDA device is there, told without opening it (CPU only: a stand-in CuPy). The GUI
asks it from its own thread, where opening a device would start a second OpenMP pool beside the engine thread's."""
from __future__ import annotations

import sys
import types

import pytest

import engine.offload.cuda_device as cuda_device
import engine.offload.host_bandwidth as host_bandwidth


def _fake_cupy(get_count, nvrtc_version=lambda: (12, 8)) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count),
                                      nvrtc=types.SimpleNamespace(getVersion=nvrtc_version))
    return cupy


@pytest.fixture(autouse=True)
def every_gpu_visible(monkeypatch):
    """The messages as without CUDA_VISIBLE_DEVICES (which a GPU machine running the suite may set): they name it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def nothing_opened(monkeypatch):
    """CudaDevice and the host bandwidth probe fail the test if anything builds or runs them."""
    def opened(*_args, **_kwargs):
        raise AssertionError("the probe opened a device or measured the host")
    monkeypatch.setattr(cuda_device, "CudaDevice", opened)
    monkeypatch.setattr(host_bandwidth, "stream_read_bandwidth", opened)


def test_a_device_there_gives_no_problem(monkeypatch, nothing_opened):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 2))
    assert cuda_device.cuda_device_problem() == ""
    assert cuda_device.cuda_device_problem(1) == ""
    assert cuda_device.cuda_device_problem(2) == "no CUDA device 2: 2 found"


def test_a_gpu_hidden_by_cuda_visible_devices_is_said_to_be_hidden(monkeypatch, nothing_opened):
    """CUDA_VISIBLE_DEVICES='' (or naming no GPU of the machine) makes CUDA find none: --device cuda said "no CUDA
    device: cudaErrorNoDevice: no CUDA-capable device is detected" on a machine with GPUs, with nothing pointing at the
    variable that hid them."""
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_device))
    assert cuda_device.cuda_device_problem() == (
        "no CUDA device: cudaErrorNoDevice: no CUDA-capable device is detected (CUDA_VISIBLE_DEVICES='' hides every "
        "GPU it does not list)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 1))
    assert cuda_device.cuda_device_problem(1) == (
        "no CUDA device 1: 1 found (CUDA_VISIBLE_DEVICES='2' hides every GPU it does not list)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_device.cuda_device_problem(1) == "no CUDA device 1: 1 found"


def test_a_missing_driver_or_cupy_is_named(monkeypatch, nothing_opened):
    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient\ncall stack ...")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    assert cuda_device.cuda_device_problem() == (
        "no CUDA device: cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert "needs CuPy" in cuda_device.cuda_device_problem()


def test_a_driver_older_than_cupys_cuda_says_so(monkeypatch, nothing_opened):
    """cupy-cuda13x on a CUDA 12 driver (pip install '.[cuda13]' on driver 550, or a driver downgraded after make):
    it read "no CUDA device", with a GPU there. No driver at all (driverGetVersion 0) read "no CUDA device:
    cudaErrorInsufficientDriver: CUDA driver version is insufficient ...", a version where there is no driver, and
    nothing to do: it says the driver is missing."""
    def insufficient():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    for driver, said in ((12040, "the NVIDIA driver runs CUDA 12.4, older than the CUDA 13.0 this CuPy is built for "
                                  "(make clean install installs the builds this driver runs, or update the driver)"),
                         (0, "no NVIDIA driver: CUDA finds none (install the NVIDIA driver, or run on the CPU)")):
        cupy = _fake_cupy(insufficient)
        cupy.cuda.runtime.driverGetVersion = lambda driver=driver: driver
        cupy.cuda.runtime.runtimeGetVersion = lambda: 13000
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        assert cuda_device.cuda_device_problem() == said


def test_open_cuda_device_refuses_as_the_probe_says(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    with pytest.raises(cuda_device.NoCudaDevice, match="no CUDA device 0: 0 found"):
        cuda_device.open_cuda_device()


CUPY_BANNER = """
================================================================
Failed to import CuPy.

If you installed CuPy via wheels (cupy-cudaXXX or cupy-rocm-X-X), make sure that the package matches with the version of CUDA or ROCm installed.

Original error:
  ImportError: {missing}: cannot open shared object file: No such file or directory
================================================================
"""


def _cupy_that_fails_to_load(monkeypatch, tmp_path, missing: str, lazily: bool) -> None:
    """A CuPy installed but whose libraries do not load: CuPy 13 raises ImportError from `import cupy`, later CuPy
    imports and raises RuntimeError at its first use; both with the banner above."""
    package = tmp_path / "cupy"
    package.mkdir()
    banner = CUPY_BANNER.format(missing=missing)
    body = (f"def __getattr__(name):\n    raise RuntimeError({banner!r})\n" if lazily
            else f"raise ImportError({banner!r})\n")
    (package / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)


@pytest.mark.parametrize("lazily", [False, True])
def test_cupy_installed_without_the_driver_names_the_driver_not_cupy(monkeypatch, tmp_path, nothing_opened, lazily):
    """No NVIDIA driver (libcuda.so.1 missing): the window and --device cuda said "the CUDA GPU needs CuPy (install
    with `make install` ...)" with CuPy installed (CuPy 13), or "no CUDA device: " and nothing after it (later CuPy,
    whose message starts with a blank line)."""
    _cupy_that_fails_to_load(monkeypatch, tmp_path, "libcuda.so.1", lazily)
    assert cuda_device.cuda_device_problem() == (
        "no NVIDIA driver: CuPy cannot load libcuda.so.1, the driver's library (install the NVIDIA driver, or run on "
        "the CPU)")


@pytest.mark.parametrize("lazily", [False, True])
def test_cupy_for_another_cuda_names_the_library_it_lacks(monkeypatch, tmp_path, nothing_opened, lazily):
    """cupy-cuda12x where CUDA 12's runtime is not installed (CUDA 13's only, or none)."""
    _cupy_that_fails_to_load(monkeypatch, tmp_path, "libcudart.so.12", lazily)
    assert cuda_device.cuda_device_problem() == (
        "CuPy is installed but does not load (ImportError: libcudart.so.12: cannot open shared object file: No such "
        "file or directory): make clean install installs the CuPy build this driver runs")


def test_a_gpu_there_that_cannot_be_opened_falls_back_to_the_cpu_under_auto(monkeypatch):
    """The GPU is found but opening it fails: busy (exclusive-process mode, another process holds it) or its memory
    taken by other processes (the probe's 512 MiB). CuPy's error passed through cuda_device_or_cpu, which catches only
    the engine's: mode=auto failed the load ('Could not load ...: CUDARuntimeError ...', on the command line an
    'internal error') instead of running every expert on the CPU, with the reason said."""
    import contextlib

    class CUDARuntimeError(RuntimeError):
        pass

    class OutOfMemoryError(MemoryError):
        pass

    for error, said in ((CUDARuntimeError("cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or "
                                          "unavailable"),
                         "CUDA device 0 cannot be opened (CUDARuntimeError: cudaErrorDevicesUnavailable: CUDA-capable "
                         "device(s) is/are busy or unavailable)"),
                        (OutOfMemoryError("Out of memory allocating 268,435,456 bytes (allocated so far: 0 bytes)."),
                         "CUDA device 0 cannot be opened (OutOfMemoryError: Out of memory allocating 268,435,456 bytes "
                         "(allocated so far: 0 bytes).)")):
        def refuses(error=error):
            raise error

        cupy = _fake_cupy(lambda: 1)
        cupy.cuda.runtime.CUDARuntimeError = CUDARuntimeError
        cupy.cuda.runtime.memGetInfo = refuses
        cupy.cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
        cupy.cuda.Device = lambda _index: contextlib.nullcontext()
        cupy.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        assert cuda_device.cuda_device_or_cpu(0, "auto") == (
            None, f"The CUDA GPU was asked for but cannot be used ({said}); every expert runs on the CPU instead.")
        with pytest.raises(cuda_device.NoCudaDevice) as refused:
            cuda_device.cuda_device_or_cpu(0, "required")
        assert str(refused.value) == said


def test_a_cupy_left_incomplete_is_said_so_not_taken_for_no_gpu(monkeypatch, tmp_path, nothing_opened):
    """cupy-cuda12x and cupy-cuda13x install one module: uninstalling one after installing the other (by hand, not
    make's order) leaves a cupy folder without its files, which imports as an empty namespace package. That read
    "no CUDA device: module 'cupy' has no attribute 'cuda'", with a GPU there."""
    (tmp_path / "cupy").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert cuda_device.cuda_device_problem() == (
        "CuPy is installed incompletely (module 'cupy' has no attribute 'cuda'): make clean install installs it again")


def test_a_missing_nvrtc_falls_back_to_the_cpu_under_auto_and_is_refused_under_required(monkeypatch):
    """CuPy and the driver there, NVRTC not (CuPy without its [ctk] extra on a machine with only the driver): CuPy
    loads the library at its first compile, and every GPU kernel needs it (kernels/gpu's module without a prebuilt
    cubin, CuPy's own with one). The device opened, and the load failed later on CuPy's RuntimeError, under
    mode=auto too, where every other missing piece falls back to the CPU with the reason said."""
    def no_nvrtc():
        raise RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open shared object "
                           "file: No such file or directory")

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 1, no_nvrtc))
    monkeypatch.setattr(cuda_device, "CudaDevice", lambda index, mem_limit: "a device whose kernels cannot compile")
    said = ("the GPU kernels cannot be compiled: CuPy cannot load libnvrtc.so.12, NVRTC, CUDA's runtime compiler "
            "(install the cuda12 or cuda13 extra, which brings it: make clean install)")
    assert cuda_device.cuda_device_or_cpu(0, "auto") == (
        None, f"The CUDA GPU was asked for but cannot be used ({said}); every expert runs on the CPU instead.")
    with pytest.raises(cuda_device.NoCudaDevice) as refused:
        cuda_device.cuda_device_or_cpu(0, "required")
    assert str(refused.value) == said
    assert cuda_device.cuda_device_problem() == said  # the window's device choice says it before a load
