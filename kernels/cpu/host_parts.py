"""The CPU's parts of a decode step's "both" layers in one compiled loop that never holds the GIL.

Decode path "both" (engine/offload/hybrid_node.py): per layer the GPU routes the step, publishes the routing to
page-locked host memory and raises a flag there (kernels/gpu/published.py); the CPU computes its share of the cold
pairs into the block's `part` and raises the gate, which a merge queued on the GPU waits for. Done on the engine's
thread, that host part sits between the host's Python for the layer and for the next one, so a layer costs the
Python plus the CPU's part. Done here, on a thread of its own, it runs beside the Python: a worker thread calls
`run_host_parts` once and stays in compiled code from job to job and from step to step (a Python worker would need
the GIL at every call and return, and lost to the serial order on the H200: RESULTS.md thirty-second session).

The engine's thread hands jobs over through plain arrays: `jobs[n % capacity] = (layer, launch number)`, then
`counters[QUEUED] = n + 1`; the loop publishes `counters[DONE]`. x86 keeps stores in order, and the loop reads the
counters and the flags with acquire loads (llvm's atomic loads: a plain load in a spin loop may be hoisted out).
Times are the CPU's time-stamp counter (`cycles`), converted by the caller.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kernels.cpu.kernels import group_pairs, moe_gemv
from kernels.cpu.numba_cache import calls_parallel

# counters' slots
QUEUED, DONE, CANCEL, FAILED = 0, 1, 2, 3
# times' columns, per job: the loop reached the job, found its routing published, raised its gate; pairs computed
T_REACHED, T_ROUTED, T_GATED, PAIRS = 0, 1, 2, 3

# x86-64: the time-stamp counter and the spin-wait hint this loop relies on
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def load_acquire(typingctx, array, index):
    """array[index] read with an acquire load (1-D integer arrays)."""
    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        view = context.make_array(array_type)(context, builder, args[0])
        at = context.cast(builder, args[1], index_type, types.intp)
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [at])
        return builder.load_atomic(pointer, "acquire", array_type.dtype.bitwidth // 8)
    return array.dtype(array, index), codegen


@intrinsic
def store_release(typingctx, array, index, value):
    """array[index] = value with a release store (1-D integer arrays)."""
    def codegen(context, builder, signature, args):
        array_type, index_type, value_type = signature.args
        view = context.make_array(array_type)(context, builder, args[0])
        at = context.cast(builder, args[1], index_type, types.intp)
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [at])
        stored = context.cast(builder, args[2], value_type, array_type.dtype)
        builder.store_atomic(stored, pointer, "release", array_type.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(array, index, value), codegen


@intrinsic
def cycles(typingctx):
    """The time-stamp counter (llvm.readcyclecounter: rdtsc on x86-64)."""
    def codegen(context, builder, signature, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                  "llvm.readcyclecounter")
        return builder.call(function, [])
    return types.int64(), codegen


@intrinsic
def spin_pause(typingctx):
    """x86's pause: a spin-wait loop leaves the core's other thread and the memory system alone."""
    def codegen(context, builder, signature, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []), "pause", "", [], side_effect=True)
        return context.get_dummy_value()
    return types.none(), codegen


def copy_x(x, x32, tokens):
    """x32[:tokens] = x[:tokens] as float32; x float32, or float16 as its bits (uint16: Numba has no float16)."""


@overload(copy_x)
def _copy_x(x, x32, tokens):
    if x.dtype == types.uint16:
        def from_half(x, x32, tokens):
            bits = x32.view(np.uint32)
            for t in range(tokens):
                for h in range(x.shape[1]):
                    half = np.uint32(x[t, h])
                    sign, exponent, mantissa = (half & 0x8000) << 16, (half >> 10) & 0x1F, half & 0x3FF
                    if exponent == 0:  # zero or subnormal: mantissa x 2^-24
                        x32[t, h] = np.float32(mantissa) * np.float32(5.9604645e-08)
                        if sign:
                            x32[t, h] = -x32[t, h]
                    elif exponent == 0x1F:  # inf / NaN
                        bits[t, h] = sign | 0x7F800000 | (mantissa << 13)
                    else:
                        bits[t, h] = sign | ((exponent + 112) << 23) | (mantissa << 13)
        return from_half

    def from_float(x, x32, tokens):
        x32[:tokens] = x[:tokens]
    return from_float


@njit(nogil=True, cache=True, error_model="numpy")
def read_cycles() -> int:
    return cycles()


@calls_parallel
@njit(nogil=True, cache=True, error_model="numpy")
def _cpu_part(layer, params, pair_ids, x32, ws, y):
    """The CPU's pairs of one published step (on_cpu != 0) into the block's part, zeroed first; returns the pairs,
    -1 for an expert id out of range. A pair whose on_cpu is r + 1 > 1 is the CPU's part of a pair split with the GPU:
    its expert's intermediate rows from r on (spans: [0, I) for every expert between calls)."""
    (flag, gate, ids, on_cpu, w, x, part, spans, weights, activation) = layer
    w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2 = weights
    act_kind, fusion, alpha, beta, limit, has_limit = activation
    num_experts, small_max, prefetch_rows, chunk_bytes = params[0], params[1], params[2], params[3]
    order, threads, ws_per_pair = params[4], params[5], params[6]
    tokens, k = ids.shape
    for t in range(tokens):
        for j in range(k):
            pair_ids[t, j] = ids[t, j] if on_cpu[t, j] != 0 else -1
    part[:tokens] = 0.0
    experts, pair_off, tok, pw, small, bad, _tpair = group_pairs(pair_ids[:tokens], w[:tokens], num_experts,
                                                                 small_max)
    if bad:
        return -1
    for t in range(tokens):
        for j in range(k):
            if on_cpu[t, j] > 1:
                spans[ids[t, j], 0] = on_cpu[t, j] - 1
    pairs = pair_off[small]
    if pairs == 0:
        return 0
    copy_x(x, x32, tokens)
    # do_reduce is true, but not the constant True: Numba types a constant argument of a call from compiled code as
    # its literal (Literal[bool](True)), and would compile moe_gemv a second time for this caller (~30-60 s a scales'
    # type on a cold cache) beside the bool one CpuQMoE's Python calls use
    reduce = pairs > 0
    moe_gemv(w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2, x32[:tokens], experts[:small],
             pair_off[:small + 1], tok[:pairs], pw[:pairs], tok[:pairs], spans, act_kind, fusion, alpha, beta, limit,
             has_limit, prefetch_rows, chunk_bytes, order, ws[:pairs * ws_per_pair],
             y[:pairs * x.shape[1]].reshape(pairs, x.shape[1]), part, reduce, threads)
    for t in range(tokens):
        for j in range(k):
            if on_cpu[t, j] > 1:
                spans[ids[t, j], 0] = 0
    return pairs


@calls_parallel
@njit(nogil=True, cache=True, error_model="numpy")
def run_host_parts(layers, params, jobs, counters, times, pair_ids, x32, ws, y, idle_cycles) -> int:
    """Jobs in order from counters[DONE] until none came for `idle_cycles` or counters[CANCEL] is set; returns the
    jobs done. A job waits for its layer's routing (flag == its launch number), computes the CPU's part into the
    block and raises the gate to the launch number. A bad expert id leaves the gate down and sets counters[FAILED]
    to the job's number + 1 (the caller raises the gates of that job and of those after it)."""
    capacity = jobs.shape[0]
    done = load_acquire(counters, DONE)
    idle_from = cycles()
    while True:
        if load_acquire(counters, CANCEL) != 0:
            return done
        if load_acquire(counters, QUEUED) <= done:
            if cycles() - idle_from > idle_cycles:
                return done
            spin_pause()
            continue
        slot = done % capacity
        index, launch = jobs[slot, 0], jobs[slot, 1]
        layer = layers[index]
        flag, gate = layer[0], layer[1]
        times[slot, T_REACHED] = cycles()
        cancelled = False
        while load_acquire(flag, 0) != launch:
            if load_acquire(counters, CANCEL) != 0:
                cancelled = True
                break
            spin_pause()
        if cancelled:
            return done
        times[slot, T_ROUTED] = cycles()
        pairs = _cpu_part(layer, params[index], pair_ids, x32, ws, y)
        if pairs < 0:
            store_release(counters, FAILED, done + 1)
            return done
        store_release(gate, 0, launch)
        times[slot, T_GATED] = cycles()
        times[slot, PAIRS] = pairs
        done += 1
        store_release(counters, DONE, done)
        idle_from = cycles()


def new_counters() -> np.ndarray:
    return np.zeros(4, np.int64)
