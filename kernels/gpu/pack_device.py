"""One expert's stored rows packed into its slot on the GPU in one kernel launch (``pack_expert`` in source/pack.cu):
the fast path of ``GpuQMoE.upload_expert_device``.

``layout.pack`` on the device costs ~30 CuPy calls per projection; here the host copies each stored per-expert tensor
to one staging buffer as it is (one DMA each, from page-locked memory where the rows are) and launches
``pack_expert`` once for both projections, with a descriptor per projection made once (``descriptor``): the launch
writes every output byte of the slot arrays from the raw rows, and points the expert -> slot map at the slot.

``plan_for`` decides, once per projection, whether the stored tensors are simple enough (no FC3, int4 / int8 rows
as stored, scales in the layout's dtype, zero points and bias as stored); ``None`` sends the expert through
``layout.pack``. ``DriverPackIssuer`` issues the copies (one batched memcpy where the driver has it) and the launch
straight through the driver, its staging buffer, memcpy batch and launch arguments made once. ``stage_numpy`` is
what the host's copies put in the staging buffer and ``pack_numpy`` the kernel's index arithmetic in NumPy, reading
the descriptor's fields as the kernel does: the CPU tests check the two together against ``layout.pack``.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import layout as _lay
from ..qmoe_spec import QMoESpec

__all__ = ["ProjPlan", "plan_for", "descriptor", "DriverPackIssuer", "stage_numpy", "pack_numpy", "BIAS_DT",
           "DESC_FIELDS"]

ALIGN = 256
BIAS_DT = {"float32": _lay.DT_F32, "float16": _lay.DT_F16, "bfloat16": _lay.DT_BF16}
SLOT_KEYS = ("w", "s", "h", "z", "b")
# pack_expert's descriptor, int64 per field, one row per projection: source/pack.cu's PK_* enum, in its order (nbs:
# the stored scale blocks per row, NB the layout's; src_*: staging offsets, -1 absent; dst_* / str_*: slot arrays)
DESC_FIELDS = ("bits", "K", "KT", "wrow", "NB", "nbs", "ssz", "sdt", "zrow", "has_zp", "has_h", "bdt", "NP",
               "w_bytes", "s_len", "items", "row_src",
               *(f"src_{key}" for key in ("w", "s", "z", "b")),
               *(f"dst_{key}" for key in SLOT_KEYS), *(f"str_{key}" for key in SLOT_KEYS))
F = {name: i for i, name in enumerate(DESC_FIELDS)}


@dataclass
class ProjPlan:
    """The stored per-expert tensors of one projection that pack_expert reads, and how it reads them."""
    lay: _lay.ProjLayout
    parts: dict  # "w", "s", ["z"], ["b"] -> (host array [E, ...], byte offset of an expert's rows in the staging)
    wrow: int  # bytes per stored weight row
    nb: int  # stored scale blocks per row
    zrow: int  # zero-point codes per stored row (1: one per row, packed along the rows)
    bdt: int  # bias dtype code (-1: no bias)
    nbytes: int  # staging bytes of one expert (each part aligned)


def _plain(a, itemsize=None) -> bool:
    """A C-contiguous NumPy array (no converting wrapper: kernels.gpu.convert) whose rows can be copied as they are."""
    return isinstance(a, np.ndarray) and a.flags.c_contiguous and (itemsize is None or a.dtype.itemsize == itemsize)


def plan_for(spec: QMoESpec, tensors: dict, lay: _lay.ProjLayout, offset: int = 0) -> ProjPlan | None:
    """How pack_expert packs ``lay``'s projection straight from the stored tensors, or None (use layout.pack).
    ``offset``: where this projection's parts start in the expert's staging buffer."""
    if spec.has_fc3 or lay.bits not in (4, 8):
        return None
    name, n, per = lay.name, lay.n_src, 8 // lay.bits
    bs = lay.block_size
    nb = lay.K // bs if bs else 1
    w, s = tensors.get(f"{name}_experts_weights"), tensors.get(f"{name}_scales")
    z, b = tensors.get(f"{name}_zero_points"), tensors.get(f"{name}_experts_bias")
    if not (_plain(w, 1) and w.ndim == 3 and w.shape[1] == n and w.shape[2] * per >= lay.K):
        return None
    if not (_plain(s) and s[0].size == n * nb and
            (s.dtype == lay.sdtype or lay.sdtype == np.uint16 and s.dtype.itemsize == 2)):
        return None
    zrow = 0
    if lay.has_zp:
        if not _plain(z, 1):
            return None
        if bs and z.ndim == 3 and z.shape[1] == n and z.shape[2] * per >= nb:
            zrow = z.shape[2] * per
        elif not bs and z.ndim == 2 and z.shape[1] * per >= n:
            zrow = 1
        else:
            return None
    bdt = -1
    if lay.has_bias:
        if not (_plain(b) and b.dtype.name in BIAS_DT and b[0].size == n):
            return None
        bdt = BIAS_DT[b.dtype.name]
    parts, off = {}, offset
    for key, a in (("w", w), ("s", s), ("z", z if lay.has_zp else None), ("b", b if lay.has_bias else None)):
        if a is not None:
            parts[key] = (a, off)
            off += _lay.round_up(a[0].nbytes, ALIGN)
    return ProjPlan(lay=lay, parts=parts, wrow=w.shape[2], nb=nb, zrow=zrow, bdt=bdt, nbytes=off - offset)


def descriptor(plans, row_src: dict, slot_arrays: dict) -> np.ndarray:
    """pack_expert's descriptor [len(plans), len(DESC_FIELDS)] int64: per projection its layout's figures, the device
    address of its row sources (`row_src`: name -> address), the staging offsets of its stored tensors and, from
    `slot_arrays` (name -> key -> (address at slot 0, bytes per slot)), where its slot arrays are."""
    desc = np.zeros((len(plans), len(DESC_FIELDS)), np.int64)
    for row, plan in zip(desc, plans):
        lay = plan.lay
        unknown = set(slot_arrays[lay.name]) - set(SLOT_KEYS)
        if unknown:  # a slot array pack_expert would leave unwritten
            raise ValueError(f"{lay.name}: pack_expert writes no slot array {sorted(unknown)}")
        values = dict(bits=lay.bits, K=lay.K, KT=lay.KT, wrow=plan.wrow, NB=lay.NB, nbs=plan.nb,
                      ssz=lay.sdtype.itemsize, sdt=lay.sdt, zrow=plan.zrow, has_zp=int(lay.has_zp),
                      has_h=int(lay.has_h), bdt=plan.bdt, NP=lay.NP, w_bytes=lay.w_bytes, s_len=lay.s_len,
                      items=lay.w_bytes + lay.s_len + (lay.NP if lay.has_bias else 0), row_src=row_src[lay.name])
        for key in ("w", "s", "z", "b"):
            values[f"src_{key}"] = plan.parts[key][1] if key in plan.parts else -1
        for key in SLOT_KEYS:
            address, stride = slot_arrays[lay.name].get(key, (0, 0))
            values[f"dst_{key}"], values[f"str_{key}"] = address, stride
        for name, value in values.items():
            row[F[name]] = value
    return desc


class DriverPackIssuer:
    """Issues expert copies into slots on one stream straight through the driver (kernels.gpu.driver_calls): each
    stored tensor's rows copied to a staging buffer kept for this stream, in one cuMemcpyBatchAsync (``batch``) or
    one cuMemcpyHtoDAsync each, then pack_expert launched with its arguments prepared once; per copy only the sources
    and (slot, e, old) are rewritten. The buffer can be reused at once: the next copy's memcpys are ordered on the
    stream after the previous pack_expert that read it."""

    # pack_expert(desc, staged, slot, slot_map, e, old, host0): source/pack.cu
    SLOT, EXPERT, OLD = 2, 4, 5

    def __init__(self, calls, function_ptr: int, grid: int, desc_ptr: int, staging_ptr: int, slot_map_ptr: int,
                 stream_ptr: int, host0: int = -1):
        self._calls, self._memcpy = calls, calls.memcpy_htod_async
        self._staging, self._stream = int(staging_ptr), int(stream_ptr)
        self.launch = calls.prepare(function_ptr, (grid,), (256,), (
            ctypes.c_void_p(desc_ptr), ctypes.c_void_p(staging_ptr), np.int32(0), ctypes.c_void_p(slot_map_ptr),
            np.int32(-1), np.int32(-1), np.int32(host0)), 0, stream_ptr)
        self._slot, self._e, self._old = (self.launch.argument(i) for i in (self.SLOT, self.EXPERT, self.OLD))
        self.batch = None  # the prepared batch memcpy of `_batch_copies`' destinations and sizes (None: none yet)
        self._batch_copies = self._batch_layout = None

    def issue(self, copies, e: int, slot: int, old: int, batch: bool = False) -> bool:
        """Expert e into `slot` (whose expert `old`, -1 none, leaves the device's map). `copies`: per stored tensor
        (its staging offset, its host address at expert 0, bytes per expert): GpuQMoE._host_copies. `batch`: the
        copies in one driver call (not on the legacy NULL stream, where they go one by one). True when they were
        batched; a BatchCopyError of the batch call (or of a driver without one) is raised before the launch."""
        prepared = None
        if batch and self._stream:
            prepared = self.batch if copies is self._batch_copies else self._prepare_batch(copies)
        if prepared is None:
            memcpy, staging, stream = self._memcpy, self._staging, self._stream
            for offset, address, row_bytes in copies:
                memcpy(staging + offset, address + e * row_bytes, row_bytes, stream)
        else:
            sources = prepared.sources
            for i, (_, address, row_bytes) in enumerate(copies):
                sources[i] = address + e * row_bytes
            prepared.copy()
        self._slot.value, self._e.value, self._old.value = slot, e, old
        self.launch.launch()
        return prepared is not None

    def _prepare_batch(self, copies):
        """The batch for `copies` (another node's, set_source): made again only where its offsets or sizes differ."""
        layout = [(offset, row_bytes) for offset, _, row_bytes in copies]
        if layout != self._batch_layout:
            self.batch = self._calls.prepare_batch([self._staging + offset for offset, _ in layout],
                                                   [row_bytes for _, row_bytes in layout], self._stream)
            self._batch_layout = layout
        self._batch_copies = copies
        return self.batch


def stage_numpy(plans, e: int) -> np.ndarray:
    """The staging buffer as the host's copies leave it for expert e: each stored tensor's rows at its offset."""
    staged = np.zeros(sum(plan.nbytes for plan in plans), np.uint8)
    for plan in plans:
        for a, off in plan.parts.values():
            row = np.ascontiguousarray(a[e]).reshape(-1).view(np.uint8)
            staged[off:off + row.size] = row
    return staged


# ----------------------------------------------------------------------------- the kernel's index math, in NumPy
def _code(raw, idx, bits):
    """Code `idx` (flat, in codes) of packed rows `raw` (uint8): int4 low nibble = even index."""
    if bits == 8:
        return raw[idx]
    return (raw[idx >> 1] >> ((idx & 1) * 4).astype(np.uint8)) & 0x0F


def _weights(d, w_raw, row_src):
    i = np.arange(d[F["w_bytes"]])
    bits, KT, K, wrow = (int(d[F[name]]) for name in ("bits", "KT", "K", "wrow"))
    if bits == 4:  # byte order (tile, kt, g, t, j, p, h8); low nibble row g, high nibble row g + 8
        h8, p, j, t, g, rest = i & 1, (i >> 1) & 1, (i >> 2) & 3, (i >> 4) & 3, (i >> 6) & 7, i >> 9
        his = (0, 1)
    else:  # byte order (tile, kt, g, t, j, h8, hi, p)
        p, hi, h8, j, t, g, rest = i & 1, (i >> 1) & 1, (i >> 2) & 1, (i >> 3) & 3, (i >> 5) & 3, (i >> 7) & 7, i >> 10
        his = (hi,)
    kt, tile = rest % KT, rest // KT
    col = kt * 64 + j * 16 + h8 * 8 + t * 2 + p
    out = np.zeros(i.size, np.uint8)
    for shift, h in enumerate(his):
        src = row_src[tile * 16 + h * 8 + g]
        ok = (src >= 0) & (col < K)
        c = _code(w_raw, np.where(ok, src, 0) * (wrow * (8 // bits)) + np.where(ok, col, 0), bits)
        out |= np.where(ok, c, 0).astype(np.uint8) << np.uint8(4 * shift if bits == 4 else 0)
    return out


def pack_numpy(d: np.ndarray, staged: np.ndarray, lay: _lay.ProjLayout) -> dict:
    """One projection's slot arrays as pack_expert computes them from descriptor row `d` and the staging buffer,
    element by element (vectorised): the CPU check of the descriptor and the kernel's index arithmetic against
    layout.pack. `lay` gives the row sources (the descriptor holds their device address) and the scale dtype."""
    def tensor(key, dtype=np.uint8):  # the staging buffer from a stored tensor's offset on, as `dtype`
        raw = staged[int(d[F[f"src_{key}"]]):]
        return raw[:raw.size - raw.size % np.dtype(dtype).itemsize].view(dtype)

    row_src = lay.row_src.astype(np.int64)
    out = {"w": _weights(d, tensor("w"), row_src)}
    NB, nb, zrow, bits = (int(d[F[name]]) for name in ("NB", "nbs", "zrow", "bits"))
    sdtype = {4: np.float32, 2: np.uint16}[int(d[F["ssz"]])] if int(d[F["sdt"]]) != _lay.DT_F16 else np.float16
    q = np.arange(d[F["s_len"]])  # order (tile, block, g, hi)
    hi, g, rest = q & 1, (q >> 1) & 7, q >> 4
    blk, tile = rest % NB, rest // NB
    src = row_src[tile * 16 + hi * 8 + g]
    valid, in_blk = src >= 0, blk < nb
    sr = np.where(valid, src, 0)  # padding rows: source row 0 times zero, as layout.pack's mask gives them
    si = sr * nb + np.where(in_blk, blk, 0)
    s = tensor("s", sdtype)[si] * valid.astype(sdtype)
    out["s"] = np.where(in_blk, s, np.zeros((), sdtype))
    if d[F["has_h"]]:
        f = (out["s"].astype(np.uint32) << 16).view(np.float32) if int(d[F["sdt"]]) == _lay.DT_BF16 else out["s"]
        out["h"] = f.astype(np.float16)
    if d[F["has_zp"]]:
        zi = sr * zrow + np.where(in_blk, blk, 0)
        out["z"] = np.where(valid & in_blk, _code(tensor("z"), zi, bits), 0).astype(np.uint8)
    if int(d[F["items"]]) > int(d[F["w_bytes"]] + d[F["s_len"]]):  # the bias rows
        r = np.arange(d[F["NP"]])
        bdt = int(d[F["bdt"]])
        if bdt == _lay.DT_BF16:
            bias = (tensor("b", np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            bias = tensor("b", np.float32 if bdt == _lay.DT_F32 else np.float16)
        out["b"] = bias[np.maximum(row_src[r], 0)].astype(np.float32) * (row_src[r] >= 0).astype(np.float32)
    return out
