"""kernels/gpu/driver_calls.py and the driver path of GpuQMoE.upload_expert_device without a GPU: stand-ins with the
C signatures of cuMemcpyHtoDAsync_v2, cuMemcpyBatchAsync(_v2) and cuLaunchKernel record what the path hands the
driver (the memcpy stand-ins also copy, host to host, so the staging buffer they fill is checked against
pack_device.stage_numpy). The GPU half is tests/test_gpu_driver_copies.py (marker gpu)."""
from __future__ import annotations

import ctypes
import gc
from types import SimpleNamespace

import numpy as np
import pytest

from kernels.gpu import driver_calls, layout as L
from kernels.gpu.driver_calls import (EVENT_RECORD_WITH_FLAGS, LAUNCH_KERNEL, MEMCPY_BATCH_ASYNC, MEMCPY_BATCH_ASYNC_V2,
                                      MEMCPY_HTOD_ASYNC, DriverCalls, DriverError, MemcpyAttributes, MemLocation)
from kernels.gpu.pack_device import DriverPackIssuer, plan_for, stage_numpy
from kernels.gpu.qmoe import GpuQMoE
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case

STREAM = 0x5150
# Every stand-in made, kept for the process. DriverCalls keeps only its functions' addresses (libcuda is never
# unloaded), so a stand-in collected while an issuer over it lives would leave that issuer calling freed ctypes
# thunks: the crash CI saw when a test passed StandInDriver(...) straight to _issuer.
_STAND_INS: list = []


class StandInDriver:
    """cuMemcpyHtoDAsync_v2, cuMemcpyBatchAsync_v2 / cuMemcpyBatchAsync (``batch``: "v2", "12.8", None: neither) and
    cuLaunchKernel as ctypes callbacks: every call recorded, statuses to return set by the test. The memcpys really
    copy (host memory stands in for the device's)."""

    def __init__(self, memcpy_status=0, launch_status=0, pack_expert=True, batch=None, batch_status=0):
        _STAND_INS.append(self)
        self.memcpy_status, self.launch_status, self.batch_status = memcpy_status, launch_status, batch_status
        self.pack_expert = pack_expert  # the launches are pack_expert's: read its six arguments
        self.copies, self.launches, self.batches = [], [], []
        self._memcpy = MEMCPY_HTOD_ASYNC(self.memcpy)  # kept: ctypes frees a callback nobody holds
        self._launch = LAUNCH_KERNEL(self.launch)
        self._batch_v2 = MEMCPY_BATCH_ASYNC_V2(self.batch_v2)
        self._batch_12 = MEMCPY_BATCH_ASYNC(self.batch_12)
        # libcuda as DriverCalls.over reads it: its symbols as attributes
        self.library = SimpleNamespace(cuMemcpyHtoDAsync_v2=self._memcpy, cuLaunchKernel=self._launch,
                                       **({"cuMemcpyBatchAsync_v2": self._batch_v2} if batch == "v2" else {}),
                                       **({"cuMemcpyBatchAsync": self._batch_12} if batch in ("v2", "12.8") else {}))
        self.calls = DriverCalls.over(self.library)

    def memcpy(self, dst, src, nbytes, stream):
        self.copies.append((dst, src, nbytes, stream))
        if self.memcpy_status == 0:
            ctypes.memmove(dst, src, nbytes)
        return self.memcpy_status

    def batch_v2(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream, abi="v2", fail_idx=None):
        arrays = (dsts, srcs, sizes)  # the arrays' addresses (void* in the signature)
        dsts, srcs, sizes, attrs_idxs = (ctypes.cast(a, ctypes.POINTER(t)) for a, t in (
            (dsts, ctypes.c_uint64), (srcs, ctypes.c_uint64), (sizes, ctypes.c_size_t), (attrs_idxs, ctypes.c_size_t)))
        attr = ctypes.cast(attrs, ctypes.POINTER(MemcpyAttributes))[0]
        self.batches.append(dict(
            abi=abi, dsts=dsts[:count], srcs=srcs[:count], sizes=sizes[:count], count=count,
            attr=(attr.srcAccessOrder, (attr.srcLocHint.type, attr.srcLocHint.id),
                  (attr.dstLocHint.type, attr.dstLocHint.id), attr.flags),
            attrs_idxs=attrs_idxs[:num_attrs], num_attrs=num_attrs, stream=stream,
            arrays=arrays,
            fail_idx=None if fail_idx is None else bool(fail_idx)))
        if self.batch_status == 0:
            for i in range(count):
                ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return self.batch_status

    def batch_12(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream):
        return self.batch_v2(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream, "12.8", fail_idx)

    def launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launches.append(dict(function=function, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream, params=ctypes.addressof(params.contents), extra=bool(extra),
                                  args=_pack_expert_args(params) if self.pack_expert else None))
        return self.launch_status


def _pack_expert_args(params) -> tuple:
    """pack_expert(desc, staged, slot, slot_map, e, old, host0) read from the argument array as the kernel's C
    types."""
    def arg(i, ctype):
        return ctypes.cast(params[i], ctypes.POINTER(ctype))[0]

    return (arg(0, ctypes.c_void_p), arg(1, ctypes.c_void_p), arg(2, ctypes.c_int32), arg(3, ctypes.c_void_p),
            arg(4, ctypes.c_int32), arg(5, ctypes.c_int32), arg(6, ctypes.c_int32))


def _plans(**kw):
    attrs, t, x, _ = make_case(seed=3, E=5, T=1, H=128, I=64, bits=4, block_size=32, **kw)
    t = {k: v for k, v in t.items() if v is not None}
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    fc1, fc2 = L.make_layouts(spec, t)
    plan1 = plan_for(spec, t, fc1)
    return plan1, plan_for(spec, t, fc2, offset=plan1.nbytes)


def _issuer(driver, staging, stream=STREAM):
    return DriverPackIssuer(driver.calls, function_ptr=0xF00, grid=7, desc_ptr=0xD000, staging_ptr=staging.ctypes.data,
                            slot_map_ptr=0x5000, stream_ptr=stream)


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
                         params=first["params"], extra=False, args=(0xD000, staging.ctypes.data, 0, 0x5000, 2, -1, -1))
    assert [launch["args"][2:] for launch in rest] == [(1, 0x5000, 4, 2, -1), (0, 0x5000, 1, 2, -1)]
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


def test_an_issuer_over_a_stand_in_nobody_else_holds_still_calls_it():
    plans = _plans()
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    issuer = _issuer(StandInDriver(), staging)
    gc.collect()
    later = StandInDriver()  # its thunks would take the freed ones' places
    issuer.issue(GpuQMoE._host_copies(plans), 2, 0, -1)
    assert later.copies == [] and later.launches == []
    assert _STAND_INS[-2].copies and staging.tobytes() == stage_numpy(plans, 2).tobytes()


def test_the_driver_calls_are_made_once_per_process():
    assert DriverCalls.from_driver() is DriverCalls.from_driver()  # None on a machine without libcuda


def _driver_path_only(issuer=None, packs=0):
    """A GpuQMoE with only what _pack_expert_driver reads (no CuPy needed while an issuer exists)."""
    gpu = object.__new__(GpuQMoE)
    gpu.driver_packs, gpu.driver_copy_fallback = packs, None
    gpu.batch_copies, gpu.batch_copy_fallback, gpu.batch_packs = True, None, 0
    gpu.expert_in_slot = np.full(2, -1, np.int32)
    gpu.slot_of = np.full(5, -1, np.int32)
    plans = _plans()
    gpu._pack_copies = GpuQMoE._host_copies(plans)
    gpu._held_plans = plans  # the copies read the plans' arrays by address: kept alive, as GpuQMoE keeps its tensors
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
    assert gpu.driver_packs == 2 and [launch["args"][4:] for launch in driver.launches] == [(3, -1, -1), (4, 3, -1)]


# ----------------------------------------------------------------------------- one batched memcpy per expert
def test_the_memcpy_attributes_have_cuda_hs_layout():
    # cuda.h: CUmemcpyAttributes {CUmemcpySrcAccessOrder; CUmemLocation src, dst hints; unsigned flags}, CUmemLocation
    # {CUmemLocationType type; int id}
    assert ctypes.sizeof(MemLocation) == 8 and (MemLocation.type.offset, MemLocation.id.offset) == (0, 4)
    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert [getattr(MemcpyAttributes, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")] \
        == [0, 4, 12, 20]


def test_a_batch_copies_every_stored_tensor_in_one_call_from_the_experts_rows():
    plans = _plans(zero_points=True, bias=True)
    copies = GpuQMoE._host_copies(plans)
    driver = StandInDriver(batch="v2")
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    issuer = _issuer(driver, staging)
    for e in (3, 0, 4):
        staging[:] = 0
        assert issuer.issue(copies, e, slot=1, old=-1, batch=True) is True
        want = [(staging.ctypes.data + off, a[e].ctypes.data, a[e].nbytes)
                for plan in plans for a, off in plan.parts.values()]
        batch = driver.batches[-1]
        assert list(zip(batch["dsts"], batch["srcs"], batch["sizes"])) == want and batch["count"] == 8
        assert batch["attr"] == (3, (0, 0), (0, 0), 0)  # sources in any order, no hints, no flags
        assert (batch["attrs_idxs"], batch["num_attrs"], batch["stream"]) == ([0], 1, STREAM)
        assert batch["abi"] == "v2" and batch["fail_idx"] is None
        assert staging.tobytes() == stage_numpy(plans, e).tobytes()  # what pack_expert reads
    assert driver.copies == [] and len(driver.launches) == 3  # no single memcpy; the launch after each batch
    assert len({batch["arrays"] for batch in driver.batches}) == 1  # the arrays made once, rewritten in place
    assert [launch["args"][4] for launch in driver.launches] == [3, 0, 4]


def test_the_batch_takes_cuda_13s_symbol_else_cuda_12_8s_with_its_fail_index_else_none():
    assert StandInDriver(batch="v2").calls.batch_call == "cuMemcpyBatchAsync_v2"  # both there: CUDA 13's ABI
    assert StandInDriver(batch="12.8").calls.batch_call == "cuMemcpyBatchAsync"
    assert StandInDriver().calls.batch_call is None
    plans = _plans()
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    driver = StandInDriver(batch="12.8")
    assert _issuer(driver, staging).issue(GpuQMoE._host_copies(plans), 2, 0, -1, batch=True)
    (batch,) = driver.batches
    assert batch["abi"] == "12.8" and batch["fail_idx"] is True and batch["count"] == 4
    assert staging.tobytes() == stage_numpy(plans, 2).tobytes()
    with pytest.raises(DriverError, match=r"^loading libcuda's cuMemcpyBatchAsync_v2 or cuMemcpyBatchAsync"):
        _issuer(StandInDriver(), staging).issue(GpuQMoE._host_copies(plans), 2, 0, -1, batch=True)
    assert DriverCalls.over(SimpleNamespace(cuLaunchKernel=driver._launch)) is None  # no memcpy: no driver path
    assert DriverCalls.over(None) is None


def test_the_legacy_null_stream_and_batch_off_copy_one_tensor_at_a_time():
    plans = _plans(bias=True)
    copies = GpuQMoE._host_copies(plans)
    staging = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    for stream, batch in ((0, True), (STREAM, False)):
        driver = StandInDriver(batch="v2")
        assert _issuer(driver, staging, stream).issue(copies, 1, 0, -1, batch=batch) is False
        assert driver.batches == [] and len(driver.copies) == len(copies) and len(driver.launches) == 1
    with pytest.raises(ValueError, match="legacy NULL stream"):
        StandInDriver(batch="v2").calls.prepare_batch([1], [1], 0)


def test_another_nodes_copies_reuse_the_batch_where_their_offsets_and_sizes_match():
    """set_source: the same staging plan from other host rows; a batch for another plan is made anew."""
    plans, other = _plans(bias=True), _plans(bias=True)
    for plan in other:  # other rows, the same offsets and sizes
        plan.parts = {key: (a.copy(), off) for key, (a, off) in plan.parts.items()}
    driver = StandInDriver(batch="v2")
    staging = np.zeros(sum(plan.nbytes for plan in _plans(zero_points=True, bias=True)), np.uint8)
    issuer = _issuer(driver, staging)
    for source in (plans, other, plans):
        issuer.issue(GpuQMoE._host_copies(source), 4, 0, -1, batch=True)
        assert driver.batches[-1]["srcs"] == [a[4].ctypes.data for plan in source for a, _ in plan.parts.values()]
    assert len({batch["arrays"] for batch in driver.batches}) == 1
    zp = _plans(zero_points=True, bias=True)
    staging[:] = 0
    issuer.issue(GpuQMoE._host_copies(zp), 4, 0, -1, batch=True)
    assert driver.batches[-1]["count"] == 8 and driver.batches[-1]["arrays"] != driver.batches[0]["arrays"]
    assert staging.tobytes() == stage_numpy(zp, 4).tobytes()


def test_a_refused_batch_before_the_first_went_through_copies_one_by_one_for_good():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    driver = StandInDriver(batch="v2", batch_status=1)
    gpu = _driver_path_only(_issuer(driver, staging), packs=3)  # the per-copy path worked before: still a fallback
    stream = SimpleNamespace(ptr=STREAM)
    assert gpu._pack_expert_driver(3, 1, stream) and gpu._pack_expert_driver(4, 0, stream)
    assert gpu.batch_copy_fallback == "cuMemcpyBatchAsync_v2 failed: CUresult 1"
    assert len(driver.batches) == 1 and len(driver.copies) == 2 * 4 and len(driver.launches) == 2
    assert (gpu.batch_packs, gpu.driver_packs, gpu.driver_copy_fallback) == (0, 5, None)
    assert gpu.slot_of[3] == 1 and gpu.slot_of[4] == 0


def test_a_driver_without_a_batch_memcpy_copies_one_by_one_with_the_reason():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    driver = StandInDriver()
    gpu = _driver_path_only(_issuer(driver, staging))
    assert gpu._pack_expert_driver(3, 1, SimpleNamespace(ptr=STREAM))
    assert "cuMemcpyBatchAsync_v2 or cuMemcpyBatchAsync" in gpu.batch_copy_fallback
    assert (gpu.batch_packs, gpu.driver_packs, len(driver.copies)) == (0, 1, 4)


def test_a_refused_batch_after_batches_went_through_is_raised():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    driver = StandInDriver(batch="12.8")
    gpu = _driver_path_only(_issuer(driver, staging))
    stream = SimpleNamespace(ptr=STREAM)
    assert gpu._pack_expert_driver(3, 1, stream)
    assert (gpu.batch_packs, gpu.driver_packs) == (1, 1)
    driver.batch_status = 719
    with pytest.raises(DriverError, match=r"^cuMemcpyBatchAsync failed: CUresult 719$"):
        gpu._pack_expert_driver(4, 0, stream)
    assert gpu.batch_copy_fallback is None and gpu.driver_copy_fallback is None
    assert len(driver.launches) == 1 and gpu.slot_of[4] == -1  # raised before the launch; the maps unchanged


def test_batch_copies_off_takes_the_single_memcpys():
    staging = np.zeros(sum(plan.nbytes for plan in _plans()), np.uint8)
    driver = StandInDriver(batch="v2")
    gpu = _driver_path_only(_issuer(driver, staging))
    gpu.batch_copies = False
    stream = SimpleNamespace(ptr=STREAM)
    assert gpu._pack_expert_driver(3, 1, stream)
    gpu.batch_copies = True
    assert gpu._pack_expert_driver(4, 0, stream)
    assert len(driver.copies) == 4 and len(driver.batches) == 1 and (gpu.batch_packs, gpu.driver_packs) == (1, 2)


def test_an_event_is_recorded_as_a_graph_node_with_the_external_flag_where_the_driver_has_the_call():
    """record_external: cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL (1), the legacy NULL stream as 0; a
    status is a one-line error naming the call; a driver without the symbol says so (records_in_graphs False)."""
    recorded, status = [], [0]

    def record(event, stream, flags):
        recorded.append((event, stream, flags))
        return status[0]

    callback = EVENT_RECORD_WITH_FLAGS(record)  # kept: ctypes frees a callback nobody holds
    driver = StandInDriver()
    with_record = DriverCalls.over(SimpleNamespace(**vars(driver.library), cuEventRecordWithFlags=callback))
    assert with_record.records_in_graphs and not driver.calls.records_in_graphs
    with_record.record_external(0xE1, STREAM)
    with_record.record_external(0xE2, 0)
    assert recorded == [(0xE1, STREAM, 1), (0xE2, None, 1)]
    status[0] = 400
    with pytest.raises(DriverError, match=r"^cuEventRecordWithFlags failed: CUresult 400$"):
        with_record.record_external(0xE1, STREAM)
    with pytest.raises(DriverError, match=r"^loading libcuda's cuEventRecordWithFlags failed: CUresult -1$"):
        driver.calls.record_external(0xE1, STREAM)
