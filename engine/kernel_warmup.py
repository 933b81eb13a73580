"""The CPU expert kernels compiled before a timed run, so that a measurement does not carry their compilation.

Numba compiles a CPU kernel at its first call for each argument type and keeps the machine code in its cache
(kernels/cpu/numba_cache.py). On a machine's first run, or after an upgrade of the kernels, the first answer would
wait for that: on the 2-core dev VM a first generation on the demo model took 47 s to its first token against 0.4 s
once compiled, and a resource record made then would say so. warm_cpu_kernels runs each distinct kernel of a model
once on a decode-sized and a prefill-sized input (zeros, routed to the first k experts) before the timed part starts;
with the cache warm it costs milliseconds. It touches no model state: the kernels are called directly, not the
decoder or the offload engine.

The offload engine's own compiled bookkeeping (engine/offload/step_pairs.py, placement.py, host_copy.py) is warmed
the same way, on tiny arrays of the types a decode step passes: on a first run a simulated-GPU record's first token
otherwise took 1.26 s against 0.40 (the dev VM), and even from a warm cache each function's first call in a process
loads it (tests/test_kernel_warmup.py checks that a record's timed part makes no first call).
"""

from __future__ import annotations

import threading
import time

import numpy as np


def _warm(kernel) -> None:
    spec = kernel.spec
    # the prefill path computes an expert with more than gemv_max_rows tokens by its GEMM kernels: every token goes to
    # the same k experts, so that one call reaches them
    for tokens in (1, max(kernel.gemv_max_rows, kernel.decode_max_tokens) + 1):
        logits = np.zeros((tokens, spec.num_experts), np.float32)
        logits[:, :spec.k] = np.arange(spec.k, 0, -1, dtype=np.float32)
        kernel.forward(np.zeros((tokens, spec.hidden_size), np.float32), logits)


def warm_model(model) -> float:
    """Everything a loaded model's steps call that compiles at its first call (its CPU kernels, the offload engine's
    bookkeeping where it has one, the host-part worker's loop), run once before a timed run or the first answer;
    returns the seconds it took."""
    started = time.perf_counter()
    # the CPU kernels run on the model's first experts, read from the mapped file: past the end of one cut short since
    # the load, a read kills the process (SIGBUS); a record's run on the loaded model gets here before any answer
    model.folder.onnx.check_mapped_files()
    _first_calls_apart(distinct_cpu_kernels(model.decoder.steps), model.offload is not None,
                       model.decoder.host_part_loops())
    return time.perf_counter() - started


def _first_calls_apart(kernels: list, bookkeeping: bool, loops: list) -> None:
    """The first calls made on a thread of their own, which holds the kernels alone, this one waiting for it.

    Numba's compiler keeps some of the errors it recovers from (typing and lowering fallbacks) in its caches, with their
    tracebacks, whose frames link to their callers' frames: made on the caller's thread they held warm_model's frame and
    its callers', and so the model, for as long as the process lived. A model dropped then kept its CUDA device and its
    slots' memory (the GPU tests' drop test after a process's first compile; the dev VM with an empty Numba cache).
    On a thread of its own, the frames end at that thread's start."""
    from engine.offload.host_part_worker import compile_loop

    failed = []

    def first_calls() -> None:
        try:
            for kernel in kernels:
                _warm(kernel)
            if bookkeeping:
                warm_offload_bookkeeping()
            for kernel, x_dtype in loops:
                compile_loop(kernel, x_dtype)
        except BaseException as exc:  # raised on the caller's thread, as if it had made the calls
            failed.append(exc)

    thread = threading.Thread(target=first_calls, name="kernel-first-calls")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def warm_offload_bookkeeping() -> None:
    """Each compiled function of the offload engine's steps called once, with the argument types the hybrid node,
    the placement and the host copies pass (a signature of other types would compile again at its first call)."""
    from engine.offload.host_copy import _take_rows
    from engine.offload.placement import AdaptivePlacement, LayerSlots, _observe, _spare_slots
    from engine.offload.step_pairs import classify_pairs, count_routed, split_pairs, take_copied
    from engine.offload.swap_judge import SwapJudge

    experts = 4
    ids = np.array([[0, 2]], np.int32)  # route(): int32 [tokens, k]
    slot_of = np.array([0, -1, -1, -1], np.int32)
    expert_in = np.array([0], np.int32)
    counts = np.zeros(2 * experts, np.int64)[:experts]
    scores, watch = np.zeros(experts), np.zeros(experts)
    classify_pairs(ids, slot_of, counts, True)
    cold = np.where(slot_of[ids] < 0, ids, -1).astype(np.int32)
    take_copied(ids, cold, np.array([2], np.int64))
    count_routed(ids, counts)
    split_pairs(ids, np.zeros(ids.shape, bool), slot_of, counts, True)
    _observe(scores, ids.reshape(-1), 0.9, True, watch)
    _spare_slots(scores, slot_of, expert_in, np.zeros(experts, bool), ids.reshape(-1), 1, 1)
    # rebalance (its compiled loop over the layers, with a paused judge's pass, and the judge's), through a policy:
    # the numba typed Lists it passes take ~0.1 s to set up in a process
    placement = AdaptivePlacement([LayerSlots(experts, 1)], judge=SwapJudge([experts]))
    placement.judge.paused = True
    placement.observe(0, ids.reshape(-1))
    placement.rebalance(1)
    _take_rows(np.zeros((2, 8), np.uint8), np.array([1], np.int64), np.zeros((1, 8), np.uint8))


def warm_cpu_kernels(runners) -> float:
    """Each distinct CPU expert kernel among `runners` (the decoder's steps: anything with a `kernel`) run once for a
    decode step and once for a prefill; returns the seconds it took (its compilation's, on a cold cache)."""
    started = time.perf_counter()
    for kernel in distinct_cpu_kernels(runners):
        _warm(kernel)
    return time.perf_counter() - started


def distinct_cpu_kernels(runners) -> list:
    """One CPU expert kernel of each kind (compiled_for) among `runners`' kernels."""
    kernels = {}
    for runner in runners:
        kernel = getattr(runner, "kernel", None)
        if kernel is not None and hasattr(kernel, "compiled_for"):
            kernels.setdefault(kernel.compiled_for, kernel)
    return list(kernels.values())
