"""GpuQMoE.upload_expert_device through the driver (kernels.gpu.driver_calls; marker gpu, skipped without a GPU):
the same slot contents, byte for byte, and the same maps (the device's too) with an expert's memcpys in one
cuMemcpyBatchAsync and one by one as through CuPy's calls and as upload_expert (packed on the host), over layouts,
slots, streams and instances sharing a staging buffer; decode forwards after such copies against the reference; the
fallback to CuPy's calls. The CPU half is tests/test_driver_calls.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.test_cuda_step import _DEVICE_PACK_CASES

pytestmark = pytest.mark.gpu

# (slot, expert): evictions (5 leaves slot 0), an expert moved to another slot (1: slot 2 -> 1), a slot refilled
# with the expert it holds (1 into slot 1)
SEQUENCE = ((0, 5), (2, 1), (0, 6), (1, 1), (1, 1), (2, 7), (0, 5))


def _node(bits, block_size, zero_points, bias, dtype, H, I, activation, fusion, E=8, T=2, seed=33):
    import ml_dtypes

    from kernels.qmoe_spec import QMoESpec
    from tests.qmoe_oracle import make_case

    attrs, t, x, lg = make_case(seed=seed, E=E, H=H, I=I, k=2, bits=bits, block_size=block_size, T=T,
                                activation=activation, swiglu_fusion=fusion, zero_points=zero_points, bias=bias,
                                dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    return QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape), t, x, lg


def _batched(n: int) -> int:
    """The experts of n driver copies that go in one batch memcpy: none where the driver predates CUDA 12.8."""
    from kernels.gpu.driver_calls import DriverCalls

    return n if DriverCalls.from_driver().batch_call else 0


def _assert_same_slots(cp, got, want, what=""):
    for name in want.slots:
        for key in want.slots[name]:
            assert cp.array_equal(got.slots[name][key].view(cp.uint8), want.slots[name][key].view(cp.uint8)), \
                (what, name, key)
    assert np.array_equal(got.slot_of, want.slot_of) and np.array_equal(got.expert_in_slot, want.expert_in_slot)
    assert np.array_equal(cp.asnumpy(got._slot_dev), got.slot_of), what  # pack_expert updated the device's map


@pytest.mark.parametrize("case", _DEVICE_PACK_CASES)
def test_driver_copies_fill_slots_as_cupys_calls_and_the_host_packing_do(case):
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE

    spec, t, _, _ = _node(*case)
    host, through_cupy, through_driver, batched = (GpuQMoE(spec, t, num_slots=3, resident=[]) for _ in range(4))
    through_cupy.driver_copies = False
    through_driver.batch_copies = False  # one memcpy per stored tensor
    stream = cp.cuda.Stream(non_blocking=True)
    for slot, expert in SEQUENCE:
        host.upload_expert(expert, slot, stream=stream)
        through_cupy.upload_expert_device(expert, slot, stream=stream)
        through_driver.upload_expert_device(expert, slot, stream=stream)
        batched.upload_expert_device(expert, slot, stream=stream)
    stream.synchronize()
    packs = 0 if spec.has_fc3 else len(SEQUENCE)  # FC3: layout.pack, neither path
    assert (through_driver.driver_packs, through_driver.device_packs, through_cupy.driver_packs) == (packs, packs, 0)
    assert (through_driver.batch_packs, batched.driver_packs, batched.batch_packs) == (0, packs, _batched(packs))
    assert through_driver.driver_copy_fallback is None and batched.driver_copy_fallback is None
    assert batched.batch_copy_fallback is None or not _batched(1), batched.batch_copy_fallback
    _assert_same_slots(cp, batched, through_driver, "batched vs one memcpy per tensor")
    _assert_same_slots(cp, through_driver, host, "driver vs host")
    _assert_same_slots(cp, batched, host, "batched vs host")
    _assert_same_slots(cp, through_cupy, host, "CuPy vs host")


def test_driver_copies_on_two_streams_and_instances_sharing_a_stream():
    """A staging buffer per stream, shared by the instances copying on it (the engine's layers on its copy
    stream): interleaved copies of two instances and two streams still land as the host packing's."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE

    spec, t, _, _ = _node(*_DEVICE_PACK_CASES[0])
    spec_b, t_b, _, _ = _node(*_DEVICE_PACK_CASES[0], seed=34)  # the same layout, other weights
    a, b = GpuQMoE(spec, t, num_slots=3, resident=[]), GpuQMoE(spec_b, t_b, num_slots=3, resident=[])
    host_a, host_b = GpuQMoE(spec, t, num_slots=3, resident=[]), GpuQMoE(spec_b, t_b, num_slots=3, resident=[])
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for i, (slot, expert) in enumerate(SEQUENCE):
        stream = (s1, s2)[i % 2]
        a.upload_expert_device(expert, slot, stream=stream)
        b.upload_expert_device(7 - expert, slot, stream=s1)
        host_a.upload_expert(expert, slot, stream=stream)
        host_b.upload_expert(7 - expert, slot, stream=s1)
        stream.synchronize()  # a slot is not overwritten on one stream while the other still writes it
    s1.synchronize()
    s2.synchronize()
    assert a.driver_packs == b.driver_packs == len(SEQUENCE)
    assert a.batch_packs == b.batch_packs == _batched(len(SEQUENCE))
    assert a._driver_staging[s1.ptr] is b._driver_staging[s1.ptr]  # one buffer per stream
    assert a._driver_staging[s1.ptr] is not a._driver_staging[s2.ptr]
    _assert_same_slots(cp, a, host_a, "a")
    _assert_same_slots(cp, b, host_b, "b")


def test_set_source_copies_through_the_driver_from_the_other_nodes_rows():
    """The streaming slots' use: one instance, experts of another node of the same layout (set_source)."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE

    spec, t, _, _ = _node(*_DEVICE_PACK_CASES[2])
    spec_b, t_b, _, _ = _node(*_DEVICE_PACK_CASES[2], seed=35)
    spec_b = dataclasses.replace(spec_b, node_name="test/QMoE_b")
    slots, host_b = GpuQMoE(spec, t, num_slots=2, resident=[]), GpuQMoE(spec_b, t_b, num_slots=2, resident=[])
    stream = cp.cuda.Stream(non_blocking=True)
    slots.upload_expert_device(3, 0, stream=stream)  # from the first node
    slots.set_source(spec_b, t_b)
    for slot, expert in ((0, 2), (1, 6)):
        slots.upload_expert_device(expert, slot, stream=stream)
        host_b.upload_expert(expert, slot, stream=stream)
    stream.synchronize()
    assert slots.driver_packs == 3 and slots.batch_packs == _batched(3)  # the other node's rows in the same batch
    _assert_same_slots(cp, slots, host_b)


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one-memcpy-per-tensor"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_after_driver_copies_matches_the_reference(dtype, batch):
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from kernels.reference import qmoe_reference
    from tests.test_qmoe_gpu import _relerr

    spec, t, x, lg = _node(4, 32, False, True, dtype, 128, 64, "swiglu", 1, T=4)
    full = GpuQMoE(spec, t)
    m = GpuQMoE(spec, t, num_slots=spec.num_experts, resident=[])
    m.batch_copies = batch
    stream = cp.cuda.Stream(non_blocking=True)
    for slot, expert in enumerate(np.random.default_rng(2).permutation(spec.num_experts)):
        m.upload_expert_device(int(expert), slot, stream=stream)
    stream.synchronize()
    assert m.driver_packs == spec.num_experts and m.resident_experts().size == spec.num_experts
    assert m.batch_packs == (_batched(spec.num_experts) if batch else 0)
    # the decode tolerances of tests/test_qmoe_gpu.py; against all resident from the start: the same kernels on the
    # same slot contents, in another slot order (fp16 output: an ulp where a sum's order differs)
    tol_ref, tol_full = (1e-4, 1e-6) if dtype == "float32" else (4e-3, 2e-3)
    for T in (1, 4):
        got = m.forward(x[:T], lg[:T])
        assert _relerr(got, qmoe_reference(x[:T], lg[:T], spec, t)) <= tol_ref
        assert _relerr(got, full.forward(x[:T], lg[:T])) <= tol_full


def test_decode_with_only_the_copied_experts_resident():
    """Two slots refilled through the driver between forwards: the pairs of experts not resident are skipped."""
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE
    from tests.test_qmoe_gpu import _ref_pairs, _relerr

    spec, t, x, _ = _node(8, 32, True, True, "float32", 128, 64, "swiglu", 1, T=3)
    m = GpuQMoE(spec, t, num_slots=2, resident=[])
    ids = np.array([[5, 2], [1, 5], [2, 7]], np.int32)
    w = np.array([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    for resident in ((5, 2), (1, 2), (7, 1)):
        for slot, expert in enumerate(resident):
            m.upload_expert_device(expert, slot, stream=stream)
        stream.synchronize()
        got = m.run_experts(x, ids, w)
        mask = np.isin(ids, resident)
        assert _relerr(got, _ref_pairs(x, np.where(mask, ids, -1), w, spec, t)) <= 1e-4, resident


def test_no_driver_falls_back_to_cupys_calls(monkeypatch):
    cp = pytest.importorskip("cupy")
    from kernels.gpu import GpuQMoE, driver_calls

    monkeypatch.setattr(driver_calls.DriverCalls, "from_driver", classmethod(lambda cls: None))
    spec, t, _, _ = _node(*_DEVICE_PACK_CASES[0])
    m, host = GpuQMoE(spec, t, num_slots=3, resident=[]), GpuQMoE(spec, t, num_slots=3, resident=[])
    stream = cp.cuda.Stream(non_blocking=True)
    for slot, expert in SEQUENCE:
        m.upload_expert_device(expert, slot, stream=stream)
        host.upload_expert(expert, slot, stream=stream)
    stream.synchronize()
    assert "cuMemcpyHtoDAsync_v2 and cuLaunchKernel" in m.driver_copy_fallback
    assert m.driver_packs == 0 and m.device_packs == len(SEQUENCE)
    _assert_same_slots(cp, m, host)
