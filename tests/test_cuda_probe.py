"""cuda_device_problem: whether a CUDA device is there, told without opening it (CPU only: a stand-in CuPy). The GUI
asks it from its own thread, where opening a device would start a second OpenMP pool beside the engine thread's."""
from __future__ import annotations

import sys
import types

import pytest

import engine.offload.cuda_device as cuda_device
import engine.offload.host_bandwidth as host_bandwidth


def _fake_cupy(get_count) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count))
    return cupy


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


def test_a_missing_driver_or_cupy_is_named(monkeypatch, nothing_opened):
    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient\ncall stack ...")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    assert cuda_device.cuda_device_problem() == (
        "no CUDA device: cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert "needs CuPy" in cuda_device.cuda_device_problem()


def test_open_cuda_device_refuses_as_the_probe_says(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    with pytest.raises(cuda_device.NoCudaDevice, match="no CUDA device 0: 0 found"):
        cuda_device.open_cuda_device()
