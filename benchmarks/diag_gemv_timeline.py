"""Diagnosis: a timeline of one CPU decode call inside moe_gemv, per thread (issue #4 / #3).

diag_cpu_fixed.py showed on the H200 machine's Xeon that moe_gemv on one expert of the Qwen3-30B-A3B-like node costs
~95 µs at 16 threads where its 2.96 MB at the threads' own rate would take ~35: a fixed ~60 µs appears between 4 and
8 threads. Here a copy of moe_gemv (below: the same body, with cycle-counter stamps added) is called on the arguments
the real run_experts passes, and per call it records: the prologue (before the parallel region), each thread's
arrival in the region, the end of its FC1 share, the end of its FC2 share (which includes waiting for FC1 to finish),
and the epilogue (the reduction). Printed: medians over --runs calls of each phase's first and last thread, µs from
the call's start.

    python benchmarks/diag_gemv_timeline.py [--threads 16,8,4] [--experts 1,2,8] [--runs 300]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.diag_cpu_fixed import node_of_shape_b  # noqa: E402
from kernels.cpu import kernels as compiled  # noqa: E402
from kernels.cpu.kernels import (ACT_SWIGLU, _claim_init, _gemv_fc1_thread, _gemv_fc2_thread,  # noqa: E402
                                 _lane_sum_stride, _lane_sums, _split_row, _x_width)
from kernels.cpu.threads import PRANGE_ONLY, use_threads  # noqa: E402


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (llvm.readcyclecounter)."""
    def codegen(context, builder, sig, args):
        read = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                              "llvm.readcyclecounter")
        return builder.call(read, [])
    return types.int64(), codegen


@njit
def now_cycles():
    return cycles()


# A copy of kernels.cpu.kernels.moe_gemv (same body; its docstring there) with stamps: [0] the call (start, region
# start, end), [1 + th] thread th (arrival, FC1 done, FC2 done).
@njit(parallel=PRANGE_ONLY, fastmath=True, cache=False, nogil=True)
def traced_gemv(w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2, x, experts, pair_off, src, coef, dst,
             act_kind, fusion, alpha, beta, limit, has_limit, pf_rows, chunk_bytes, order, ws, y, out,
             do_reduce, nth, stamps):
    stamps[0, 0] = cycles()
    E1, N1, Kb1 = w1.shape
    E2, H, Kb2 = w2.shape
    T, Hx = x.shape
    P = src.shape[0]
    U = experts.shape[0]
    # inputs of FC2 (int3 rows end in padding bits: I from FC1's rows, 2 I for swiglu, I otherwise)
    I = w2.shape[2] * (8 // q2[2]) if q2[2] != 3 else (w1.shape[1] // 2 if act_kind == ACT_SWIGLU else w1.shape[1])
    skind1, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, hb1 = q1[0], q1[1], q1[2], q1[3], q1[4], q1[5], q1[6], q1[7]
    skind2, zmode2, bits2, nb2, chunk2, cshift2, nchunk2, hb2 = q2[0], q2[1], q2[2], q2[3], q2[4], q2[5], q2[6], q2[7]
    fmt1, bpc1, fmt2, bpc2 = q1[8], q1[9], q2[8], q2[9]
    xw1 = _x_width(bits1, Kb1, q1[6])
    xw2 = _x_width(bits2, Kb2, q2[6])
    # scratch: x rows (deduplicated tokens) split for fc1, activations split for fc2
    rowmap = np.full(T, -1, np.int64)
    nrows = 0
    for p in range(P):
        if rowmap[src[p]] < 0:
            rowmap[src[p]] = nrows
            nrows += 1
    o = 0
    xa1 = ws[o:o + nrows * xw1].reshape(nrows, xw1)
    o += nrows * xw1
    xb1 = ws[o:o + nrows * Kb1].reshape(nrows, Kb1)
    o += nrows * Kb1
    xs1 = ws[o:o + nrows * nchunk1].reshape(nrows, nchunk1)
    o += nrows * nchunk1
    aa = ws[o:o + P * xw2].reshape(P, xw2)
    o += P * xw2
    ab = ws[o:o + P * Kb2].reshape(P, Kb2)
    o += P * Kb2
    xs2 = ws[o:o + P * nchunk2].reshape(P, nchunk2)
    lanes1 = _lane_sum_stride(bits1, zmode1, bpc1, Kb1, nchunk1)
    lanes2 = _lane_sum_stride(bits2, zmode2, bpc2, Kb2, nchunk2)
    for t in range(T):
        if rowmap[t] >= 0:
            _split_row(x, t, bits1, chunk1, nchunk1, fmt1, xa1, xb1, xs1, rowmap[t])
            _lane_sums(xa1, rowmap[t], lanes1)
    if bits1 == 8:
        xb1 = xa1
    if bits2 == 3:  # FC2's padding positions (codes past I) must read as 0
        for p in range(P):
            for j in range(xw2):
                aa[p, j] = np.float32(0.0)
    if bits2 == 8:  # FC1 writes int8 activations into aa only; FC2's kernels read them as both streams
        ab = aa
    swiglu = act_kind == ACT_SWIGLU
    G = I
    a_ = np.float32(alpha)
    b_ = np.float32(beta)
    l_ = np.float32(limit)
    zdef1 = np.float32(1 << (bits1 - 1))
    zdef2 = np.float32(1 << (bits2 - 1))
    zrb1 = (nb1 * bits1 + 7) // 8
    zrb2 = (nb2 * bits2 + 7) // 8
    # work handed out in chunks of packed rows through atomic counters: a thread that is descheduled or slowed
    # (SMT sibling, other tenants) does not hold up the whole region
    rpg = 2 if swiglu else 1
    ch1 = max(1, chunk_bytes // (rpg * (Kb1 + nb1 * sc1.itemsize)))
    nck1 = (U * G + ch1 - 1) // ch1
    ch2 = max(1, chunk_bytes // (Kb2 + nb2 * sc2.itemsize))
    nck2 = (U * H + ch2 - 1) // ch2
    cnt1 = np.zeros(8 * nth, np.int64)
    cnt2 = np.zeros(8 * nth, np.int64)
    _claim_init(cnt1, nck1, nth, order)
    _claim_init(cnt2, nck2, nth, order)
    done = np.zeros(8 * U, np.int64)  # per expert, 64 bytes apart: FC1 groups finished (see _gemv_fc1_thread)
    # per-thread scratch (zero points, _claim state): rows of arrays made here (the thread loops allocate nothing)
    zs = np.empty((nth, 2 * nb1 + nb2), np.float32)
    vics = np.empty((nth, 8), np.int64)
    stamps[0, 1] = cycles()
    for th in prange(nth):
        stamps[th + 1, 0] = cycles()
        _gemv_fc1_thread(w1, sc1, zp1, b1, skind1, zmode1, bits1, nb1, chunk1, cshift1, nchunk1, fmt1, bpc1, aux1, hb1,
                         zrb1, zdef1, experts, pair_off, src, rowmap, xa1, xb1, xs1, aa, ab, xs2, bits2, chunk2, nchunk2,
                         fmt2, lanes2, G, I, swiglu, fusion, act_kind, a_, b_, l_, has_limit, pf_rows, done, cnt1, th,
                         nth, nck1, ch1, order, zs[th, :nb1], zs[th, nb1:2 * nb1], vics[th])
        stamps[th + 1, 1] = cycles()
        _gemv_fc2_thread(w2, sc2, zp2, b2, skind2, zmode2, bits2, nb2, chunk2, cshift2, nchunk2, fmt2, bpc2, aux2, hb2,
                         zrb2, zdef2, experts, pair_off, coef, aa, ab, xs2, y, G, pf_rows, done, cnt2, th, nth, nck2,
                         ch2, order, zs[th, 2 * nb1:], vics[th])
        stamps[th + 1, 2] = cycles()
    if do_reduce:
        for p in range(P):
            d = dst[p]
            for h in range(H):
                out[d, h] += y[p, h]
    stamps[0, 2] = cycles()


def cycles_per_us() -> float:
    now_cycles()  # compiled before the clock starts
    started, c0 = time.perf_counter(), now_cycles()
    time.sleep(0.2)
    return (now_cycles() - c0) / ((time.perf_counter() - started) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="16,8,4")
    parser.add_argument("--experts", default="1,2,8")
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    node = node_of_shape_b()
    rate = cycles_per_us()
    H = node.spec.hidden_size
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    out = np.zeros((1, H), np.float32)
    real = compiled.moe_gemv
    print(f"µs from the call's start, medians of {args.runs} calls (time-stamp counter: {rate:.0f} per µs)")
    for threads in [int(t) for t in args.threads.split(",")]:
        node.num_threads = threads
        use_threads(threads)
        for u in [int(e) for e in args.experts.split(",")]:
            captured = []
            compiled.moe_gemv = lambda *a: captured.append(a)
            node.run_experts(x, np.arange(u, dtype=np.int64).reshape(1, u), np.full((1, u), 1.0 / u, np.float32),
                             out=out)
            compiled.moe_gemv = real
            stamps = np.zeros((threads + 1, 3), np.int64)
            rows = []
            for _ in range(args.runs + 5):
                traced_gemv(*captured[0], stamps)
                call, per_thread = stamps[0], stamps[1:] - stamps[0, 0]
                rows.append([call[1] - call[0], per_thread[:, 0].min(), per_thread[:, 0].max(),
                             per_thread[:, 1].min(), per_thread[:, 1].max(), per_thread[:, 2].min(),
                             per_thread[:, 2].max(), call[2] - call[0]])
            m = np.median(np.array(rows[5:], np.float64), axis=0) / rate
            print(f"{threads:3d} threads, {u} experts: prologue {m[0]:6.1f}  arrive {m[1]:6.1f}-{m[2]:6.1f}  "
                  f"FC1 done {m[3]:6.1f}-{m[4]:6.1f}  FC2 done {m[5]:6.1f}-{m[6]:6.1f}  end {m[7]:6.1f}", flush=True)


if __name__ == "__main__":
    main()
