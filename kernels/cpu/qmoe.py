"""CPU execution of one com.microsoft QMoE (int2 / int3 / int4 / int8 raw rows, MXFP4, NVFP4 K-packed) or float
MoE node.

Tokens are grouped by expert (``kernels.group_pairs``). Quantised nodes take the batched paths: experts
with few tokens (decode) run one fused kernel (``moe_gemv``: FC1 + activation + FC2 + weighted sum over
all of them, weight rows handed to the threads in contiguous chunks); experts with many tokens (prefill)
run one k-blocked dequant-GEMM call per projection for all of them (``qgemm_tasks``: tasks from an
atomic counter, 6-row weight panels against L1-resident packed activations, activation fused into FC1's
epilogue). ``CpuQMoE.batched = False`` keeps the older per-expert paths (``gemv_q`` / ``qgemm``) for
comparison. The float MoE op goes through NumPy's BLAS. Routing (``kernels.cpu.routing``) is kept
separate from expert execution (``run_experts``). Measurements: benchmarks/NOTES-cpu-kernels.md.
"""
from __future__ import annotations

import functools
import threading

import numba
import numpy as np

from .. import layouts as _L
from ..qmoe_spec import QMoESpec, UnsupportedLayout
from . import generic as _generic
from . import kernels as _k
from . import simd as _simd
from .routing import route
from .threads import use_threads

__all__ = ["CpuQMoE", "k_permutation"]

_ACT_CODES = {"relu": _k.ACT_RELU, "gelu": _k.ACT_GELU, "silu": _k.ACT_SILU, "identity": _k.ACT_IDENTITY,
              "swiglu": _k.ACT_SWIGLU}
_ONE = np.ones(1, np.float32)
_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)
_NOPERM = np.zeros(1, np.int64)
_NOAUX = np.zeros(_k.TBL_RECORD, np.float32)  # aux of the integer layouts (unused)
WHOLE = np.zeros((0, 2), np.int64)  # moe_gemv's spans for whole experts
_SCRATCH = threading.local()


def _scratch(name: str, n: int) -> np.ndarray:
    """A float32 work array of n elements, reused by later calls in this thread (grow-only): large fresh
    arrays would cost page faults on every prefill call. Shared by all CpuQMoE instances of the thread."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    a = bufs.get(name)
    if a is None or a.size < n:
        a = bufs[name] = np.empty(max(n, 1024), np.float32)
    return a[:n]


def _c_array(a, dtype: np.dtype, rows: int, cols: int = -1) -> np.ndarray:
    """a as a C-contiguous [rows, cols] array of dtype (cols -1: whatever a's size gives); a itself when it is one
    already: checking costs less than NumPy's conversion calls (each ~1 µs with the caches cold after a kernel)."""
    if (type(a) is np.ndarray and a.dtype == dtype and a.ndim == 2 and a.shape[0] == rows
            and (cols < 0 or a.shape[1] == cols) and a.flags.c_contiguous):
        return a
    return np.ascontiguousarray(a, dtype=dtype).reshape(rows, cols)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous view (copies only a non-contiguous input)."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _is_bf16(dt) -> bool:
    return np.dtype(dt).name == "bfloat16"


def k_permutation(K: int, bits: int, chunk: int) -> np.ndarray | None:
    """Order of k in a row written by the GEMMs' dequantisation (``qgemm``, ``qgemm_tasks``; None = natural).

    int4 / fp4: within each whole chunk of ``chunk`` bytes, first the even k (low nibbles), then the odd k;
    int2: the k = 0 mod 4 of the chunk (code 0 of each byte), then 1, 2, 3 mod 4; int3 (``chunk`` 24 bytes = 64
    codes, kernels/cpu/simd.py): slot k & 3 of each of the 16 lanes (lane (k >> 3 & 7) + 8 (k >> 2 & 1)), slots
    0..3 in turn (see kernels.int3_position). The tail stays in order.
    """
    if bits == 3:  # pos[k]: where input k sits in the panels (whole 64-code chunks, then the tail)
        assert chunk * 8 // 3 == 64
        j = np.arange(K, dtype=np.int64)
        pos = np.where(j >= 64 * (K // 64), j, 64 * (j >> 6) + 16 * (j & 3) + ((j >> 3) & 7) + 8 * ((j >> 2) & 1))
        perm = np.empty(K, np.int64)
        perm[pos] = j
        return perm
    vpb = 8 // bits
    if vpb == 1:
        return None
    nchunk = (K // vpb) // chunk
    perm = np.arange(K, dtype=np.int64)
    if nchunk:
        c = np.arange(nchunk)[:, None] * (vpb * chunk)
        t = np.arange(chunk)[None, :]
        perm[: nchunk * vpb * chunk] = np.concatenate([c + vpb * t + s for s in range(vpb)], axis=1).reshape(-1)
    return perm


class _Proj:
    """One prepared projection (fc1 / fc2 / fc3): views of the stored tensors plus layout constants."""

    def __init__(self, spec: QMoESpec, tensors: dict, name: str, n: int, k: int, bits: int):
        self.name, self.N, self.K, self.bits = name, n, k, bits
        E = spec.num_experts
        w = tensors[f"{name}_experts_weights"]
        b = tensors.get(f"{name}_experts_bias")
        self.has_bias = b is not None
        # read-only like the other tensors: Numba compiles a kernel once per argument type, and a bias read in place
        # from the weight file is read-only where a converted one is not (each kernel compiled twice, ~1 min each)
        self.bias = _readonly(np.asarray(b, dtype=np.float32).reshape(E, n) if b is not None
                              else np.zeros((1, 1), np.float32))
        self.quantized = spec.is_quantized
        if not self.quantized:
            self.w = np.asarray(w)  # [E, N, K] float, used through BLAS
            return
        fp4 = spec.quant_type in ("fp4", "nvfp4")
        self.fmt = _k.FMT_FP4 if fp4 else _k.FMT_INT
        w = np.asarray(w)
        w = w.view(np.uint8) if w.dtype != np.uint8 and w.dtype.itemsize == 1 else w.astype(np.uint8, copy=False)
        # fp4: K-packed row-major bytes whatever the declared dims (nvfp4 may declare [E, K, N/2])
        self.w = _readonly(w.reshape(E, n, k // 2) if fp4 else w)
        Kb = self.w.shape[2]
        bs = spec.block_size
        self.nb = k // bs if bs else 1
        s = np.asarray(tensors[f"{name}_scales"])
        self.aux = _NOAUX
        if fp4:  # fp8 scale codes, decoded through a per-expert record: E2M1 values, scale table x global scale
            s, self.skind = s.view(np.uint8), 3
            table = _L.E8M0_TABLE if spec.scale_format == "e8m0" else _L.E4M3_TABLE
            g = np.asarray(tensors[f"{name}_global_scale"], np.float64).reshape(E)
            aux = np.empty((E, _k.TBL_RECORD), np.float32)
            aux[:, :16] = _L.E2M1_VALUES
            with np.errstate(invalid="ignore"):
                aux[:, 16:] = table.astype(np.float64)[None, :] * g[:, None]
            self.aux = aux.reshape(-1)
        elif s.dtype == np.float32:
            self.skind = 0
        elif s.dtype == np.float16:
            s, self.skind = s.view(np.uint16), 1
        elif _is_bf16(s.dtype) or s.dtype == np.uint16:
            s, self.skind = s.view(np.uint16), 2
        else:
            s, self.skind = s.astype(np.float32), 0
        if self.skind in (1, 2) and self.nb > _simd.MAX_ROW_BLOCKS:
            # more blocks a row than the row kernels convert up front (simd._block_scales): float32 here
            if self.skind == 1:
                s = s.view(np.float16).astype(np.float32)
            else:  # bf16 bits: the upper half of a float32
                s = (s.astype(np.uint32) << 16).view(np.float32)
            self.skind = 0
        self.sc = _readonly(s.reshape(E, n, self.nb))
        zp = tensors.get(f"{name}_zero_points")
        if zp is None:
            self.zmode, self.zp = 0, _readonly(np.zeros((1, 1), np.uint8))
        else:
            zp = np.asarray(zp, dtype=np.uint8)
            self.zmode = 2 if bs else 1
            self.zp = _readonly(zp.reshape(E, -1))
        block_bytes = (bs if bs else k) * bits // 8
        self.bpc = 1  # quantisation blocks per chunk
        if bits == 3:  # int3 kernels: 24-byte chunks of 64 codes; blocks of 32 = two per chunk, 64 << cshift, per row
            self.chunk, self.bpc = _k.INT3_CHUNK, 2 if bs == 32 else 1
            self.cshift = 62 if not bs else (0 if bs == 32 else int(bs // 64).bit_length() - 1)
        elif not bs:
            self.chunk, self.cshift = 16, 62
        elif fp4 or bits == 2:  # table kernels: 16-byte chunks over one, two or four blocks
            self.chunk = 16
            self.bpc = max(1, 16 // block_bytes)  # 2: NVFP4 block 16, int2 block 32; 4: int2 block 16
            self.cshift = int(np.log2(block_bytes // 16)) if self.bpc == 1 else 0
        else:
            self.chunk = 8 if block_bytes < 16 else 16
            self.cshift = int(np.log2(block_bytes // self.chunk))
        self.vals = self.chunk * 8 // bits  # values per chunk
        # int3: whole 64-code chunks of K (the row's last bytes may hold padding bits past K)
        self.nchunk = k // self.vals if bits == 3 else Kb // self.chunk
        self.perm = k_permutation(k, bits, self.chunk)
        # batched paths: layout constants as one int64 array, k order of the packed panels and its inverse
        self.qparams = np.array([self.skind, self.zmode, bits, self.nb, self.chunk, self.cshift, self.nchunk,
                                 int(self.has_bias), self.fmt, self.bpc], np.int64)
        self.perm_arr = self.perm if self.perm is not None else np.arange(k, dtype=np.int64)
        self.pinv = np.empty(k, np.int64)
        self.pinv[self.perm_arr] = np.arange(k, dtype=np.int64)

    @property
    def table_layout(self) -> bool:
        """Layouts only the batched paths read (fp4, int2, int3): no legacy per-expert kernels for them."""
        return self.fmt == _k.FMT_FP4 or self.bits in (2, 3)

    def gemv_ws(self) -> int:
        """Floats of moe_gemv's workspace per (token, expert) pair for this projection: the activation streams
        (int2: four of Kb each, their lane sums + one; int3: kernels.int3_width + Kb; otherwise two of Kb) and the
        chunk sums."""
        Kb = self.w.shape[2]
        if self.bits == 3:
            return _k.int3_width(Kb, self.nchunk) + Kb + self.nchunk
        return Kb * (6 if self.bits == 2 else 2) + self.nchunk

    def kcc(self, kc_values: int) -> int:
        """Chunks per k-block of the batched GEMM: about kc_values values, whole quantisation blocks."""
        c = max(1, kc_values // self.vals)
        if self.cshift < 62:
            per_block = 1 << self.cshift
            c = max(per_block, c // per_block * per_block)
        return c

    def gemm_tasks(self, xp, blocks, tasks, owner, mode, out, coef=None, pinv=None, knext=0):
        """One qgemm_tasks call over all experts' tasks (see kernels.qgemm_tasks)."""
        _, blk_col, blk_w, blk_pair, blk_valid = blocks
        sp = owner.spec
        _k.qgemm_tasks(self.w, self.sc, self.skind, self.zp, self.zmode, self.bits, self.nb, self.chunk,
                       self.cshift, self.nchunk, self.fmt, self.bpc, self.aux, self.K, self.kcc(owner.gemm_kc), xp, blk_col, blk_w, blk_pair,
                       blk_valid, tasks, owner._rt, owner.gemm_cols, self.bias, self.has_bias, mode,
                       _ONE if coef is None else coef, owner.act_kind, float(sp.alpha), float(sp.beta),
                       owner.limit, owner.has_limit, _NOPERM if pinv is None else pinv, knext, out,
                       numba.get_num_threads())

    # -- decode: fused dequant-GEMV
    def gemv(self, xa, xb, xs, experts, pair_off, src_row, dst_row, coef, out):
        _k.gemv_q(self.w, self.sc, self.skind, self.zp, self.zmode, self.bits, self.nb, self.chunk, self.cshift,
                  self.nchunk, xa, xb, xs, experts, pair_off, src_row, dst_row, coef, self.bias, self.has_bias, out)

    def split_x(self, x: np.ndarray):
        """Activation layout the GEMV kernel reads: int4 -> (even k, odd k), int8 -> (x, x); plus the sums
        of x over each chunk's values (for the folded zero point)."""
        vals = self.chunk * (2 if self.bits == 4 else 1)
        xs = np.ascontiguousarray(x[:, : self.nchunk * vals].reshape(x.shape[0], self.nchunk, vals).sum(axis=2),
                                  dtype=np.float32)
        if self.bits == 4:
            return np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2]), xs
        x = np.ascontiguousarray(x)
        return x, x, xs

    # -- float MoE nodes: the expert's matrix for BLAS
    def dense(self, e: int) -> np.ndarray:
        """Expert e's [N, K] float32 matrix (a float MoE node's; quantised nodes run the kernels)."""
        w = self.w[e]
        return w if w.dtype == np.float32 else w.astype(np.float32)

    def gemm(self, e: int, x: np.ndarray, accumulate=False, dst=None, coef=None, out=None):
        """x [M, K] float32 -> [M, N] = x W_e^T + b_e (or scatter-add coef * that into out[dst])."""
        M = x.shape[0]
        mpad = (M + 15) // 16 * 16
        xt = np.zeros((self.K, mpad), np.float32)
        xt[:, :M] = self.permute(x).T
        if out is None:
            out = np.empty((M, self.N), np.float32)
        if dst is None:
            dst = np.zeros(1, np.int64)
            coef = np.zeros(1, np.float32)
        _k.qgemm(self.w, self.sc, self.skind, self.zp, self.zmode, self.bits, self.nb, self.chunk, self.cshift,
                 self.nchunk, e, xt, M, self.bias, self.has_bias, accumulate, dst.astype(np.int64),
                 coef.astype(np.float32), out)
        return out

    def permute(self, x: np.ndarray) -> np.ndarray:
        if not self.quantized or self.perm is None:
            return x
        return x[:, self.perm]


class CpuQMoE:
    """Executes one QMoE / MoE node on the CPU.

    ``tensors``: QMoE input name -> array (or None when absent); may be read-only np.memmap views of a
    weight file: they are used in place (no copy of the weight set; only biases are converted to
    float32). Per-expert weights are touched only when that expert runs.
    """

    # Path choice per expert: the fused GEMV re-unpacks the weights for every token, the GEMM pads
    # tokens to 16 columns; measured crossover (H = I = 2880, int4, 2 cores) is ~6-7 tokens per expert.
    gemv_max_rows = 6  # experts with at most this many tokens use the fused dequant-GEMV
    decode_max_tokens = 0  # batches of at most this many tokens use the GEMV for every expert (tests/tuning)
    gemm_max_rows = 128  # legacy prefill path: tokens per GEMM call (keeps x^T resident in L2)
    # Batched paths (quantised nodes): one Numba call per projection for all experts of the batch.
    batched = True  # False: the per-expert legacy paths (kept for comparison)
    gemm_kc = 256  # k-block of the batched GEMM, in values (X panel of kc x 32 floats stays in L1)
    gemm_rows = 72  # weight rows per GEMM task (a multiple of 6)
    gemm_cols = 128  # at most this many token columns per GEMM task
    gemv_prefetch_rows = 4  # decode: software prefetch this many rows ahead (0: hardware prefetch only);
    # once the table kernels made decode memory bound, 2-8 rows ahead measured 12-15% faster on the 16-core Xeon.
    # The table kernels (int4 with AVX-512, fp4, int2) prefetch their weight bytes in the row loop themselves
    # (simd.ROW_PREFETCH_AHEAD); for them these rows ahead are the scales' only.
    gemv_chunk_kb = 64  # decode: threads take the weight rows in chunks of about this many KB
    # decode chunk order: 0 one shared counter (chunks interleave between threads; measured on the Xeon);
    # 1 each thread streams its own contiguous span first, then takes chunks from the others' spans;
    # None: 1 on at most gemv_own_spans_threads threads, else 0. Own spans measured 1.2-1.35x faster on the 2-core
    # Zen 5 VM (int4 and NVFP4 decode: one long stream per thread for the L2 prefetcher); not yet measured on the
    # 16-core Xeon, which keeps the order measured there
    gemv_schedule = None
    gemv_own_spans_threads = 2

    def __init__(self, spec: QMoESpec, tensors: dict, num_threads: int | None = None):
        self.spec = spec
        self.num_threads = num_threads
        # layouts / activations these kernels do not implement run in kernels/cpu/generic.py
        self._delegate = _generic.delegate_for(spec, tensors, num_threads)
        if self._delegate is not None:
            return
        H, I = spec.hidden_size, spec.inter_size
        t = {k: v for k, v in tensors.items() if v is not None}
        for need in ("fc1_experts_weights", "fc2_experts_weights"):
            if need not in t:
                raise UnsupportedLayout(f"node '{spec.node_name}': input '{need}' is missing")
        if spec.activation == "swiglu" and spec.swiglu_fusion == 0 or spec.has_fc3:
            if "fc3_experts_weights" not in t:
                raise UnsupportedLayout(f"node '{spec.node_name}': input 'fc3_experts_weights' is missing")
        self.fc1 = _Proj(spec, t, "fc1", spec.fc1_rows, H, spec.fc1_bits)
        self.fc2 = _Proj(spec, t, "fc2", H, I, spec.fc2_bits)
        self.fc3 = _Proj(spec, t, "fc3", I, H, spec.fc3_bits or spec.fc1_bits) if spec.has_fc3 else None
        self.act_kind = _ACT_CODES[spec.activation]
        self.has_limit = spec.swiglu_limit is not None
        self.limit = float(spec.swiglu_limit) if self.has_limit else 0.0
        # what the fused kernels can do in their FC1 epilogue: swiglu with interleaved (fusion 1) rows, or a
        # non-gated activation; the decode kernel also pairs concatenated (fusion 2) rows
        swiglu = spec.activation == "swiglu"
        self._gemm_fused_act = self.fc3 is None and (swiglu and spec.swiglu_fusion == 1 or not swiglu)
        self._gemv_fused = spec.is_quantized and self.fc3 is None and (not swiglu or spec.swiglu_fusion in (1, 2))
        # fp4 / int2 / int3 projections exist only in the batched paths (the legacy per-expert kernels read int4 /
        # int8): such nodes always run batched, and where the fused decode kernel does not apply (FC3), on the GEMM path
        self._table = spec.is_quantized and any(p.table_layout for p in (self.fc1, self.fc2, self.fc3) if p)
        # What depends on the node only, read once instead of at every call (issue #4: the Python around the
        # kernels was 30-50 µs per layer in a decode step): a property of the spec, the decode workspace per pair.
        self._quantized = spec.is_quantized
        self._gemv_ws_per_pair = sum(p.gemv_ws() for p in (self.fc1, self.fc2)) if self._quantized else 0
        if self._gemv_fused:
            # moe_gemv's per-node arguments, gathered once: FC1's and FC2's tensors and layout, the activation
            f1, f2 = self.fc1, self.fc2
            self._gemv_weights = (f1.w, f1.sc, f1.zp, f1.qparams, f1.bias, f1.aux, f2.w, f2.sc, f2.zp, f2.qparams,
                                  f2.bias, f2.aux)
            self._gemv_activation = (self.act_kind, spec.swiglu_fusion, float(spec.alpha), float(spec.beta),
                                     self.limit, self.has_limit)

    # ------------------------------------------------------------------ public API
    @property
    def compiled_for(self):
        """What Numba compiles this node's decode and prefill kernels for: the types of the expert tensors they are
        handed (nodes with equal values share their machine code); the node itself where that is not known (a
        delegated layout, the legacy paths)."""
        weights = getattr(self, "_gemv_weights", None)
        if weights is None:
            return id(self)
        return tuple((a.dtype.str, a.ndim, a.flags.writeable) if isinstance(a, np.ndarray) else type(a)
                     for a in weights)

    def forward(self, x, router_logits, router_weights=None) -> np.ndarray:
        """Same contract as kernels.reference.qmoe_reference: x [T, H] or [B, S, H] -> same shape and dtype."""
        x = np.asarray(x)
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.spec.hidden_size)
        ids, w = route(router_logits, self.spec, router_weights)
        out = np.zeros((x2.shape[0], self.spec.hidden_size), np.float32)
        self.run_experts(x2, ids, w, out=out)
        return out.astype(dtype, copy=False).reshape(shape)

    def run_experts(self, x2d: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray,
                    out: np.ndarray | None = None, spans: np.ndarray | None = None) -> np.ndarray:
        """out[t] += sum_j weights[t, j] * FFN_{expert_ids[t, j]}(x2d[t]); expert id -1 = skipped.

        Without ``out`` a new array in x2d's dtype is returned (accumulated in float32). With ``out``
        (float32 [T, H], C-contiguous) the contributions are added to it in place and it is returned:
        the offload engine can then run subsets of experts into one accumulator.
        ``spans`` (int64 [E, 2]): expert e's intermediate rows [spans[e, 0], spans[e, 1]) only, its part of a pair
        split between the CPU and the GPU (moe_gemv's spans; FC2's bias only in the part from row 0). Only through the
        fused decode kernel (splits_rows), for a decode step's tokens.
        """
        if spans is not None:
            self._check_spans(spans, np.shape(x2d)[0])
        if self._delegate is not None:
            return self._delegate.run_experts(x2d, expert_ids, weights, out=out)
        threads = use_threads(self.num_threads)
        x2d = np.asarray(x2d)
        H = self.spec.hidden_size
        T = x2d.shape[0]
        ret_dtype = x2d.dtype
        acc = out if out is not None else np.zeros((T, H), np.float32)
        if T == 0:
            return acc if out is not None else acc.astype(ret_dtype)
        x = _c_array(x2d, _F32, T, H)
        ids = _c_array(expert_ids, _I64, T)  # read only: the caller's array when it is int64 already
        wts = _c_array(weights, _F32, T)
        if ((self.batched or self._table) and self._quantized) or spans is not None:
            self._run_batched(x, ids, wts, acc, threads, WHOLE if spans is None else spans)
            return acc if out is not None else acc.astype(ret_dtype, copy=False)
        valid = ids >= 0
        if np.any(ids >= self.spec.num_experts):
            raise ValueError(f"expert id out of range (num_experts={self.spec.num_experts})")
        tok = np.nonzero(valid)[0].astype(np.int64)
        eid = ids[valid]
        pw = wts[valid]
        if eid.size:
            order = np.argsort(eid, kind="stable")
            tok, eid, pw = tok[order], eid[order], pw[order]
            experts, starts, counts = np.unique(eid, return_index=True, return_counts=True)
            if not self.spec.is_quantized:
                small = np.zeros(experts.size, bool)
            elif T <= self.decode_max_tokens:
                small = np.ones(experts.size, bool)
            else:
                small = counts <= self.gemv_max_rows
            if np.any(small):
                sel = np.concatenate([np.arange(s, s + c) for s, c in zip(starts[small], counts[small])])
                self._run_gemv(x, experts[small], counts[small], tok[sel], pw[sel], acc)
            for e, s, c in zip(experts[~small], starts[~small], counts[~small]):
                self._run_dense(x, int(e), tok[s:s + c], pw[s:s + c], acc)
        if out is not None:
            return acc
        return acc.astype(ret_dtype, copy=False)

    # ------------------------------------------------------------------ batched paths (quantised)
    @property
    def splits_rows(self) -> bool:
        """Whether run_experts takes spans: the fused decode kernel runs this node's decode steps."""
        return self._delegate is None and self._gemv_fused and self._quantized

    @functools.cached_property
    def reads_rows_in_part(self) -> bool:
        """Whether a part of an expert from a multiple of 64 rows on (kernels/cold_split.py: ROW_STEP) reads only its
        part of FC2's rows too: moe_gemv's loop of int4 rows of whole 16-byte chunks starts at the part's chunk where
        that starts a scale block (blocks of <= 64 codes, or one scale a row). Elsewhere FC2's rows are read whole.
        Worked out once from the node's layout: the accounts of every "both" layer's step ask it."""
        if not self.splits_rows:
            return False
        f2 = self.fc2
        bits, nb, chunk, cshift, nchunk, fmt = (int(f2.qparams[i]) for i in (2, 3, 4, 5, 6, 8))
        return (bits == 4 and chunk == 16 and fmt == _k.FMT_INT and nchunk * 16 == f2.w.shape[2]
                and (cshift >= 62 or cshift <= 1))

    def _check_spans(self, spans: np.ndarray, tokens: int) -> None:
        E, inter = self.spec.num_experts, self.spec.inter_size
        if not self.splits_rows or tokens > self.gemv_max_rows:
            raise ValueError(f"node '{self.spec.node_name}': a part of an expert's rows needs the fused decode "
                             f"kernel and <= {self.gemv_max_rows} tokens")
        if spans.shape != (E, 2) or spans.dtype != np.int64 or not spans.flags.c_contiguous:
            raise ValueError(f"spans: int64 [{E}, 2], not {spans.dtype} {list(spans.shape)}")
        if ((spans[:, 0] < 0) | (spans[:, 0] > spans[:, 1]) | (spans[:, 1] > inter)).any():
            raise ValueError(f"spans: row ranges within 0..{inter}")

    def _run_batched(self, x, ids, wts, acc, threads, spans=WHOLE):
        """Experts with few tokens: one fused decode kernel (FC1 + activation + FC2 + weighted sum); the
        others: one k-blocked GEMM call per projection over all of them, activation in FC1's epilogue."""
        T = x.shape[0]
        small_max = ids.size if T <= self.decode_max_tokens else self.gemv_max_rows
        if self._table and not self._gemv_fused:
            small_max = 0
        experts, pair_off, tok, pw, ns, bad, tpair = _k.group_pairs(ids, wts, self.spec.num_experts, small_max)
        if bad:
            raise ValueError(f"expert id out of range (num_experts={self.spec.num_experts})")
        U = experts.size
        if U == 0:
            return
        if ns:
            ps = int(pair_off[ns])
            if self._gemv_fused:
                self._gemv_fused_call(x, experts[:ns], pair_off[:ns + 1], tok[:ps], pw[:ps], acc, threads, spans)
            else:
                self._run_gemv(x, experts[:ns], np.diff(pair_off[:ns + 1]), tok[:ps], pw[:ps], acc)
        if ns < U:
            self._gemm_batched(x, experts, pair_off, ns, tok, pw, tpair, acc, threads)

    def _gemv_fused_call(self, x, experts, pair_off, tok, pw, acc, threads, spans=WHOLE):
        P = tok.size
        H = self.spec.hidden_size
        ws = _scratch("gemv_ws", P * self._gemv_ws_per_pair)
        y = _scratch("gemv_y", P * H).reshape(P, H)
        _k.moe_gemv(*self._gemv_weights, x, experts, pair_off, tok, pw, tok, spans, *self._gemv_activation,
                    int(self.gemv_prefetch_rows), int(self.gemv_chunk_kb) * 1024, self.decode_order(threads), ws, y,
                    acc, True, threads)

    def host_part_args(self, tokens: int, threads: int):
        """What kernels/cpu/host_parts.py's compiled loop needs to run this node's decode kernel on `threads` threads
        for at most `tokens` tokens: (moe_gemv's weights, its activation, int64 params [E, small_max, prefetch rows,
        chunk bytes, order, threads, workspace per pair]); None where that loop cannot (a delegated layout, no fused
        decode kernel, more tokens than the fused kernel takes per expert)."""
        if self._delegate is not None or not (self._gemv_fused and self._quantized) or tokens > self.gemv_max_rows:
            return None
        small_max = tokens * self.spec.k
        params = np.array([self.spec.num_experts, small_max, self.gemv_prefetch_rows, self.gemv_chunk_kb * 1024,
                           self.decode_order(threads), threads, self._gemv_ws_per_pair], np.int64)
        return self._gemv_weights, self._gemv_activation, params

    def decode_order(self, threads: int) -> int:
        """moe_gemv's chunk order on this many threads (see gemv_schedule)."""
        if self.gemv_schedule is not None:
            return int(self.gemv_schedule)
        return 1 if threads <= self.gemv_own_spans_threads else 0

    def _gemm_batched(self, x, experts, pair_off, u0, tok, pw, tpair, acc, threads):
        f1, f2, f3 = self.fc1, self.fc2, self.fc3
        U = experts.size
        p0 = int(pair_off[u0])
        PL = int(pair_off[U]) - p0
        rows, coef = tok[p0:], pw[p0:]
        blocks = _k.plan_blocks(pair_off, u0, U, p0)
        ublk, blk_col = blocks[0], blocks[1]
        C = int(blk_col[-1])
        H, I = self.spec.hidden_size, self.spec.inter_size
        rt = self._rt = max(6, int(self.gemm_rows) // 6 * 6)
        xp = _scratch("xp", C * H)
        _k.pack_cols(x, rows, f1.perm_arr, *blocks[1:], xp)
        ap = _scratch("ap", C * I)
        t1 = _k.plan_tasks(experts, u0, ublk, blk_col, f1.N, rt, self.gemm_cols)
        if self._gemm_fused_act:
            mode = _k.MODE_SWIGLU if self.spec.activation == "swiglu" else _k.MODE_ACT
            f1.gemm_tasks(xp, blocks, t1, self, mode, ap, pinv=f2.pinv, knext=I)
        else:
            h1 = _scratch("h1", PL * f1.N)
            f1.gemm_tasks(xp, blocks, t1, self, _k.MODE_STORE, h1)
            h3 = None
            if f3 is not None:
                xp3 = xp
                if f3.perm is not None and (f1.perm is None or not np.array_equal(f3.perm, f1.perm)) or \
                        f3.perm is None and f1.perm is not None:
                    xp3 = _scratch("xp3", C * H)
                    _k.pack_cols(x, rows, f3.perm_arr, *blocks[1:], xp3)
                h3 = _scratch("h3", PL * f3.N)
                t3 = _k.plan_tasks(experts, u0, ublk, blk_col, f3.N, rt, self.gemm_cols)
                f3.gemm_tasks(xp3, blocks, t3, self, _k.MODE_STORE, h3)
                h3 = h3.reshape(PL, f3.N)
            a = self._activate(h1.reshape(PL, f1.N), h3)
            _k.pack_cols(a, np.arange(PL, dtype=np.int64), f2.perm_arr, *blocks[1:], ap)
        y = _scratch("y", PL * H)
        t2 = _k.plan_tasks(experts, u0, ublk, blk_col, f2.N, rt, self.gemm_cols)
        f2.gemm_tasks(ap, blocks, t2, self, _k.MODE_SCALE, y, coef=coef)
        _k.reduce_tokens(y.reshape(PL, H), tpair, p0, acc, threads)

    # ------------------------------------------------------------------ paths
    def _activate(self, h1, h3):
        P = h1.shape[0]
        a = np.empty((P, self.spec.inter_size), np.float32)
        _k.activate(h1, h3 if h3 is not None else h1, h3 is not None, self.act_kind, self.spec.swiglu_fusion,
                    self.spec.alpha, self.spec.beta, self.limit, self.has_limit, a)
        return a

    def _run_gemv(self, x, experts, counts, tok, pw, acc):
        """Fused dequant-GEMV over all (token, expert) pairs, grouped by expert."""
        P = tok.size
        experts = experts.astype(np.int64)
        pair_off = np.zeros(experts.size + 1, np.int64)
        np.cumsum(counts, out=pair_off[1:])
        ar = np.arange(P, dtype=np.int64)
        ones = np.ones(P, np.float32)
        xa, xb, xs = self.fc1.split_x(x)
        h1 = np.zeros((P, self.fc1.N), np.float32)
        self.fc1.gemv(xa, xb, xs, experts, pair_off, tok, ar, ones, h1)
        h3 = None
        if self.fc3 is not None:
            xa3, xb3, xs3 = self.fc3.split_x(x)
            h3 = np.zeros((P, self.fc3.N), np.float32)
            self.fc3.gemv(xa3, xb3, xs3, experts, pair_off, tok, ar, ones, h3)
        a = self._activate(h1, h3)
        aa, ab, as_ = self.fc2.split_x(a)
        self.fc2.gemv(aa, ab, as_, experts, pair_off, ar, tok, pw.astype(np.float32), acc)

    def _run_dense(self, x, e, tok, pw, acc):
        """One expert over a group of tokens: (de)quantised GEMMs, activation, weighted scatter-add."""
        if not self.spec.is_quantized:
            return self._run_dense_float(x, e, tok, pw, acc)
        for m0 in range(0, tok.size, self.gemm_max_rows):
            t = tok[m0:m0 + self.gemm_max_rows]
            xg = x[t]
            M = t.size
            h1 = self.fc1.gemm(e, xg)
            h3 = self.fc3.gemm(e, xg) if self.fc3 is not None else None
            a = self._activate(h1, h3)
            self.fc2.gemm(e, a, accumulate=True, dst=t, coef=pw[m0:m0 + M], out=acc)

    def _run_dense_float(self, x, e, tok, pw, acc):
        xg = x[tok]
        h1 = xg @ self.fc1.dense(e).T
        if self.fc1.has_bias:
            h1 += self.fc1.bias[e]
        h3 = None
        if self.fc3 is not None:
            h3 = xg @ self.fc3.dense(e).T
            if self.fc3.has_bias:
                h3 += self.fc3.bias[e]
        a = self._activate(np.ascontiguousarray(h1, dtype=np.float32),
                           None if h3 is None else np.ascontiguousarray(h3, dtype=np.float32))
        y = a @ self.fc2.dense(e).T
        if self.fc2.has_bias:
            y += self.fc2.bias[e]
        acc[tok] += pw[:, None] * y
