"""The GPU kernels' weight layout, and the conversion of raw QMoE expert tensors into it.

Written against an array module ``xp`` (NumPy or CuPy): the same code converts on the host (one expert at a time, for
the offload engine's pinned staging copies) or on the device (the initial upload of many experts).

Per projection ("fc1" = FC1, merged with FC3 when present; "fc2"), per expert slot:

* ``w``  uint8 ``[NT * KT * TB]``: tiles of 16 weight rows x 64 k (``TB`` = 512 bytes int4, 1024 int8), row tile
  major then k tile. Inside a tile, lane ``l = 4 g + t`` of a warp owns 16 (int4) or 32 (int8) consecutive bytes:
  the m16n8k16 A fragment values of rows ``g`` and ``g + 8`` at ``k = 16 j + 2 t + {0, 1}`` and ``+ 8`` for the four
  k-steps ``j``. int4: one 32-bit word per k-step, nibble ``n = 4 p + 2 h8 + hi`` (``p``: k parity, ``h8``: the +8
  half, ``hi``: row g + 8), so that ``(w & 0x000F000F)`` yields the pair (row g, k 2t / 2t+1) and so on; int8: two
  words per k-step, byte ``b = 4 h8 + 2 hi + p``. One coalesced 16-byte load per lane per tile (int4).
* ``s``  scales ``[NT * NB * 16]`` in their stored dtype (fp32, fp16, or bf16 as uint16): ``[row tile][block][g][hi]``
  so that a lane reads the scales of its two rows with one 8-byte (fp32) load.
* ``z``  zero points uint8, same order as ``s`` (unpacked), when the node has them.
* ``b``  bias float32 ``[NP]`` (merged row order), when the node has one.
* ``h``  fp16 copy of ``s`` for block scales stored as fp32 / bf16 (the prefill kernel folds block scales into its
  fp16 weight fragments; decode always uses ``s``). Not counted in ``slot_bytes`` (decode never reads it).

Gated FC1 (swiglu with any fusion, or FC3 gating): the rows are re-ordered so that each 16-row tile holds gate rows
``8q .. 8q+7`` (tile rows 0-7) and the matching up rows (tile rows 8-15); one thread then holds gate and up of the
same output, and the activation is applied in the GEMM epilogue. Rows are padded to 16 (8 outputs for gated),
k to 64 with zero codes, zero scales and zero biases.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..qmoe_spec import QMoESpec, UnsupportedLayout

__all__ = ["ProjLayout", "check_supported", "make_layouts", "raw_sources", "pack", "round_up", "scale_kind",
           "TILE_BYTES"]

TILE_BYTES = {4: 512, 8: 1024}
DT_F32, DT_F16, DT_BF16 = 0, 1, 2


def round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def scale_kind(dtype) -> tuple[np.dtype, int]:
    """(device dtype, kernel code) for a scale / activation dtype: fp32, fp16, or bf16 (ml_dtypes) / uint16."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return np.dtype(np.float16), DT_F16
    if dt.name == "bfloat16" or dt == np.uint16:
        return np.dtype(np.uint16), DT_BF16
    return np.dtype(np.float32), DT_F32


@dataclass
class ProjLayout:
    name: str  # "fc1" or "fc2"
    bits: int
    K: int  # input features
    KP: int  # padded to 64
    KT: int
    n_src: int  # rows of the (merged) source
    NP: int  # padded rows
    NT: int  # 16-row tiles
    n_out: int  # outputs of the projection (I for fc1, H for fc2)
    gated: bool
    block_size: int
    NB: int  # scale blocks per row in the layout (padded)
    bs_log2: int  # -1 = one scale per row
    row_src: np.ndarray  # [NP] source row of each layout row, -1 = padding
    sdt: int  # scale dtype code
    sdtype: np.dtype
    has_zp: bool
    has_bias: bool
    has_h: bool = False  # an fp16 copy of block scales (prefill folds them into fp16 weights)

    @property
    def w_bytes(self) -> int:
        return self.NT * self.KT * TILE_BYTES[self.bits]

    @property
    def s_len(self) -> int:
        return self.NT * self.NB * 16

    def slot_bytes(self) -> int:
        """Bytes one expert occupies in this projection's slot arrays (weights, scales, zero points, bias)."""
        n = self.w_bytes + self.s_len * self.sdtype.itemsize
        if self.has_zp:
            n += self.s_len
        if self.has_bias:
            n += self.NP * 4
        return n

    def device_bytes(self) -> int:
        """``slot_bytes`` plus the fp16 copy of block scales (``h``): what one expert occupies on the device."""
        return self.slot_bytes() + (self.s_len * 2 if self.has_h else 0)

    def slot_arrays(self) -> dict:
        """This projection's slot arrays (GpuQMoE allocates one per key): {key: (elements a slot, dtype)}. Their rows
        add up to ``device_bytes``; the host tier maps each array on its own (host_tier.tier_device_bytes)."""
        arrays = {"w": (self.w_bytes, np.dtype(np.uint8)), "s": (self.s_len, self.sdtype)}
        if self.has_zp:
            arrays["z"] = (self.s_len, np.dtype(np.uint8))
        if self.has_bias:
            arrays["b"] = (self.NP, np.dtype(np.float32))
        if self.has_h:
            arrays["h"] = (self.s_len, np.dtype(np.float16))
        return arrays

    def row_bytes(self) -> list[int]:
        """Bytes of one row (one expert) of each of slot_arrays."""
        return [n * dtype.itemsize for n, dtype in self.slot_arrays().values()]


def _gated(spec: QMoESpec) -> bool:
    return spec.activation == "swiglu" or spec.has_fc3


def check_activation(spec: QMoESpec) -> None:
    """Raise UnsupportedLayout unless the kernels implement the node's activation: relu, gelu (tanh), silu,
    identity, swiglu (fusion 0 / 1 / 2, limit before the activation), FC3 gating. Needs no CuPy."""
    if spec.activation in ("geglu", "relu2") or spec.swiglu_limit_after_activation:
        act = spec.activation + (" with the limit after the activation" if spec.swiglu_limit_after_activation else "")
        raise UnsupportedLayout(f"node '{spec.node_name}': the GPU kernels implement relu, gelu, silu, identity and "
                                f"swiglu; this node ({spec.layout_summary()}, {act}) runs on the CPU")


def check_supported(spec: QMoESpec) -> None:
    """Raise UnsupportedLayout unless the kernels read ``spec``'s layout and activation as stored: a quantised node,
    raw int4 / int8 rows of one width for every projection, an activation of ``check_activation``. Needs no CuPy.
    GpuQMoE first converts other layouts (``kernels.gpu.convert.for_gpu``) and checks the converted spec."""
    if not spec.is_quantized:
        raise UnsupportedLayout(f"node '{spec.node_name}': the GPU kernels run quantised QMoE nodes only "
                                "(the float MoE op runs on the CPU)")
    check_activation(spec)
    # QMoESpec admits more layouts than these kernels read (kernels/cpu/generic.py runs them; kernels/gpu/convert.py
    # converts them for GpuQMoE): refuse, by name, anything but raw int4 / int8 rows, never misread the bytes
    if not spec.is_fast_int_layout:
        raise UnsupportedLayout(f"node '{spec.node_name}': the GPU kernels read raw int4 / int8 rows; this node's "
                                f"{spec.layout_summary()} must be converted first (kernels.gpu.convert.for_gpu)")
    bits = spec.fc1_bits
    if bits not in (4, 8) or spec.fc2_bits != bits or (spec.has_fc3 and (spec.fc3_bits or bits) != bits):
        raise UnsupportedLayout(f"node '{spec.node_name}': GPU kernels need int4 or int8 for every projection "
                                f"({spec.layout_summary()}; kernels.gpu.convert.for_gpu widens it)")


def make_layouts(spec: QMoESpec, tensors: dict) -> tuple[ProjLayout, ProjLayout]:
    check_supported(spec)
    bits = spec.fc1_bits
    H, I = spec.hidden_size, spec.inter_size
    bs = spec.block_size
    gated = _gated(spec)
    out = []
    for name, K, n_out in (("fc1", H, I), ("fc2", I, H)):
        KP = round_up(K, 64)
        if name == "fc1" and gated:
            IP = round_up(I, 8)
            NP = 2 * IP
            q = np.arange(IP // 8)[:, None]
            h = np.arange(8)[None, :]
            out_idx = q * 8 + h  # [IP/8, 8]
            if spec.activation == "swiglu" and spec.swiglu_fusion == 1:
                gate, up = 2 * out_idx, 2 * out_idx + 1
            else:  # fusion 2, or FC1 / FC3 concatenated [gate | up]
                gate, up = out_idx, I + out_idx
            valid = out_idx < I
            rows = np.concatenate([np.where(valid, gate, -1), np.where(valid, up, -1)], axis=1).reshape(-1)
            n_src = 2 * I
        else:
            n_rows = spec.fc1_rows if name == "fc1" else H
            NP = round_up(n_rows, 16)
            rows = np.where(np.arange(NP) < n_rows, np.arange(NP), -1)
            n_src = n_rows
        if bs:
            if bs < 64:
                NB = KP // bs
            else:
                if K % bs:
                    raise UnsupportedLayout(f"node '{spec.node_name}': K={K} is not a multiple of block_size {bs}")
                NB = K // bs
            bs_log2 = int(bs).bit_length() - 1
        else:
            NB, bs_log2 = 1, -1
        sdtype, sdt = scale_kind(tensors[f"{name}_scales"].dtype)
        has_zp = tensors.get(f"{name}_zero_points") is not None or (
            name == "fc1" and spec.has_fc3 and tensors.get("fc3_zero_points") is not None)
        has_bias = tensors.get(f"{name}_experts_bias") is not None or (
            name == "fc1" and spec.has_fc3 and tensors.get("fc3_experts_bias") is not None)
        out.append(ProjLayout(name=name, bits=bits, K=K, KP=KP, KT=KP // 64, n_src=n_src, NP=NP, NT=NP // 16,
                              n_out=n_out, gated=(name == "fc1" and gated), block_size=bs, NB=NB, bs_log2=bs_log2,
                              row_src=rows.astype(np.int64), sdt=sdt, sdtype=sdtype, has_zp=has_zp,
                              has_bias=has_bias, has_h=bool(bs) and sdt != DT_F16))
    return out[0], out[1]


# ----------------------------------------------------------------------------- raw sources
def _unpack(xp, packed, bits: int):
    """uint8 [..., B] -> codes uint8 [..., B * 8 / bits] (LSB first; int4: low nibble = even index)."""
    if bits == 8:
        return packed
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _take(arr, experts):
    """arr[experts] of a NumPy array / memmap: a host copy of just those experts."""
    return np.asarray(arr[experts])


def _to_xp(xp, a):
    """Host array `a` as an `xp` array. To the GPU in one copy straight from `a` on the current stream (a DMA
    from pinned memory: a prefill wave's rows in the staging ring), not through cupy.asarray's extra copy into
    CuPy's own pinned buffer. A pageable `a` may be freed once this returns: the driver has staged it by then."""
    if xp is np or isinstance(a, xp.ndarray):
        return xp.asarray(a)
    a = np.ascontiguousarray(a)
    device = xp.empty(a.shape, a.dtype)
    device.set(a, stream=xp.cuda.get_current_stream())
    return device


def _rows_to_xp(xp, arr, experts):
    """arr[experts] as an `xp` array. To the GPU from a plain host array without gathering the rows on the host
    first: one copy of a run of consecutive experts, else one per expert, straight from `arr` on the current
    stream (a DMA where `arr` is page-locked: the staging ring, a registered file mapping). Other sources (a
    converting wrapper, kernels.gpu.convert) are indexed on the host."""
    if xp is np or not isinstance(arr, np.ndarray):
        return _to_xp(xp, _take(arr, experts))
    experts = [int(e) for e in np.asarray(experts).reshape(-1)]
    first = experts[0] if experts else 0
    if experts == list(range(first, first + len(experts))):
        return _to_xp(xp, arr[first:first + len(experts)])
    device = xp.empty((len(experts),) + arr.shape[1:], arr.dtype)
    stream = xp.cuda.get_current_stream()
    for i, e in enumerate(experts):
        device[i].set(np.ascontiguousarray(arr[e]), stream=stream)
    return device


def raw_sources(spec: QMoESpec, tensors: dict, lay: ProjLayout, experts, xp=np):
    """Raw tensors of ``experts`` (index array) for one projection, in the source row order of ``lay``:
    (codes uint8 [e, n_src, K], scales [e, n_src, nb], zero points uint8 [e, n_src, nb] or None,
    bias float32 [e, n_src] or None) as ``xp`` arrays."""
    bits, K = lay.bits, lay.K
    bs = lay.block_size
    nb = K // bs if bs else 1
    projs = [lay.name] + (["fc3"] if lay.name == "fc1" and spec.has_fc3 else [])
    n_each = [spec.fc1_rows if p == "fc1" else (spec.hidden_size if p == "fc2" else spec.inter_size) for p in projs]
    codes, scales, zps, biases = [], [], [], []
    for p, n in zip(projs, n_each):
        w = _rows_to_xp(xp, tensors[f"{p}_experts_weights"], experts).astype(xp.uint8, copy=False)
        codes.append(_unpack(xp, w, bits)[..., :K])
        s = tensors[f"{p}_scales"]
        if isinstance(s, np.ndarray) and (lay.sdtype == np.uint16 and s.dtype.itemsize == 2 or s.dtype == lay.sdtype):
            s = _rows_to_xp(xp, s.view(np.uint16) if lay.sdtype == np.uint16 else s, experts)  # no host conversion
        else:
            s = np.asarray(_take(s, experts))
            s = _to_xp(xp, s.view(np.uint16) if lay.sdtype == np.uint16 else s.astype(lay.sdtype, copy=False))
        scales.append(s.reshape(s.shape[0], n, nb))
        if lay.has_zp:
            z = tensors.get(f"{p}_zero_points")
            if z is None:
                zps.append(xp.full((len(experts), n, nb), 1 << (bits - 1), dtype=xp.uint8))
            else:
                zc = _unpack(xp, _rows_to_xp(xp, z, experts).astype(xp.uint8, copy=False), bits)
                zps.append((zc[..., :nb] if bs else zc[..., :n, None]).reshape(-1, n, nb))
        if lay.has_bias:
            b = tensors.get(f"{p}_experts_bias")
            if b is None:
                biases.append(xp.zeros((len(experts), n), dtype=xp.float32))
            else:
                biases.append(xp.asarray(np.asarray(_take(b, experts), dtype=np.float32)))
    cat = (lambda parts: parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=1))
    return (cat(codes), cat(scales), cat(zps) if lay.has_zp else None, cat(biases) if lay.has_bias else None)


# ----------------------------------------------------------------------------- conversion
def pack(lay: ProjLayout, codes, scales, zps, bias, xp=np) -> dict:
    """Convert raw sources (see ``raw_sources``) of e experts into the kernel layout:
    {"w": uint8 [e, w_bytes], "s": [e, s_len], "z": uint8 [e, s_len] (if zero points), "b": f32 [e, NP] (if bias)}."""
    e = codes.shape[0]
    NP, NT, KT, KP, K, NB = lay.NP, lay.NT, lay.KT, lay.KP, lay.K, lay.NB
    valid = lay.row_src >= 0
    idx = xp.asarray(np.where(valid, lay.row_src, 0))
    mask = xp.asarray(valid.astype(np.uint8))
    c = codes[:, idx, :] * mask[None, :, None]
    if KP > K:
        c = xp.concatenate([c, xp.zeros((e, NP, KP - K), dtype=xp.uint8)], axis=2)
    c = c.reshape(e, NT, 2, 8, KT, 4, 2, 4, 2)  # e, tile, hi, g, ktile, j, h8, t, p
    if lay.bits == 4:
        c = c.transpose(0, 1, 4, 3, 7, 5, 8, 6, 2).reshape(e, NT, KT, 32, 4, 8)  # nibble n = 4p + 2h8 + hi
        w = c[..., 0::2] | (c[..., 1::2] << 4)
    else:
        w = c.transpose(0, 1, 4, 3, 7, 5, 6, 2, 8)  # byte b = 4h8 + 2hi + p
    out = {"w": xp.ascontiguousarray(w).reshape(e, -1)}

    def relay(a, fill_dtype):
        # [e, n_src, nb] -> [e, NT * NB * 16] in [tile][block][g][hi] order (padding rows / blocks = 0)
        a = a[:, idx, :] * mask.astype(a.dtype)[None, :, None]
        nb = a.shape[2]
        if nb < NB:
            a = xp.concatenate([a, xp.zeros((e, NP, NB - nb), dtype=fill_dtype)], axis=2)
        a = a.reshape(e, NT, 2, 8, NB).transpose(0, 1, 4, 3, 2)
        return xp.ascontiguousarray(a).reshape(e, -1)

    out["s"] = relay(scales, scales.dtype)
    if lay.has_h:
        s = out["s"]
        f = (s.astype(xp.uint32) << 16).view(xp.float32) if lay.sdt == DT_BF16 else s
        out["h"] = xp.ascontiguousarray(f.astype(xp.float16))
    if lay.has_zp:
        out["z"] = relay(zps, xp.uint8)
    if lay.has_bias:
        b = bias[:, idx] * mask.astype(xp.float32)[None, :]
        out["b"] = xp.ascontiguousarray(b.astype(xp.float32))
    return out
