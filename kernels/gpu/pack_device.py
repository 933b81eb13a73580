"""One expert's stored rows packed into its slot on the GPU in one kernel launch per projection (``pack_slot`` in
source/pack.cu): the fast path of ``GpuQMoE.upload_expert_device``.

``layout.pack`` on the device costs ~30 CuPy calls per projection (0.5-1 ms of host time per expert); here the host
copies each stored per-expert tensor to the device as it is (one DMA each, from page-locked memory where the rows
are) and launches ``pack_slot``, which writes every output byte of the slot arrays from the raw rows.

``plan_for`` decides, once per projection, whether the stored tensors are simple enough (no FC3, int4 / int8 rows
as stored, scales in the layout's dtype, zero points and bias as stored); ``None`` sends the expert through
``layout.pack``. ``pack_numpy`` is the kernel's index arithmetic in NumPy: the CPU tests check it against
``layout.pack``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout as _lay
from ..qmoe_spec import QMoESpec

__all__ = ["ProjPlan", "plan_for", "pack_numpy", "BIAS_DT"]

ALIGN = 256
BIAS_DT = {"float32": _lay.DT_F32, "float16": _lay.DT_F16, "bfloat16": _lay.DT_BF16}


@dataclass
class ProjPlan:
    """The stored per-expert tensors of one projection that pack_slot reads, and how it reads them."""
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
    """How pack_slot packs ``lay``'s projection straight from the stored tensors, or None (use layout.pack).
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


# ----------------------------------------------------------------------------- the kernel's index math, in NumPy
def _code(raw, idx, bits):
    """Code `idx` (flat, in codes) of packed rows `raw` (uint8): int4 low nibble = even index."""
    if bits == 8:
        return raw[idx]
    return (raw[idx >> 1] >> ((idx & 1) * 4).astype(np.uint8)) & 0x0F


def _weights(lay, plan, raw_w, row_src):
    i = np.arange(lay.w_bytes)
    if lay.bits == 4:  # byte order (tile, kt, g, t, j, p, h8); low nibble row g, high nibble row g + 8
        h8, p, j, t, g, rest = i & 1, (i >> 1) & 1, (i >> 2) & 3, (i >> 4) & 3, (i >> 6) & 7, i >> 9
        his = (0, 1)
    else:  # byte order (tile, kt, g, t, j, h8, hi, p)
        p, hi, h8, j, t, g, rest = i & 1, (i >> 1) & 1, (i >> 2) & 1, (i >> 3) & 3, (i >> 5) & 3, (i >> 7) & 7, i >> 10
        his = (hi,)
    kt, tile = rest % lay.KT, rest // lay.KT
    col = kt * 64 + j * 16 + h8 * 8 + t * 2 + p
    out = np.zeros(lay.w_bytes, np.uint8)
    for shift, h in enumerate(his):
        src = row_src[tile * 16 + h * 8 + g]
        ok = (src >= 0) & (col < lay.K)
        c = _code(raw_w, np.where(ok, src, 0) * (plan.wrow * (8 // lay.bits)) + np.where(ok, col, 0), lay.bits)
        out |= np.where(ok, c, 0).astype(np.uint8) << np.uint8(4 * shift if lay.bits == 4 else 0)
    return out


def pack_numpy(plan: ProjPlan, e: int) -> dict:
    """Expert e's slot arrays computed as pack_slot computes them, element by element (vectorised): the CPU check
    of the kernel's index arithmetic against layout.pack."""
    lay = plan.lay
    row_src = lay.row_src.astype(np.int64)
    raws = {key: np.ascontiguousarray(a[e]).reshape(-1) for key, (a, _) in plan.parts.items()}
    out = {"w": _weights(lay, plan, raws["w"].view(np.uint8), row_src)}
    q = np.arange(lay.s_len)  # order (tile, block, g, hi)
    hi, g, rest = q & 1, (q >> 1) & 7, q >> 4
    blk, tile = rest % lay.NB, rest // lay.NB
    src = row_src[tile * 16 + hi * 8 + g]
    valid, in_blk = src >= 0, blk < plan.nb
    sr = np.where(valid, src, 0)  # padding rows: source row 0 times zero, as layout.pack's mask gives them
    si = sr * plan.nb + np.where(in_blk, blk, 0)
    s = raws["s"].view(lay.sdtype)[si] * valid.astype(lay.sdtype)
    out["s"] = np.where(in_blk, s, np.zeros((), lay.sdtype))
    if lay.has_h:
        f = (out["s"].astype(np.uint32) << 16).view(np.float32) if lay.sdt == _lay.DT_BF16 else out["s"]
        out["h"] = f.astype(np.float16)
    if lay.has_zp:
        zi = sr * plan.zrow + np.where(in_blk, blk, 0)
        out["z"] = np.where(valid & in_blk, _code(raws["z"].view(np.uint8), zi, lay.bits), 0).astype(np.uint8)
    if lay.has_bias:
        r = np.arange(lay.NP)
        bias = raws["b"]
        b = (bias.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if plan.bdt == _lay.DT_BF16 else bias
        out["b"] = b[np.maximum(row_src[r], 0)].astype(np.float32) * (row_src[r] >= 0).astype(np.float32)
    return out
