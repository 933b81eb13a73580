"""Slot arrays whose rows are either GPU slots or every expert's copy in page-locked host memory, in one virtual
address range, so that every kernel addresses both the same way: ``base + slot * row_bytes``.

Why: a decode kernel reads an expert's weights once, so it can read a cold expert straight from host memory over
PCIe (benchmarks/bench_zero_copy.py on the H200: the decode kernel at 0.90 of the pinned copy's bandwidth), and a
layer whose cold experts lie there needs no host round trip. The kernels take one base pointer and a row stride per
tensor; rather than giving each of them a second base, CUDA's virtual memory management maps two kinds of memory
into one reserved range per tensor:

    rows [0, S)            device memory (the GPU slots)
    rows [S, host0)        not mapped (never addressed)
    rows [host0, host0+E)  page-locked host memory (cuMemCreate at a host location): expert e's copy in row host0 + e

Mappings start and end on the allocation granularity (cuMemGetAllocationGranularity), so ``host0`` is the first row at or past
the rounded-up device part, the same for every tensor of a node (their row sizes differ): the expert -> slot map
then holds one index per expert for all of them. Host memory the rows do not need is less than a granule a tensor.
Driver calls through ctypes (libcuda, as kernels.gpu.launch_pdl loads it). Needs CUDA 12.2+ (host
allocations); ``HostTierError`` says what failed otherwise.
"""
from __future__ import annotations

import ctypes
import weakref

from .launch_pdl import CUDA_SUCCESS, libcuda

# cuda.h enums
_ALLOCATION_PINNED = 1
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_LOCATION_HOST_NUMA = 3
_ATTR_HOST_NUMA_ID = 134
_ATTR_HOST_NUMA_VMM = 141
_ATTR_HOST_VMM = 145
_ACCESS_READWRITE = 3
_GRANULARITY_MINIMUM = 0

# The mapping granule where no driver is asked (the simulated device, the planner's tier check, the budget estimate).
# Why it matters: TieredRows rounds each slot array's device rows up to the granule the driver reports (the larger of
# the device's and the host's), so a tier reserves up to a granule a slot array more than slots x expert bytes, and a
# granule an array even without slots: hundreds of MiB over a 48-layer model. 2 MiB is the device granule CUDA
# documents for current NVIDIA GPUs (not queried here: a driver reporting more makes a card reserve more).
TIER_GRANULE = 2 << 20


class HostTierError(RuntimeError):
    """A driver call of the host tier failed, or the driver has none (the message names the call)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp (32 bytes)."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _driver():
    lib = libcuda()
    if lib is None:
        raise HostTierError("no CUDA driver (libcuda.so.1)")
    return lib


def _call(lib, name: str, *args) -> None:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise HostTierError(f"this CUDA driver has no {name}") from None
    status = fn(*args)
    if status != CUDA_SUCCESS:
        raise HostTierError(f"{name} failed: CUresult {status}")


def _prop(location_type: int, location_id: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.location.type, prop.location.id = location_type, location_id
    return prop


def _granularity(lib, prop: _AllocationProp) -> int:
    g = ctypes.c_size_t()
    _call(lib, "cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), _GRANULARITY_MINIMUM)
    return int(g.value)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def tier_device_bytes(slots: int, row_bytes: list[int], granule: int = TIER_GRANULE) -> int:
    """Device memory the host tier maps for `slots` GPU slots of tensors with rows of `row_bytes`: each tensor's
    device rows rounded up to the granule. A tier has at least one slot (CudaSlots makes its GpuQMoE with
    max(1, slots)), so even a node with none maps a granule a tensor."""
    return sum(_round_up(max(1, slots) * r, granule) for r in row_bytes)


def first_host_row(slots: int, row_bytes: list[int], granule: int) -> int:
    """The first row of the host part, the same for every tensor: at or past each tensor's device rows rounded up to
    the mapping granule (the host mapping starts on a granule at or before that row, past the device mapping)."""
    return max([slots] + [-(-_round_up(slots * r, granule) // r) for r in row_bytes])


def _attribute(lib, attribute: int, device: int) -> int:
    value = ctypes.c_int(-1)
    if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, int(device)) != CUDA_SUCCESS:
        return -1
    return int(value.value)


def host_location(device: int) -> tuple[int, int]:
    """(CUmemLocationType, id) of page-locked host memory that cuMemCreate makes for this device: plain host memory
    where the driver maps it (CUDA 12.8+), else the host NUMA node nearest the device (12.2+)."""
    lib = _driver()
    if _attribute(lib, _ATTR_HOST_VMM, device) == 1:
        return _LOCATION_HOST, 0
    if _attribute(lib, _ATTR_HOST_NUMA_VMM, device) == 1:
        return _LOCATION_HOST_NUMA, max(0, _attribute(lib, _ATTR_HOST_NUMA_ID, device))
    raise HostTierError("this CUDA driver cannot map host memory with cuMemCreate (needs CUDA 12.2+)")


class TieredRows:
    """The address ranges of one node's slot tensors (``array`` for each). Owns the mappings; they are released when
    this object is collected (after every array made over them is gone: those arrays keep it alive)."""

    def __init__(self, device: int, slots: int, experts: int, row_bytes: list[int]):
        self.device, self.slots, self.experts = int(device), int(slots), int(experts)
        lib = _driver()
        self._dev_prop = _prop(_LOCATION_DEVICE, self.device)
        self._host_prop = _prop(*host_location(self.device))
        self.granule = max(_granularity(lib, self._dev_prop), _granularity(lib, self._host_prop))
        self.host0 = first_host_row(self.slots, row_bytes, self.granule)
        self.device_bytes = self.host_bytes = 0  # mapped so far (array), granule-rounded
        self._ranges: list = []  # (base, size, [(offset, size, handle)]) per tensor, for release
        weakref.finalize(self, _release, self._ranges)

    def array(self, cp, row_elems: int, dtype):
        """A CuPy array [host0 + experts, row_elems] over a new range: device rows [0, slots), host rows [host0,
        host0 + experts). The device rows are not zeroed."""
        rows = self.host0 + self.experts
        nbytes = rows * row_elems * cp.dtype(dtype).itemsize
        mem = cp.cuda.UnownedMemory(self._map_range(row_elems * cp.dtype(dtype).itemsize), nbytes, self, self.device)
        return cp.ndarray((rows, row_elems), dtype, cp.cuda.MemoryPointer(mem, 0))

    def _map_range(self, row_bytes: int) -> int:
        """The base address of a new range of rows of `row_bytes`, its device and host parts mapped."""
        lib = _driver()
        g = self.granule
        size = _round_up((self.host0 + self.experts) * row_bytes, g)
        base = ctypes.c_uint64()
        _call(lib, "cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(size), ctypes.c_size_t(g),
              ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        parts: list = []
        self._ranges.append((base.value, size, parts))
        dev_size = tier_device_bytes(self.slots, [row_bytes], g)
        host_off = (self.host0 * row_bytes) // g * g
        for prop, offset, length in ((self._dev_prop, 0, dev_size), (self._host_prop, host_off, size - host_off)):
            if length <= 0:
                continue
            handle = ctypes.c_ulonglong()
            _call(lib, "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(length), ctypes.byref(prop),
                  ctypes.c_ulonglong(0))
            parts.append([None, length, handle.value])  # mapped below: unmapped parts are only released
            if prop is self._dev_prop:
                self.device_bytes += length
            else:
                self.host_bytes += length
            _call(lib, "cuMemMap", ctypes.c_uint64(base.value + offset), ctypes.c_size_t(length), ctypes.c_size_t(0),
                  ctypes.c_ulonglong(handle.value), ctypes.c_ulonglong(0))
            parts[-1][0] = offset
            access = _AccessDesc()
            access.location.type, access.location.id = _LOCATION_DEVICE, self.device
            access.flags = _ACCESS_READWRITE
            _call(lib, "cuMemSetAccess", ctypes.c_uint64(base.value + offset), ctypes.c_size_t(length),
                  ctypes.byref(access), ctypes.c_size_t(1))
        return base.value


def _release(ranges: list) -> None:
    """Unmap and free every range (weakref.finalize: no reference to the TieredRows itself)."""
    lib = libcuda()
    if lib is None:
        return
    for base, size, parts in ranges:
        for offset, length, handle in parts:
            if offset is not None:
                lib.cuMemUnmap(ctypes.c_uint64(base + offset), ctypes.c_size_t(length))
            lib.cuMemRelease(ctypes.c_ulonglong(handle))
        lib.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(size))
