"""GpuQMoE's host tier without a GPU: where the host rows start (kernels/gpu/host_tier.py) and how the slot arrays'
rows and the device's expert -> slot map are filled (GpuQMoE._pack_rows, _device_map), with NumPy standing in for
CuPy. The GPU tests (test_qmoe_gpu.py, test_offload_cuda.py) run the kernels on it."""
from __future__ import annotations

import types

import numpy as np
import pytest

import kernels.gpu.qmoe as gpu_qmoe
from kernels.gpu import layout
from kernels.gpu.host_tier import first_host_row
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case

GRANULE = 2 << 20


@pytest.mark.parametrize("slots", [0, 1, 3, 32, 100])
def test_the_host_rows_start_past_every_tensors_device_mapping(slots):
    rows = [1_572_864, 393_216, 196_608, 6_144, 8_294_400, 12_345]  # Qwen's and gpt-oss's FC1 tensors, an odd one
    host0 = first_host_row(slots, rows, GRANULE)
    assert host0 >= slots
    for r in rows:
        device_end = -(-slots * r // GRANULE) * GRANULE
        host_start = host0 * r // GRANULE * GRANULE  # where the tensor's host mapping begins
        assert host_start >= device_end
    # the first such row: one row earlier, some tensor's row would lie in its device mapping
    assert host0 == slots or any((host0 - 1) * r < -(-slots * r // GRANULE) * GRANULE for r in rows)


@pytest.fixture
def numpy_gpu(monkeypatch):
    """A GpuQMoE of 3 slots over 6 experts with its arrays in NumPy (the constructor's CuPy work left out)."""
    monkeypatch.setattr(gpu_qmoe, "_cp", lambda: np)
    attrs, t, x, _ = make_case(seed=3, E=6, H=64, I=64, k=2, bits=4, block_size=32, bias=True, T=2)
    t = {k: v for k, v in t.items() if v is not None}
    m = object.__new__(gpu_qmoe.GpuQMoE)
    m.spec, m._tensors = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape), t
    m.fc1, m.fc2 = layout.make_layouts(m.spec, t)
    m.host0 = None
    m.slots = {p.name: {key: np.zeros((13, n), dt) for key, (n, dt) in p.slot_arrays().items()}
               for p in (m.fc1, m.fc2)}
    m.slot_of, m.expert_in_slot = np.full(6, -1, np.int32), np.full(3, -1, np.int32)
    m.device_maps = []
    m._slot_dev = types.SimpleNamespace(set=lambda a, stream=None: m.device_maps.append(np.array(a).tolist()))
    return m


def _packed(m, experts):
    return {p.name: layout.pack(p, *layout.raw_sources(m.spec, m._tensors, p, np.asarray(experts), xp=np), xp=np)
            for p in (m.fc1, m.fc2)}


def test_residents_and_the_host_tier_are_packed_into_their_rows(numpy_gpu):
    m = numpy_gpu
    m._upload_initial([4, 1])
    assert m.slot_of.tolist() == [-1, 1, -1, -1, 0, -1] and m.expert_in_slot.tolist() == [4, 1, -1]
    assert m.device_maps == [m.slot_of.tolist()]  # no host tier: experts in no slot are skipped (-1)
    m.host0 = 7
    m._fill_host_tier()
    residents, every = _packed(m, [4, 1]), _packed(m, range(6))
    for name, proj in m.slots.items():
        for key, rows in proj.items():
            assert np.array_equal(rows[:2], residents[name][key]) and not rows[2:7].any()
            assert np.array_equal(rows[7:13], every[name][key])
    assert m._device_map().tolist() == [7, 1, 9, 10, 0, 12]  # in no slot: the expert's host row


class FakeDriver:
    """libcuda's calls TieredRows makes, recording the mappings (granule 2 MiB; host memory where the driver maps it)."""

    def __init__(self):
        self.next_base, self.maps, self.created = 1 << 40, [], []

    def cuDeviceGetAttribute(self, value, attribute, device):
        value._obj.value = 1
        return 0

    def cuMemGetAllocationGranularity(self, granule, prop, option):
        granule._obj.value = GRANULE
        return 0

    def cuMemAddressReserve(self, base, size, align, addr, flags):
        base._obj.value, self.next_base = self.next_base, self.next_base + size.value
        return 0

    def cuMemCreate(self, handle, size, prop, flags):
        handle._obj.value = len(self.created)
        self.created.append((prop._obj.location.type, size.value))
        return 0

    def cuMemMap(self, at, size, offset, handle, flags):
        self.maps.append((at.value, size.value, handle.value))
        return 0

    def cuMemSetAccess(self, at, size, desc, count):
        return 0


def test_each_array_maps_its_slots_on_the_device_and_every_expert_on_the_host(monkeypatch):
    import kernels.gpu.host_tier as host_tier

    driver = FakeDriver()
    monkeypatch.setattr(host_tier, "libcuda", lambda: driver)
    monkeypatch.setattr(host_tier, "_release", lambda ranges: None)
    memory = []

    class FakeCp:  # the two CuPy calls TieredRows.array makes
        dtype = np.dtype

        class cuda:
            UnownedMemory = staticmethod(lambda ptr, size, owner, device: memory.append((ptr, size)) or ptr)
            MemoryPointer = staticmethod(lambda mem, offset: mem + offset)

        ndarray = staticmethod(lambda shape, dtype, pointer: (shape, np.dtype(dtype), pointer))

    weights, bias = 1_572_864, 6_144  # bytes a row: Qwen's FC1 weights, its bias
    rows = host_tier.TieredRows(0, 3, 128, [weights, bias])
    assert rows.host0 == first_host_row(3, [weights, bias], GRANULE) == 342
    shape, dtype, base = rows.array(FakeCp, weights, np.uint8)
    assert shape == (342 + 128, weights) and dtype == np.uint8 and memory[0] == (base, (342 + 128) * weights)
    (device_at, device_size, _), (host_at, host_size, _) = driver.maps
    assert device_at == base and device_size == -(-3 * weights // GRANULE) * GRANULE
    assert host_at == base + 342 * weights // GRANULE * GRANULE >= base + device_size
    assert host_at + host_size >= base + (342 + 128) * weights  # every expert's row mapped
    assert [t for t, _ in driver.created] == [host_tier._LOCATION_DEVICE, host_tier._LOCATION_HOST]
    assert rows.device_bytes == device_size and rows.host_bytes == host_size
    rows.array(FakeCp, bias // 4, np.float32)
    # what the simulated device, the planner and the estimate count for these slots (host_tier.TIER_GRANULE)
    assert rows.device_bytes == host_tier.tier_device_bytes(3, [weights, bias]) == (3 + 1) * GRANULE


def test_the_slot_arrays_rows_are_one_expert_on_the_device():
    """The slot arrays GpuQMoE allocates (ProjLayout.slot_arrays): their rows add up to an expert's device bytes, the
    footprint the offload engine sizes slots by, and each array's rows are what the host tier rounds."""
    from engine.expert_node import gpu_footprint

    attrs, t, x, _ = make_case(seed=3, E=6, H=64, I=64, k=2, bits=4, block_size=32, bias=True, T=2)
    t = {k: v for k, v in t.items() if v is not None}
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    fc1, fc2 = layout.make_layouts(spec, t)
    footprint = gpu_footprint(spec, t)
    assert sum(footprint.tier_rows) == fc1.device_bytes() + fc2.device_bytes() == footprint.slot_bytes
    assert len(footprint.tier_rows) == len(fc1.slot_arrays()) + len(fc2.slot_arrays())
    assert footprint.tier_device_bytes(0) == footprint.tier_device_bytes(1) == len(footprint.tier_rows) * GRANULE
