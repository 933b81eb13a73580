"""kernels/gpu/driver_calls.py and the driver path of GpuQMoE.upload_expert_device without a GPU: stand-ins with the
C signatures of cuMemcpyHtoDAsync_v2 and cuLaunchKernel record what the path hands the driver (the memcpy stand-in
also copies, host to host, so the staging buffer it fills is checked against pack_device.stage_numpy). The GPU half
is tests/test_gpu_driver_copies.py (marker gpu)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from kernels.gpu import driver_calls, layout as L
from kernels.gpu.driver_calls import LAUNCH_KERNEL, MEMCPY_HTOD_ASYNC, DriverCalls, DriverError
from kernels.gpu.pack_device import DriverPackIssuer, plan_for, stage_numpy
from kernels.gpu.qmoe import GpuQMoE
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case

STREAM = 0x5150


class StandInDriver:
    """cuMemcpyHtoDAsync_v2 and cuLaunchKernel as ctypes callbacks: every call recorded, statuses to return set by
    the test. The memcpy really copies (host memory stands in for the device's)."""

    def __init__(self, memcpy_status=0, launch_status=0, pack_expert=True):
        self.memcpy_status, self.launch_status = memcpy_status, launch_status
        self.pack_expert = pack_expert  # the launches are pack_expert's: read its six arguments
        self.copies, self.launches = [], []
        self._memcpy = MEMCPY_HTOD_ASYNC(self.memcpy)  # kept: ctypes frees a callback nobody holds
        self._launch = LAUNCH_KERNEL(self.launch)
        self.calls = DriverCalls(self._memcpy, self._launch)

    def memcpy(self, dst, src, nbytes, stream):
        self.copies.append((dst, src, nbytes, stream))
        if self.memcpy_status == 0:
            ctypes.memmove(dst, src, nbytes)
        return self.memcpy_status

    def launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launches.append(dict(function=function, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream, params=ctypes.addressof(params.contents), extra=bool(extra),
                                  args=_pack_expert_args(params) if self.pack_expert else None))
        return self.launch_status


def _pack_expert_args(params) -> tuple:
    """pack_expert(desc, staged, slot, slot_map, e, old) read from the argument array as the kernel's C types."""
    def arg(i, ctype):
        return ctypes.cast(params[i], ctypes.POINTER(ctype))[0]

    return (arg(0, ctypes.c_void_p), arg(1, ctypes.c_void_p), arg(2, ctypes.c_int32), arg(3, ctypes.c_void_p),
            arg(4, ctypes.c_int32), arg(5, ctypes.c_int32))


def _plans(**kw):
    attrs, t, x, _ = make_case(seed=3, E=5, T=1, H=128, I=64, bits=4, block_size=32, **kw)
    t = {k: v for k, v in t.items() if v is not None}
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    fc1, fc2 = L.make_layouts(spec, t)
    plan1 = plan_for(spec, t, fc1)
    return plan1, plan_for(spec, t, fc2, offset=plan1.nbytes)


def _issuer(driver, staging):
    return DriverPackIssuer(driver.calls, function_ptr=0xF00, grid=7, desc_ptr=0xD000, staging_ptr=staging.ctypes.data,
                            slot_map_ptr=0x5000, stream_ptr=STREAM)


def test_a_copy_goes_to_the_staging_offset_of_every_stored_tensor_from_the_experts_rows():
    plans = _plans(zero_points=True, bias=True)
    copies = GpuQMoE._host_copies(plans)
    assert len(copies) == 8  # w, s, z, b of FC1 and FC2
    driver = StandInDriver()
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    issuer = _issuer(driver, staging)
    for e in (3, 0, 4):
        driver.copies.clear()
        staging[:] = 0
        issuer.issue(copies, e, slot=1, old=-1)
        want = [(staging.ctypes.data + off, a[e].ctypes.data, a[e].nbytes, STREAM)
                for plan in plans for a, off in plan.parts.values()]
        assert driver.copies == want
        assert staging.tobytes() == stage_numpy(plans, e).tobytes()  # what pack_expert reads


def test_the_prepared_launch_rewrites_only_slot_expert_and_old():
    plans = _plans(bias=True)
    driver = StandInDriver()
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    issuer = _issuer(driver, staging)
    for e, slot, old in ((2, 0, -1), (4, 1, 2), (1, 0, 2)):
        issuer.issue(GpuQMoE._host_copies(plans), e, slot, old)
    first, *rest = driver.launches
    assert first == dict(function=0xF00, grid=(7, 1, 1), block=(256, 1, 1), smem=0, stream=STREAM,
                         params=first["params"], extra=False, args=(0xD000, staging.ctypes.data, 0, 0x5000, 2, -1))
    assert [launch["args"][2:] for launch in rest] == [(1, 0x5000, 4, 2), (0, 0x5000, 1, 2)]
    assert all(launch["params"] == first["params"] for launch in rest)  # the same argument array every time
    assert all({k: v for k, v in launch.items() if k != "args"} == {k: v for k, v in first.items() if k != "args"}
               for launch in rest)


def test_the_argument_slots_hold_the_kernels_c_types():
    driver = StandInDriver(pack_expert=False)
    launch = driver.calls.prepare(0x10, (3, 2), (128,), (ctypes.c_void_p(0xAB00), np.int32(-4), np.int64(1 << 40),
                                                        np.float32(0.5)), 1024, 0)
    types = [type(launch.argument(i)) for i in range(4)]
    assert types == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float]
    for i in range(4):  # the array points at the values rewritten in place
        assert launch.params[i] == ctypes.addressof(launch.argument(i))
    launch.argument(1).value = 9
    launch.launch()
    seen = driver.launches[0]
    assert seen["grid"] == (3, 2, 1) and seen["block"] == (128, 1, 1) and seen["smem"] == 1024
    assert seen["stream"] is None  # the default stream
    assert ctypes.cast(launch.params[1], ctypes.POINTER(ctypes.c_int32))[0] == 9


def test_a_refused_call_names_itself_and_the_cuda_result():
    plans = _plans()
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    with pytest.raises(DriverError, match=r"cuMemcpyHtoDAsync_v2 failed: CUresult 1$"):
        _issuer(StandInDriver(memcpy_status=1), staging).issue(GpuQMoE._host_copies(plans), 0, 0, -1)
    driver = StandInDriver(launch_status=700)
    with pytest.raises(DriverError, match=r"cuLaunchKernel failed: CUresult 700$") as raised:
        _issuer(driver, staging).issue(GpuQMoE._host_copies(plans), 0, 0, -1)
    assert (raised.value.call, raised.value.status) == ("cuLaunchKernel", 700)
    assert len(driver.copies) == len(GpuQMoE._host_copies(plans))  # the copies went first


def test_the_driver_calls_are_made_once_per_process():
    assert DriverCalls.from_driver() is DriverCalls.from_driver()  # None on a machine without libcuda


def _driver_path_only(issuer=None, packs=0):
    """A GpuQMoE with only what _pack_expert_driver reads (no CuPy needed while an issuer exists)."""
    gpu = object.__new__(GpuQMoE)
    gpu.driver_packs, gpu.driver_copy_fallback = packs, None
    gpu.expert_in_slot = np.full(2, -1, np.int32)
    gpu.slot_of = np.full(5, -1, np.int32)
    gpu._pack_copies = GpuQMoE._host_copies(_plans())
    gpu._driver_issuers = {} if issuer is None else {STREAM: issuer}
    return gpu


def test_a_driver_failure_before_the_first_copy_falls_back_for_good():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    stream = SimpleNamespace(ptr=STREAM)
    gpu = _driver_path_only(_issuer(StandInDriver(launch_status=1), staging))
    assert gpu._pack_expert_driver(3, 1, stream) is False
    assert gpu.driver_copy_fallback == "cuLaunchKernel failed: CUresult 1"
    assert gpu.slot_of[3] == -1 and gpu.expert_in_slot[1] == -1  # the maps left to the CuPy path


def test_a_driver_failure_after_copies_went_through_is_raised():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    gpu = _driver_path_only(_issuer(StandInDriver(launch_status=719), staging), packs=5)
    with pytest.raises(DriverError, match="CUresult 719"):
        gpu._pack_expert_driver(3, 1, SimpleNamespace(ptr=STREAM))
    assert gpu.driver_copy_fallback is None


def test_no_driver_falls_back_with_the_reason(monkeypatch):
    monkeypatch.setattr(driver_calls.DriverCalls, "from_driver", classmethod(lambda cls: None))
    gpu = _driver_path_only()
    assert gpu._pack_expert_driver(3, 1, SimpleNamespace(ptr=STREAM)) is False
    assert "cuMemcpyHtoDAsync_v2 and cuLaunchKernel" in gpu.driver_copy_fallback


def test_a_copy_through_the_driver_updates_the_hosts_maps():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    driver = StandInDriver()
    gpu = _driver_path_only(_issuer(driver, staging))
    stream = SimpleNamespace(ptr=STREAM)
    assert gpu._pack_expert_driver(3, 1, stream) and gpu._pack_expert_driver(4, 1, stream)  # 4 evicts 3
    assert gpu.slot_of.tolist() == [-1, -1, -1, -1, 1] and gpu.expert_in_slot.tolist() == [-1, 4]
    assert gpu.driver_packs == 2 and [launch["args"][4:] for launch in driver.launches] == [(3, -1), (4, 3)]
