"""kernels.cpu.threads.use_threads: Numba's thread count per calling thread, set only when it changes."""
from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from numba import njit, prange

from kernels.cpu import CpuQMoE
from kernels.cpu.threads import use_threads
from kernels.qmoe_spec import QMoESpec
from kernels.reference import route
from tests.qmoe_oracle import make_case

ALL = numba.config.NUMBA_NUM_THREADS
needs_two = pytest.mark.skipif(ALL < 2, reason="needs NUMBA_NUM_THREADS >= 2")


@njit
def _count_inside_compiled_code():
    return numba.get_num_threads()


@pytest.fixture(autouse=True)
def _all_threads_afterwards():
    yield
    use_threads(ALL)


@needs_two
def test_counts_apply_inside_and_after_compiled_code():
    for n in (1, 2, 1, 1, 2):
        assert use_threads(n) == n
        assert numba.get_num_threads() == n
        assert _count_inside_compiled_code() == n
    assert use_threads(None) == 2 and use_threads(0) == 2
    assert use_threads(10 ** 6) == ALL and numba.get_num_threads() == ALL


@needs_two
def test_interleaved_kernels_each_run_with_their_count():
    attrs, t, x, lg = make_case(seed=3, E=8, H=64, I=64, k=2, bits=4, block_size=32, T=2, activation="gelu")
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    one, two, default = CpuQMoE(spec, t, num_threads=1), CpuQMoE(spec, t, num_threads=2), CpuQMoE(spec, t)
    ids, w = route(lg, spec)
    want = one.run_experts(x, ids, w)
    for kernel, count in ((two, 2), (one, 1), (default, 1), (two, 2), (default, 2), (one, 1)):
        np.testing.assert_array_equal(kernel.run_experts(x, ids, w), want)
        assert numba.get_num_threads() == count


@needs_two
def test_a_new_thread_starts_from_numbas_default():
    use_threads(1)
    seen = {}

    def in_new_thread():
        seen["in effect"] = use_threads(None)
        seen["numba"] = numba.get_num_threads()
        seen["after set"] = use_threads(1), numba.get_num_threads()

    worker = threading.Thread(target=in_new_thread)
    worker.start()
    worker.join()
    assert seen == {"in effect": ALL, "numba": ALL, "after set": (1, 1)}
    assert use_threads(None) == 1 and numba.get_num_threads() == 1


def test_compiled_kernels_run_only_their_prange_loops_in_parallel():
    """parallel=True would also make each array statement outside prange a fork and join of all threads (28 µs of a
    one-expert decode call on a 16-core Xeon): every parallel kernel takes PRANGE_ONLY instead, and keeps it once it
    has compiled (Numba empties an options dict as it reads it)."""
    from numba.core.cpu import ParallelOptions
    from numba.core.registry import CPUDispatcher

    from engine.offload import host_copy
    from kernels.cpu import generic, kernels

    y, out = np.ones((3, 4), np.float32), np.zeros((3, 4), np.float32)
    kernels.reduce_rows(y, np.array([0, 2, 0], np.int64), out, 2)  # one of them compiled (or loaded) first
    assert out[:, 0].tolist() == [2.0, 0.0, 1.0]
    parallel = {f"{module.__name__}.{name}": fn.targetoptions["parallel"]
                for module in (kernels, generic, host_copy) for name, fn in vars(module).items()
                if isinstance(fn, CPUDispatcher) and fn.targetoptions.get("parallel")}
    assert "kernels.cpu.kernels.moe_gemv" in parallel and len(parallel) >= 10
    fields = ("enabled", "prange", "comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil",
              "fusion")
    prange_only = (True, True) + (False,) * 7
    assert {name: tuple(getattr(options, field) for field in fields) for name, options in parallel.items()
            if not isinstance(options, ParallelOptions) or tuple(getattr(options, f) for f in fields) != prange_only
            } == {}


def test_prange_only_serial_statements_stay_serial_in_every_specialisation():
    """The array statement before the prange loop does not start a parallel region, in the second specialisation
    too: the loop is the only parallel loop Numba made (its parfor diagnostics, per signature)."""
    from kernels.cpu.threads import PRANGE_ONLY

    @njit(parallel=PRANGE_ONLY)
    def count_up(n, like):
        a = np.zeros(8 * n, like.dtype)
        for i in prange(n):
            a[8 * i] += 1
        return a

    for like in (np.zeros(1, np.int64), np.zeros(1, np.float32)):
        assert count_up(2, like).sum() == 2
    for signature in count_up.signatures:
        parfors = count_up.overloads[signature].metadata["parfor_diagnostics"].initial_parfors
        assert len(parfors) == 1, parfors


@pytest.mark.parametrize("env,warned", [
    ({}, False),
    ({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, True),
    ({"OMP_PROC_BIND": "spread"}, True),
    ({"OMP_PLACES": "cores"}, True),              # GCC binds when places are given and OMP_PROC_BIND is not
    ({"GOMP_CPU_AFFINITY": "0-15"}, True),
    ({"OMP_PROC_BIND": "false", "OMP_PLACES": "cores"}, False),
    ({"OMP_PROC_BIND": "FALSE"}, False),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
])
def test_thread_binding_in_the_environment_is_named_in_a_warning(env, warned):
    from kernels.cpu.threads import binding_warning

    text = binding_warning(env)
    assert (text is not None) == warned
    if warned:
        assert all(f"{name}={value}" in text for name, value in env.items()) and "unset it" in text
