"""Exact host-side conversion of the QMoE layouts the GPU kernels do not read into ones they do (issue #3).

The GPU kernels (``kernels.gpu.layout``) read raw int4 or int8 rows, one width for the whole node, float scales
per row or per K block (>= 16), optional zero points. ``for_gpu(spec, tensors)`` returns a ``GpuConversion``:
a QMoESpec of such a layout and a tensor dict whose converted entries are ``ExpertArray`` objects that convert
an expert when it is indexed (``arr[e]`` / ``arr[index array]``), one expert at a time, in NumPy on the host.
``GpuQMoE`` builds its layouts from them, so the initial upload (chunks of experts) and ``pack_expert`` (the
offload engine's swaps) go through the same conversion, and no converted copy of the whole node is ever held.

Conversions (all bit-exact: the dequantised float64 weights of kernels.reference are identical, except the
nvfp4 / mxfp4 scale product noted below):

* int2 / int3 raw -> int4 raw; mixed widths -> the widest one (int4, or int8 when a projection is int8):
  code' = code + c and zero point' = zero point + c with c = 2^(t-1) - 2^(b-1) (b the stored width, t the
  target). value = (code' - zp') * scale = (code - zp) * scale; a missing zero point stays missing (the default
  2^(b-1) becomes the target default 2^(t-1)); scales and biases are passed through unchanged.
* SM80 prepacked int4 / int8 -> raw rows (kernels.layouts.sm80_unpack, then widened as above if mixed).
* nvfp4 (N- or K-packed; E2M1 codes, e4m3 block-16 scales, per-expert global scale) and mxfp4 (e8m0 block-32
  scales, global scale) -> int8 with the same K blocks: 2 * E2M1 is an integer in {0, +-1, +-2, +-3, +-4, +-6,
  +-8, +-12}, so code = 128 + 2 * e2m1 (default zero point 128) and scale = fp32(block scale * global / 2).
  The scale is exact when the product fits fp32: for nvfp4 when the global scale's significand has at most 20
  bits (e4m3 has 4; e.g. a power-of-two global), for mxfp4 always (a power of two times the global), as long as
  the product stays in fp32's normal range. Otherwise the fp32 scale is the product rounded to nearest: relative
  error <= 2^-24 per block (half an fp32 ulp; the kernels apply scales in fp32 anyway). ``GpuConversion.exact``
  says whether the E global scales guarantee exactness (decided up front, cheaply); as experts are converted,
  ``inexact_scales`` counts block scales that were rounded (this also catches products that fall below fp32's
  normal range) and a product that overflows fp32 is refused (UnsupportedLayout) for that expert.
* fp8 e4m3 weights are refused: e4m3 values of a block span up to 18 binades, which int8 codes times one
  block scale cannot hold exactly; no approximation is made (the node runs on the CPU).

Device cost: int2 -> int4 doubles the weight bytes, int3 -> int4 x 4/3, int4 -> int8 (mixed nodes) doubles the
narrower projection, fp4 -> int8 doubles the weight bytes and stores fp32 block scales (4 bytes per 16 / 32
weights instead of 1). ``gpu_expert_bytes`` gives the converted per-expert size without CuPy.
"""
from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np

from .. import layouts as L
from ..qmoe_spec import QMoESpec, UnsupportedLayout
from .layout import check_activation, make_layouts

__all__ = ["ExpertArray", "GpuConversion", "for_gpu", "gpu_expert_bytes", "gpu_native", "unpack_rows", "pack_rows",
           "FP4_CODE_TO_INT8"]

#: int8 code (zero point 128) of each E2M1 code: 128 + 2 * value (code 8 is -0 -> 128)
FP4_CODE_TO_INT8 = (128 + 2 * L.E2M1_VALUES.astype(np.float64)).astype(np.uint8)


class ExpertArray:
    """A read-only [E, ...] tensor whose experts are converted when indexed.

    ``arr[e]`` (int) returns one converted expert; ``arr[ids]`` (index array, list or slice) a new array of those
    experts, converted one at a time into it; ``np.asarray(arr)`` converts every expert (small nodes, tests).
    ``shape`` / ``dtype`` / ``ndim`` / ``nbytes`` describe the converted tensor.
    """

    def __init__(self, shape, dtype, convert, name: str = ""):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.name = name
        self._convert = convert  # expert index -> np.ndarray of shape[1:]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def _one(self, e: int) -> np.ndarray:
        out = np.asarray(self._convert(e))
        if out.shape != self.shape[1:] or out.dtype != self.dtype:
            raise AssertionError(f"{self.name}: converted expert {e} is {out.dtype}{out.shape}, "
                                 f"expected {self.dtype}{self.shape[1:]}")
        return out

    def __getitem__(self, idx):
        rest = ()
        if isinstance(idx, tuple):
            idx, rest = idx[0], idx[1:]
        E = self.shape[0]
        if isinstance(idx, (int, np.integer)):
            res = self._one(range(E)[int(idx)])
        else:
            ids = np.arange(E)[idx]
            res = np.empty((ids.size,) + self.shape[1:], self.dtype)
            for j, e in enumerate(ids.reshape(-1)):
                res[j] = self._one(int(e))
            res = res.reshape(ids.shape + self.shape[1:])
        return res[rest] if rest else res

    def __array__(self, dtype=None, copy=None):
        a = self[:]
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"ExpertArray({self.name!r}, shape={self.shape}, dtype={self.dtype})"


@dataclasses.dataclass
class GpuConversion:
    """What GpuQMoE runs: ``spec`` / ``tensors`` (converted, or the originals when ``kind`` is 'none')."""

    source_spec: QMoESpec
    spec: QMoESpec
    tensors: dict
    kind: str  # 'none', 'int-widen', 'sm80', 'fp4'
    note: str  # one line: what was converted into what
    exact: bool  # every converted value is guaranteed bit-identical (see the module doc for fp4 scales)
    inexact_scales: int = 0  # fp4 block scales rounded to fp32 so far (experts converted so far)
    max_scale_rel_err: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def converted(self) -> bool:
        return self.kind != "none"

    def _record(self, count: int, rel: float) -> None:
        if count:
            with self._lock:
                self.inexact_scales += count
                self.max_scale_rel_err = max(self.max_scale_rel_err, rel)


# ----------------------------------------------------------------------------- support
def gpu_native(spec: QMoESpec) -> bool:
    """True when the kernels read this layout as stored: quantised, raw int4 or int8, one width for all projections."""
    if not spec.is_quantized or spec.quant_type != "int" or spec.packing != "raw":
        return False
    bits = {b for _, _, _, b in spec.projections}
    return len(bits) == 1 and bits <= {4, 8}


def _fp8_refusal(spec: QMoESpec) -> str:
    return (f"node '{spec.node_name}': {spec.layout_summary()} weights are not run on the GPU: the GPU kernels read "
            "int4 / int8 codes times one scale per block, and fp8 e4m3 values in a block span many binades "
            "(3 mantissa bits, exponents 2^-9 .. 2^8), so an int8 conversion would round weights; no exact "
            "conversion exists and none is approximated (this node runs on the CPU)")


def for_gpu(spec: QMoESpec, tensors: dict) -> GpuConversion:
    """The layout GpuQMoE runs for ``spec`` / ``tensors`` (see the module doc). Converts nothing yet: experts are
    converted when their tensors are indexed. Raises UnsupportedLayout for fp8 weights."""
    if spec.is_quantized:
        check_activation(spec)  # refused by name before any conversion (the message names the stored layout)
    if not spec.is_quantized or gpu_native(spec):  # the float MoE op: kernels.gpu.layout refuses it by name
        return GpuConversion(spec, spec, tensors, "none", "stored layout read directly", True)
    if spec.quant_type == "fp8":
        raise UnsupportedLayout(_fp8_refusal(spec))
    if spec.quant_type == "int":
        return _convert_int(spec, tensors)
    if spec.quant_type in ("fp4", "nvfp4"):
        return _convert_fp4(spec, tensors)
    raise UnsupportedLayout(f"node '{spec.node_name}': quant_type '{spec.quant_type}' has no GPU layout")


def gpu_expert_bytes(spec: QMoESpec, tensors: dict, resident: bool = False) -> int:
    """Bytes of one expert in the GPU kernels' layout after conversion, without CuPy: what ``GpuQMoE.expert_bytes``
    reports (weights, scales, zero points, biases the kernels read). ``resident=True`` adds the fp16 copy of block
    scales the prefill kernel reads (allocated on the device too). Raises UnsupportedLayout like GpuQMoE."""
    conv = for_gpu(spec, tensors)
    f1, f2 = make_layouts(conv.spec, conv.tensors)
    return f1.device_bytes() + f2.device_bytes() if resident else f1.slot_bytes() + f2.slot_bytes()


# ----------------------------------------------------------------------------- int widths / SM80
def unpack_rows(packed, bits: int, count: int) -> np.ndarray:
    """uint8 [..., B] LSB-first rows of ``bits``-bit codes -> uint8 codes [..., count]: the same codes as
    ``kernels.layouts.unpack_bits`` (which returns int32 and goes through single bits for int3), with byte-wide
    shifts only. int3: groups of 8 codes = 3 bytes (a row's last partial group is read as if zero-padded)."""
    p = np.asarray(packed, dtype=np.uint8)
    lead, B = p.shape[:-1], p.shape[-1]
    if bits == 8:
        return p[..., :count]
    if bits in (2, 4):
        per = 8 // bits
        out = np.empty(lead + (B, per), np.uint8)
        mask = np.uint8((1 << bits) - 1)
        for i in range(per):
            out[..., i] = (p >> np.uint8(i * bits)) & mask
        return out.reshape(lead + (B * per,))[..., :count]
    if bits != 3:
        raise ValueError(f"unpack_rows: {bits} bits")
    groups = -(-count // 8)
    if B < 3 * groups:
        p = np.concatenate([p, np.zeros(lead + (3 * groups - B,), np.uint8)], axis=-1)
    g = p[..., :3 * groups].reshape(lead + (groups, 3)).astype(np.uint32)
    word = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    out = np.empty(lead + (groups, 8), np.uint8)
    for i in range(8):
        out[..., i] = (word >> np.uint32(3 * i)) & np.uint32(7)
    return out.reshape(lead + (groups * 8,))[..., :count]


def pack_rows(codes, bits: int) -> np.ndarray:
    """uint8 codes [..., K] (< 2^bits) -> LSB-first rows uint8 [..., ceil(K * bits / 8)] for 4 or 8 bits: the bytes
    of ``kernels.layouts.pack_bits`` (int4: low nibble = even k, an odd row's last high nibble zero)."""
    c = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(c)
    if bits != 4:
        raise ValueError(f"pack_rows: {bits} bits")
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (1,), np.uint8)], axis=-1)
    return c[..., 0::2] | (c[..., 1::2] << np.uint8(4))


def _codes_of(spec: QMoESpec, w_e, n: int, k: int, bits: int) -> np.ndarray:
    """Unsigned codes uint8 [N, K] of one expert's stored weights (raw rows or SM80 prepacked)."""
    w = np.asarray(w_e, dtype=np.uint8)
    if spec.packing == "sm80":  # the code stream in order, then kernels.layouts' (cached) position of each code
        return unpack_rows(w.reshape(-1), bits, n * k)[L.sm80_positions(n, k, bits)]
    return unpack_rows(w.reshape(n, -1), bits, k)


def _convert_int(spec: QMoESpec, tensors: dict) -> GpuConversion:
    widths = {p: b for p, _, _, b in spec.projections}
    target = 8 if 8 in widths.values() else 4
    E, bs = spec.num_experts, spec.block_size
    out = dict(tensors)
    for proj, n, k, b in spec.projections:
        c = (1 << (target - 1)) - (1 << (b - 1))
        wname = f"{proj}_experts_weights"
        if spec.packing != "raw" or b != target:
            src = tensors[wname]

            def conv_w(e, src=src, n=n, k=k, b=b, c=c):
                q = _codes_of(spec, src[e], n, k, b)
                return pack_rows(q + np.uint8(c) if c else q, target)  # < 2^(t-1) + 2^(b-1) <= 2^t: no overflow

            out[wname] = ExpertArray((E, n, L.row_bytes(k, target)), np.uint8, conv_w, wname)
        zname = f"{proj}_zero_points"
        z = tensors.get(zname)
        if z is not None and b != target:
            nb = k // bs if bs else 1

            def conv_z(e, z=z, n=n, nb=nb, b=b, c=c):
                ze = np.asarray(z[e], dtype=np.uint8)
                if bs:
                    return L.pack_bits(L.unpack_bits(ze.reshape(n, -1), b, nb) + c, target)
                return L.pack_bits(L.unpack_bits(ze.reshape(-1), b, n) + c, target)

            shape = (E, n, L.row_bytes(nb, target)) if bs else (E, L.row_bytes(n, target))
            out[zname] = ExpertArray(shape, np.uint8, conv_z, zname)
    new = dataclasses.replace(spec, fc1_bits=target, fc2_bits=target, fc3_bits=target if spec.has_fc3 else None,
                              packing="raw", weights_prepacked=0)
    parts = []
    if spec.packing == "sm80":
        parts.append("SM80 prepacked -> raw rows")
    narrow = sorted({b for b in widths.values() if b != target})
    if narrow:
        parts.append(" / ".join(f"int{b}" for b in narrow) + f" -> int{target} (codes and zero points + "
                     + ", ".join(str((1 << (target - 1)) - (1 << (b - 1))) for b in narrow) + ")")
    note = f"{spec.layout_summary()} -> int{target} raw{' block ' + str(bs) if bs else ' per row'}: " + "; ".join(parts)
    return GpuConversion(spec, new, out, "sm80" if spec.packing == "sm80" and not narrow else "int-widen", note, True)


# ----------------------------------------------------------------------------- nvfp4 / mxfp4
def _fp4_codes(w_e, n: int, k: int, packing: str) -> np.ndarray:
    """E2M1 codes uint8 [N, K] of one expert, as kernels.layouts.dequantize_fp4 reads them."""
    w = np.asarray(w_e, dtype=np.uint8).reshape(-1)
    if packing == "n_packed":
        return unpack_rows(w.reshape(k, n // 2), 4, n).T
    return unpack_rows(w.reshape(n, k // 2), 4, k)  # K-packed rows, whatever the declared dims


def _global_exact(g: np.ndarray, fmt: str) -> bool:
    """Whether block scale * g / 2 has few enough significant bits for fp32 for every block scale of the format
    (nvfp4: e4m3 significands have <= 4 bits, so g may have <= 20; mxfp4: powers of two, any finite g). fp32's
    range is not part of this: it is checked per expert as experts are converted (module doc)."""
    g = np.asarray(g, np.float64).reshape(-1)
    if not np.all(np.isfinite(g)):
        return False
    if fmt != "e4m3":
        return True
    m, _ = np.frexp(g)  # g = m * 2^x, 0.5 <= |m| < 1: <= 20 significant bits <=> m * 2^20 is an integer
    return bool(np.all(np.floor(m * 2.0 ** 20) == m * 2.0 ** 20))


def _convert_fp4(spec: QMoESpec, tensors: dict) -> GpuConversion:
    E, blk, fmt = spec.num_experts, spec.block_size, spec.scale_format
    out = {name: v for name, v in tensors.items() if not name.endswith("_global_scale")}
    conv_box = {}
    exact = True
    for proj, n, k, _ in spec.projections:
        wname, sname = f"{proj}_experts_weights", f"{proj}_scales"
        w, s = tensors[wname], tensors[sname]
        g = tensors.get(f"{proj}_global_scale")
        exact = exact and (g is None or _global_exact(np.asarray(g), fmt))

        def conv_w(e, w=w, n=n, k=k):
            return np.ascontiguousarray(FP4_CODE_TO_INT8[_fp4_codes(w[e], n, k, spec.packing)])

        def conv_s(e, s=s, g=g, n=n, k=k, proj=proj):
            s64 = L.scale_values(np.asarray(s[e]), fmt).reshape(n, k // blk)
            g64 = 1.0 if g is None else float(np.asarray(g[e], np.float64).reshape(()))
            want = s64 * g64 * 0.5  # exact in float64 (<= 4 + 24 significant bits, or a power of two times g)
            with np.errstate(over="ignore"):
                got = want.astype(np.float32)
            over = np.isinf(got) & np.isfinite(want)
            if over.any():
                raise UnsupportedLayout(f"node '{spec.node_name}': expert {e} {proj}: block scale x global scale / 2 "
                                        f"= {float(want[over][0]):.3g} overflows the fp32 scales of the GPU layout")
            diff = (got.astype(np.float64) != want) & ~np.isnan(want)
            if diff.any():
                rel = np.abs(got.astype(np.float64)[diff] - want[diff]) / np.abs(want[diff])
                conv_box["c"]._record(int(diff.sum()), float(rel.max()))
            return got

        out[wname] = ExpertArray((E, n, k), np.uint8, conv_w, wname)
        out[sname] = ExpertArray((E, n, k // blk), np.float32, conv_s, sname)
    new = dataclasses.replace(spec, quant_type="int", fc1_bits=8, fc2_bits=8, fc3_bits=8 if spec.has_fc3 else None,
                              packing="raw", scale_format="float", has_global_scale=False, has_zero_points=False,
                              weights_prepacked=0)
    note = (f"{spec.layout_summary()} -> int8 raw block {blk}: code = 128 + 2 * e2m1, "
            f"fp32 scale = {fmt} scale * global / 2 ({'exact' if exact else 'rounded to fp32 where inexact'})")
    conv = GpuConversion(spec, new, out, "fp4", note, exact)
    conv_box["c"] = conv
    return conv
