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

Two loops. `run_host_parts` is one thread that calls the fused decode kernel (moe_gemv) for each job: a fork and join
of the kernel's threads every layer, and the job's set-up (its pairs, x as float32, FC1's inputs) on one thread while
the others wait. `run_host_parts_team` keeps the kernel's threads in one parallel region for as long as jobs come:
every member waits for the routing itself, sets up its own copy of the job's inputs, and takes chunks of the job's
rows (kernels.gemv_member); the last member out of a job sums the pairs into the block, raises the gate and readies
the shared counters for the next job. Its members must each run on a thread of their own (they wait for one
another): where the threading layer gives two members one thread, the team does not assemble and the caller runs
`run_host_parts` instead.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kernels.cpu.kernels import (gemv_fc1_inputs, gemv_fc2_inputs, gemv_member, gemv_rows,
                                 group_pairs, moe_gemv, reduce_pairs)
from kernels.cpu.simd import atomic_compare_exchange, atomic_fetch_add
from kernels.cpu.threads import PRANGE_ONLY

# counters' slots
QUEUED, DONE, CANCEL, FAILED = 0, 1, 2, 3
# times' columns, per job: the loop reached the job, found its routing published, raised its gate; pairs computed
T_REACHED, T_ROUTED, T_GATED, PAIRS = 0, 1, 2, 3

# the team's shared slots (64 bytes apart): jobs announced by member 0 (STOP: no more), members out of jobs so far,
# the job the shared counters are ready for, members arrived, and whether the team assembled (GO) or not
ANNOUNCED, LEFT, READY, ARRIVED, DECISION = 0, 8, 16, 24, 32
STOP, GO, NOT_ASSEMBLED = -1, 1, 2
ASSEMBLE_CYCLES = 100_000_000  # how long members wait for the others at the start (~30-50 ms of time-stamp counter)

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


@njit(nogil=True, cache=True, error_model="numpy")
def _cpu_part(layer, params, pair_ids, x32, ws, y):
    """The CPU's pairs of one published step (on_cpu != 0) into the block's part, zeroed first; returns the pairs,
    -1 for an expert id out of range."""
    (flag, gate, ids, on_cpu, w, x, part, weights, activation) = layer
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
    pairs = pair_off[small]
    if pairs == 0:
        return 0
    copy_x(x, x32, tokens)
    # do_reduce is true, but not the constant True: Numba types a constant argument of a call from compiled code as
    # its literal (Literal[bool](True)), and would compile moe_gemv a second time for this caller (~30-60 s a scales'
    # type on a cold cache) beside the bool one CpuQMoE's Python calls use
    reduce = pairs > 0
    moe_gemv(w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2, x32[:tokens], experts[:small],
             pair_off[:small + 1], tok[:pairs], pw[:pairs], tok[:pairs], act_kind, fusion, alpha, beta, limit,
             has_limit, prefetch_rows, chunk_bytes, order, ws[:pairs * ws_per_pair],
             y[:pairs * x.shape[1]].reshape(pairs, x.shape[1]), part, reduce, threads)
    return pairs


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


@njit(parallel=PRANGE_ONLY, nogil=True, cache=True, error_model="numpy")
def run_host_parts_team(layers, params, jobs, counters, times, pair_ids, x32, ws, shared_ws, y, idle_cycles,
                        nth) -> int:
    """run_host_parts on a team of nth threads in one parallel region (the module's docstring): member th works with
    pair_ids[th], x32[th] and ws[th]; shared_ws holds FC1's outputs, y the pairs' outputs. Returns the jobs done, or
    -1 where the team did not assemble (two members on one thread: nothing was done)."""
    first = load_acquire(counters, DONE)
    if load_acquire(counters, CANCEL) != 0:  # (no parallel region: the caller's thread keeps no OpenMP pool for it)
        return first
    team = np.zeros(40, np.int64)
    team[ANNOUNCED] = first
    team[READY] = first
    cnt1 = np.zeros(8 * nth, np.int64)
    cnt2 = np.zeros(8 * nth, np.int64)
    done = np.zeros(8 * pair_ids.shape[1] * pair_ids.shape[2], np.int64)  # per expert of a job (see gemv_member)
    shared_ws[:] = 0.0
    for th_loop in prange(nth):
        th = np.int64(th_loop)  # (int64: see moe_gemv)
        _team_member(layers, params, jobs, counters, times, team, cnt1, cnt2, done, pair_ids[th], x32[th], ws[th],
                     shared_ws, y, idle_cycles, th, nth, first)
    if team[DECISION] != GO:
        return -1
    return load_acquire(counters, DONE)


@njit(nogil=True, cache=True, error_model="numpy")
def _team_member(layers, params, jobs, counters, times, team, cnt1, cnt2, done, pair_ids, x32, ws, shared_ws, y,
                 idle_cycles, th, nth, first):
    """One member's loop: every job from `first` on, until member 0 announces STOP (idle, or CANCEL), a wait sees
    CANCEL, or a job's expert id is out of range (member 0 sets FAILED)."""
    if not _assembled(team, nth):
        return
    capacity = jobs.shape[0]
    n = first
    idle_from = cycles()
    while True:
        if th == 0:
            if not _announce(counters, team, n, idle_from, idle_cycles):
                return
        elif not _announced(counters, team, n):
            return
        slot = n % capacity
        index, launch = jobs[slot, 0], jobs[slot, 1]
        layer = layers[index]
        if th == 0:
            times[slot, T_REACHED] = cycles()
        while load_acquire(layer[0], 0) != launch:
            if load_acquire(counters, CANCEL) != 0:
                return
            spin_pause()
        if th == 0:
            times[slot, T_ROUTED] = cycles()
        pairs = _member_job(layer, params[index], counters, times, team, cnt1, cnt2, done, pair_ids, x32, ws,
                            shared_ws, y, th, nth, first, n, slot, launch)
        if pairs < 0:
            if pairs == -1 and th == 0:
                store_release(counters, FAILED, n + 1)
            return
        n += 1
        idle_from = cycles()


@njit(nogil=True, cache=True, error_model="numpy")
def _assembled(team, nth) -> bool:
    """Whether all nth members came (each on a thread of its own) within ASSEMBLE_CYCLES; every member gets the
    same answer."""
    atomic_fetch_add(team, ARRIVED, 1)
    start = cycles()
    while load_acquire(team, DECISION) == 0:
        if load_acquire(team, ARRIVED) >= nth:
            atomic_compare_exchange(team, DECISION, 0, GO)
        elif cycles() - start > ASSEMBLE_CYCLES:
            atomic_compare_exchange(team, DECISION, 0, NOT_ASSEMBLED)
        else:
            spin_pause()
    return load_acquire(team, DECISION) == GO


@njit(nogil=True, cache=True, error_model="numpy")
def _announce(counters, team, n, idle_from, idle_cycles) -> bool:
    """Member 0: job n announced once queued; STOP after idle_cycles without one, or on CANCEL."""
    while True:
        if load_acquire(counters, CANCEL) != 0 or cycles() - idle_from > idle_cycles:
            store_release(team, ANNOUNCED, STOP)
            return False
        if load_acquire(counters, QUEUED) > n:
            store_release(team, ANNOUNCED, n + 1)
            return True
        spin_pause()


@njit(nogil=True, cache=True, error_model="numpy")
def _announced(counters, team, n) -> bool:
    """The other members: whether job n was announced (False: STOP, or CANCEL)."""
    while True:
        announced = load_acquire(team, ANNOUNCED)
        if announced == STOP or load_acquire(counters, CANCEL) != 0:
            return False
        if announced > n:
            return True
        spin_pause()


# fastmath as moe_gemv: the set-up inlined here (gemv_fc1_inputs' per-chunk sums) then adds in moe_gemv's order, and
# a member's part equals the forked loop's bit for bit
@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def _member_job(layer, params, counters, times, team, cnt1, cnt2, done, pair_ids, x32, ws, shared_ws, y, th, nth,
                first, n, slot, launch):
    """One member's share of job n, whose routing is published: its own copy of the job's pairs and FC1's inputs,
    then chunks of the job's rows once the shared counters are ready for it; the last member out finishes the job.
    Returns the job's pairs, -1 for an expert id out of range, -2 on CANCEL."""
    (flag, gate, ids, on_cpu, w, x, part, weights, activation) = layer
    w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2 = weights
    act_kind, fusion, alpha, beta, limit, has_limit = activation
    # not params[4], the chunk order: members claim from one shared counter (order 0), which a zeroed counter starts;
    # own spans (order 1) start each thread's counter at its span, which needs the job's chunks counted first
    num_experts, small_max, prefetch_rows, chunk_bytes = params[0], params[1], params[2], params[3]
    tokens, k = ids.shape
    for t in range(tokens):
        for j in range(k):
            pair_ids[t, j] = ids[t, j] if on_cpu[t, j] != 0 else -1
    experts, pair_off, tok, pw, small, bad, _tpair = group_pairs(pair_ids[:tokens], w[:tokens], num_experts,
                                                                 small_max)
    if bad:
        return -1
    pairs = pair_off[small]
    hidden = x.shape[1]
    # job n - 1 finished and the counters zeroed: a member that left it may be here before the last one is out (the
    # GPU publishes this routing after job n - 1's gate; only a merge that gave up publishes it sooner)
    while load_acquire(team, READY) < n:
        if load_acquire(counters, CANCEL) != 0:
            return -2
        spin_pause()
    fc2_used = 0
    if pairs > 0:
        copy_x(x, x32, tokens)
        rowmap, nrows = gemv_rows(tok[:pairs], tokens)
        xa1, xb1, xs1, _fc1_used = gemv_fc1_inputs(x32[:tokens], rowmap, nrows, w1, q1, ws)
        aa, ab, xs2, fc2_used = gemv_fc2_inputs(pairs, w2, q2, shared_ws)
        gemv_member(w1, sc1, zp1, q1, b1, aux1, w2, sc2, zp2, q2, b2, aux2, experts[:small], pair_off[:small + 1],
                    tok[:pairs], pw[:pairs], rowmap, xa1, xb1, xs1, aa, ab, xs2, y[:pairs * hidden].reshape(pairs,
                    hidden), act_kind, fusion, alpha, beta, limit, has_limit, prefetch_rows, chunk_bytes, 0, done,
                    cnt1, cnt2, np.empty(2 * q1[3] + 2 * q2[3], np.float32), np.empty(1, np.int64), th, nth)
    if atomic_fetch_add(team, LEFT, 1) + 1 == nth * (n - first + 1):  # the last member out of job n
        part[:tokens] = 0.0
        if pairs > 0:
            reduce_pairs(y[:pairs * hidden].reshape(pairs, hidden), tok[:pairs], part)
        store_release(gate, 0, launch)
        times[slot, T_GATED] = cycles()
        times[slot, PAIRS] = pairs
        store_release(counters, DONE, n + 1)
        cnt1[:] = 0
        cnt2[:] = 0
        done[:8 * small] = 0
        # FC2's inputs this job wrote back to zero: int3's padding positions must read 0 in the next job's, wherever
        # its pairs put them (clear_fc2_padding)
        shared_ws[:fc2_used] = 0.0
        store_release(team, READY, n + 1)
    return pairs


def new_counters() -> np.ndarray:
    return np.zeros(4, np.int64)
