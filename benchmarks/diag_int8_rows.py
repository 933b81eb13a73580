"""Diagnosis: would integer dot products lift the CPU decode kernel's rate a core? (issue #3, an experiment)

On the H200 machine's Xeon one core reads int4 weights from its own L2 no faster than from DRAM (~8 GB/s,
`diag_cpu_levels.py`): the row loop's instructions bound it. The engine's row loop (kernels.cpu.simd's table kernel)
spends 7 vector uops on 32 codes. With the activations rounded to int8 per block of 32, AVX-512 VNNI's vpdpbusd
multiplies 64 unsigned code bytes by 64 signed activation bytes and adds them in fours into 16 int32 lanes in one
uop, so 128 codes take ~9: two nibble masks and a shift, two vpdpbusd, the int32 -> float conversion, the four block
scales spread over their lanes and multiplied by the activation's, one FMA. Zero points cost nothing in the loop: each
lane's accumulator starts at -z times its activation bytes' sum (the same for every row).

This file times that loop, `int8_row_dot` (an experiment here, not used by the engine: rounding the activations to 8
bits changes the numerics, so it could only be an opt-in accuracy level), against the engine's table kernel on the
same rows (int4 block 32, zero point 8, float32 scales; hidden 2048: Qwen3-30B-A3B's FC1 rows of 1,024 bytes), GB/s
of weights and scales, medians of --runs passes:
- l2: --rows rows (1,024: 1.3 MB, inside that Xeon's 2 MB L2 a core) again and again on one thread;
- dram: --matrices such matrices in turn (768: ~1 GB, more than that Xeon's 300 MiB L3), on 1 and on all threads.
It first checks the int8 loop against the exact dot product of the dequantised rows with the rounded activations
(float32 rounding only) and reports its error against the float activations.

With --codes 768 the rows are Qwen's FC2 rows (384 bytes): the table kernel's rate a byte there against FC1's rows tells
how much a row costs besides its chunks.

    python benchmarks/diag_int8_rows.py [--codes 2048] [--rows 1024] [--matrices 768] [--runs 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import llvmlite.ir as ir
import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  the engine's OpenMP wait default, set before Numba's runtime loads
from benchmarks.common import median_seconds  # noqa: E402
from kernels.cpu.simd import HAS_AVX512F, qrow_int4_16_lut_zrow  # noqa: E402
from kernels.cpu.threads import PRANGE_ONLY, use_threads  # noqa: E402

CODES = 2048  # codes a row unless --codes says otherwise (a multiple of 128: the loop reads 64 bytes at a time)
BLOCK = 32
ZERO = 8  # the int4 zero point (the QMoE default for unsigned 4-bit codes)

_F32, _I32, _I16, _I8, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8), ir.IntType(64)


def has_vnni() -> bool:
    """Whether the code Numba generates here may use AVX-512 VNNI (and AVX-512F, which the table kernel needs)."""
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    features = (config.CPU_FEATURES or get_host_cpu_features()).split(",")
    return HAS_AVX512F and "+avx512vnni" in features


@intrinsic
def int8_row_dot(typingctx, w, woff, groups, sc, soff, xe, xo, zinit, xscale):
    """Row dot product with int8 activations: sum over the row's `groups` groups of 64 bytes (4 blocks of 32 codes)
    of sc[soff + b] * xscale[lane] * sum_j (q_j - z) x_j, with the codes' low nibbles (even k) against xe and the high
    ones (odd k) against xo (int8, 64 bytes a group, from byte 0), each int32 lane starting at zinit[16 g + lane]
    (-z times the lane's 8 activation bytes) and scaled by xscale[16 g + lane] (its block's activation scale).
    w: uint8, woff its byte offset; sc: float32 block scales, soff the row's first."""
    if not all(isinstance(t, types.Integer) for t in (woff, groups, soff)):
        return None
    sig = types.float32(w, types.int64, types.int64, sc, types.int64, xe, xo, zinit, xscale)

    def codegen(context, builder, signature, args):
        w_, woff_, groups_, sc_, soff_, xe_, xo_, zinit_, xscale_ = args
        ptr = [context.make_array(signature.args[i])(context, builder, value=args[i]).data for i in (0, 3, 5, 6, 7, 8)]
        w_ptr, sc_ptr, xe_ptr, xo_ptr, zi_ptr, xs_ptr = ptr
        v64, i32x16, f32x16, f32x4 = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16),
                                      ir.VectorType(_F32, 4))
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32x16, [i32x16] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32x16, [f32x16] * 3), "llvm.fma.v16f32")
        nibble = ir.Constant(v64, [15] * 64)
        quad = ir.Constant(ir.VectorType(_I32, 16), [lane >> 2 for lane in range(16)])
        acc = cgutils.alloca_once_value(builder, ir.Constant(f32x16, [0.0] * 16))

        def vload(p, offset, vtype):
            return builder.load(builder.bitcast(builder.gep(p, [offset]), vtype.as_pointer()), align=1)

        with cgutils.for_range(builder, groups_) as loop:
            g = loop.index
            byte = builder.mul(g, ir.Constant(_I64, 64))
            codes = vload(w_ptr, builder.add(woff_, byte), v64)
            low = builder.and_(codes, nibble)
            shifted = builder.lshr(builder.bitcast(codes, ir.VectorType(_I16, 32)), ir.Constant(ir.VectorType(_I16, 32),
                                                                                                  [4] * 32))
            high = builder.and_(builder.bitcast(shifted, v64), nibble)
            lane = builder.mul(g, ir.Constant(_I64, 16))
            dots = vload(zi_ptr, lane, i32x16)
            dots = builder.call(dpbusd, [dots, builder.bitcast(low, i32x16),
                                         builder.bitcast(vload(xe_ptr, byte, v64), i32x16)])
            dots = builder.call(dpbusd, [dots, builder.bitcast(high, i32x16),
                                         builder.bitcast(vload(xo_ptr, byte, v64), i32x16)])
            scales4 = vload(sc_ptr, builder.add(soff_, builder.mul(g, ir.Constant(_I64, 4))), f32x4)
            scales = builder.shuffle_vector(scales4, ir.Constant(f32x4, ir.Undefined), quad)
            scales = builder.fmul(scales, vload(xs_ptr, lane, f32x16))
            builder.store(builder.call(fma, [builder.sitofp(dots, f32x16), scales, builder.load(acc)]), acc)
        v = builder.load(acc)
        n = 16
        while n > 1:  # horizontal sum
            h = n // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
            v, n = builder.fadd(lo, hi), h
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return sig, codegen


def quantise_activations(x: np.ndarray) -> tuple:
    """x (a row's floats) -> (xe, xo, zinit, xscale, xq): int8 per block of 32 (scale max|x| / 127), split into even and
    odd k as the packed bytes hold them; zinit = -ZERO times each int32 lane's 8 activation bytes; xscale each lane's
    block scale; xq the rounded activations as floats (their value, for the exact check)."""
    blocks = x.reshape(-1, BLOCK)
    scale = np.maximum(np.abs(blocks).max(axis=1), 1e-30) / 127.0
    q = np.clip(np.rint(blocks / scale[:, None]), -127, 127).astype(np.int8).reshape(-1)
    xe, xo = q[0::2].copy(), q[1::2].copy()
    lane_sums = (xe.astype(np.int32) + xo.astype(np.int32)).reshape(-1, 4).sum(axis=1)  # 4 bytes a lane
    zinit = (-ZERO * lane_sums).astype(np.int32)
    xscale = np.repeat(scale.astype(np.float32), BLOCK // 8)  # a block of 32 codes: 16 bytes, 4 lanes
    return xe, xo, zinit, xscale, (q.astype(np.float32).reshape(-1, BLOCK) * scale[:, None]).reshape(-1)


@njit(cache=False, nogil=True)
def int8_rows(w, sc, m, xe, xo, zinit, xscale, out):
    for n in range(w.shape[1]):
        out[n] = int8_row_dot(w, (m * w.shape[1] + n) * w.shape[2], w.shape[2] // 64, sc, (m * w.shape[1] + n)
                              * sc.shape[2], xe, xo, zinit, xscale)


@njit(parallel=PRANGE_ONLY, cache=False, nogil=True)
def int8_rows_parallel(w, sc, m, xe, xo, zinit, xscale, out):
    for n in prange(w.shape[1]):
        out[n] = int8_row_dot(w, (m * w.shape[1] + n) * w.shape[2], w.shape[2] // 64, sc, (m * w.shape[1] + n)
                              * sc.shape[2], xe, xo, zinit, xscale)


@njit(cache=False, nogil=True)
def table_rows(w, sc, m, zf, xa, xb, xs, out):
    for n in range(w.shape[1]):
        out[n] = qrow_int4_16_lut_zrow(w, (m * w.shape[1] + n) * w.shape[2], w.shape[2] // 16, 0, sc,
                                       (m * w.shape[1] + n) * sc.shape[2], 0, zf, 0, xa, xb, 0, xs, 0)


@njit(parallel=PRANGE_ONLY, cache=False, nogil=True)
def table_rows_parallel(w, sc, m, zf, xa, xb, xs, out):
    for n in prange(w.shape[1]):
        out[n] = qrow_int4_16_lut_zrow(w, (m * w.shape[1] + n) * w.shape[2], w.shape[2] // 16, 0, sc,
                                       (m * w.shape[1] + n) * sc.shape[2], 0, zf, 0, xa, xb, 0, xs, 0)


def dequantised(w: np.ndarray, sc: np.ndarray, m: int) -> np.ndarray:
    """Matrix m's rows as float32 [rows, codes]: (code - ZERO) * block scale, k = 2j from byte j's low nibble."""
    codes = np.empty((w.shape[1], 2 * w.shape[2]), np.float32)
    codes[:, 0::2] = w[m] & 15
    codes[:, 1::2] = w[m] >> 4
    return ((codes - ZERO).reshape(w.shape[1], -1, BLOCK) * sc[m][:, :, None]).reshape(codes.shape)


def check(w, sc, x) -> tuple[float, float, float]:
    """Largest errors relative to the largest |dot| of matrix 0: the int8 loop against the exact dot with the rounded
    activations and against the float activations; the engine's table kernel against the float activations."""
    xe, xo, zinit, xscale, xq = quantise_activations(x)
    out, table = np.empty(w.shape[1], np.float32), np.empty(w.shape[1], np.float32)
    int8_rows(w, sc, 0, xe, xo, zinit, xscale, out)
    table_rows(w, sc, 0, np.full(1, ZERO, np.float32), x[0::2].copy(), x[1::2].copy(),
               np.zeros(x.size // BLOCK, np.float32), table)
    rows = dequantised(w, sc, 0).astype(np.float64)
    exact, true = rows @ xq.astype(np.float64), rows @ x.astype(np.float64)
    worst = np.abs(true).max()
    return (float(np.abs(out - exact).max() / np.abs(exact).max()), float(np.abs(out - true).max() / worst),
            float(np.abs(table - true).max() / worst))


def median_gbs(run, nbytes: int, runs: int) -> float:
    return nbytes / median_seconds(run, runs) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--matrices", type=int, default=768)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--codes", type=int, default=CODES, help="codes a row (Qwen3-30B-A3B: FC1 2048, FC2 768)")
    args = parser.parse_args()
    K = args.codes
    if K <= 0 or K % 128:
        raise SystemExit(f"diag_int8_rows: --codes {K}: a positive multiple of 128")
    if not has_vnni():
        raise SystemExit("diag_int8_rows: this CPU has no AVX-512 VNNI (vpdpbusd), which the int8 loop is made of")
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, size=(args.matrices, args.rows, K // 2), dtype=np.uint8)
    sc = (rng.uniform(0.5, 1.5, size=(args.matrices, args.rows, K // BLOCK)) / np.sqrt(K)).astype(np.float32)
    x = rng.standard_normal(K).astype(np.float32)
    exact, true, table_error = check(w, sc, x)
    print(f"errors, of the largest |dot|: int8 loop against the exact dot of the rounded activations {exact:.1e}, "
          f"against the float activations {true:.1e}; the engine's table kernel against them {table_error:.1e}")
    xe, xo, zinit, xscale, _ = quantise_activations(x)
    xa, xb = x[0::2].copy(), x[1::2].copy()
    xs = np.zeros(K // BLOCK, np.float32)  # (the table kernel takes no activation sums)
    zf = np.full(1, ZERO, np.float32)
    out = np.empty(args.rows, np.float32)
    matrix_bytes = args.rows * (K // 2 + (K // BLOCK) * 4)
    threads = get_num_threads()
    print(f"rows of {K} int4 codes (block 32, float32 scales), {args.rows} rows a matrix "
          f"({matrix_bytes / 1e6:.1f} MB); GB/s of weights and scales, medians of {args.runs} passes")
    turn = iter(range(10 ** 9))
    flush = np.ones(100_000_000, np.float32)  # 400 MB read before each DRAM figure: the matrices written last leave L3
    for label, count, n_threads in (("l2, 1 thread", 1, 1), ("dram, 1 thread", args.matrices, 1),
                                    (f"dram, {threads} threads", args.matrices, threads)):
        use_threads(n_threads)
        one, many = (int8_rows, table_rows) if n_threads == 1 else (int8_rows_parallel, table_rows_parallel)
        one(w, sc, 0, xe, xo, zinit, xscale, out)  # compiled before the clock starts
        many(w, sc, 0, zf, xa, xb, xs, out)
        span = min(count, args.matrices)
        if span > 1:
            flush.sum()
        passes = max(1, args.runs if span == 1 else span // 4)
        int8 = median_gbs(lambda: one(w, sc, next(turn) % span, xe, xo, zinit, xscale, out), matrix_bytes, passes)
        table = median_gbs(lambda: many(w, sc, next(turn) % span, zf, xa, xb, xs, out), matrix_bytes, passes)
        print(f"{label:>18}: int8 dot products {int8:6.1f} GB/s | engine's table kernel {table:6.1f} GB/s | "
              f"{int8 / table:.2f}x", flush=True)


if __name__ == "__main__":
    main()
