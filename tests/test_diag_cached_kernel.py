"""benchmarks/diag_cached_kernel.py: the copy it compiles here is the cached kernel's own function with Numba's cache
off, and a copy made so computes what the cached kernel computes."""
import numpy as np
from numba.core.caching import NullCache

from benchmarks import diag_cached_kernel as diag
from benchmarks.bench_qmoe_cpu import make_layout_weights
from kernels.cpu import CpuQMoE
from kernels.cpu import kernels as compiled
from kernels.qmoe_spec import QMoESpec


def test_the_copy_of_moe_gemv_is_its_own_function_with_the_cache_off():
    """The same arguments, locals, constants and names, read in kernels.py's names, with every Numba option the cached
    kernel has but the cache. (Not the same bytes of bytecode: CPython 3.11 compiles the function alone with other
    attribute loads than within its module.) Not compiled here: a moe_gemv compile is ~20 s of every run, warm cache
    or not; the copy's compile and run are checked on a small kernel copied the same way (below)."""
    copy, cached = diag.compiled_here(), compiled.moe_gemv
    assert copy is not cached and isinstance(copy._cache, NullCache) and not isinstance(cached._cache, NullCache)
    assert copy.targetoptions == cached.targetoptions and not copy.signatures
    here, there = copy.py_func.__code__, cached.py_func.__code__
    assert (here.co_argcount, here.co_consts, here.co_names, here.co_varnames) == (
        there.co_argcount, there.co_consts, there.co_names, there.co_varnames)
    names = vars(compiled)
    assert all(copy.py_func.__globals__[name] is names[name] for name in there.co_names if name in names)
    assert "_gemv_fc1_thread" in there.co_names  # the thread functions it calls are the module's cached ones


def test_run_experts_arguments_are_captured_and_run_by_the_cached_kernel():
    attrs, tensors = make_layout_weights("int4", 6, 256, 64)
    attrs["k"] = 2
    node = CpuQMoE(QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, 256)), tensors)
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    cached = compiled.moe_gemv
    arguments = diag.kernel_arguments(node, x, experts=2)
    assert compiled.moe_gemv is cached  # put back after the capture
    assert arguments[13].tolist() == [0, 1]  # the experts the call was given
    args = list(arguments)
    args[-4], args[-3] = np.zeros_like(args[-4]), np.zeros_like(args[-3])  # y and out
    cached(*args)
    assert np.abs(args[-3]).max() > 0  # the call computed something


def test_a_kernel_compiled_here_computes_what_the_cached_one_computes():
    """reduce_tokens: moe_gemv's Numba options (parallel, fastmath, nogil, error model, cache) in a kernel that
    compiles in about a second."""
    copy, cached = diag.compiled_here("reduce_tokens"), compiled.reduce_tokens
    assert copy is not cached and isinstance(copy._cache, NullCache) and copy.targetoptions == cached.targetoptions
    rng = np.random.default_rng(3)
    y = rng.standard_normal((12, 40)).astype(np.float32)
    tpair = rng.integers(0, 16, (7, 2)).astype(np.int64)  # pairs below p0 or past y's rows left out
    results = []
    for kernel in (cached, copy):
        out = np.ones((7, 40), np.float32)
        kernel(y, tpair, 2, out, 2)
        results.append(out)
    assert not np.array_equal(results[0], np.ones((7, 40), np.float32))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6, atol=1e-6)
    assert len(copy.signatures) == 1


def test_the_kernels_take_turns_round_by_round_on_the_same_arguments():
    calls = []
    kernels = {name: (lambda *args, name=name: calls.append((name, args))) for name in ("a", "b")}
    medians = diag.interleaved_medians(kernels, (1, "x"), rounds=3, calls=2)
    assert set(medians) == {"a", "b"} and all(m > 0 for m in medians.values())
    per_round = ["a"] * 4 + ["b"] * 4  # two warm-up calls and two timed ones each, a's turn then b's
    assert [name for name, _ in calls] == per_round * 3 and {args for _, args in calls} == {(1, "x")}
