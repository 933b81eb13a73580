"""benchmarks/diag_cached_kernel.py: the copy it compiles here computes what the cached kernel computes, on the
arguments run_experts passes."""
import numpy as np

from benchmarks import diag_cached_kernel as diag
from benchmarks.bench_qmoe_cpu import make_layout_weights
from kernels.cpu import CpuQMoE
from kernels.cpu import kernels as compiled
from kernels.qmoe_spec import QMoESpec


def test_the_copy_compiled_here_matches_the_cached_kernel_on_run_experts_arguments():
    attrs, tensors = make_layout_weights("int4", 6, 256, 64)
    attrs["k"] = 2
    node = CpuQMoE(QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, 256)), tensors)
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    cached = compiled.moe_gemv
    arguments = diag.kernel_arguments(node, x, experts=2)
    assert compiled.moe_gemv is cached  # put back after the capture
    assert arguments[13].tolist() == [0, 1]  # the experts the call was given
    results = []
    for kernel in (cached, diag.compiled_here()):
        y, out = np.array(arguments[-4]), np.array(arguments[-3])  # y and out as run_experts left them
        args = list(arguments)
        args[-4], args[-3] = np.zeros_like(y), np.zeros_like(out)
        kernel(*args)
        results.append((args[-4], args[-3]))
    (y_cached, out_cached), (y_here, out_here) = results
    assert np.abs(out_cached).max() > 0  # the call computed something
    np.testing.assert_allclose(y_here, y_cached, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_here, out_cached, rtol=1e-5, atol=1e-6)


def test_the_kernels_take_turns_round_by_round_on_the_same_arguments():
    calls = []
    kernels = {name: (lambda *args, name=name: calls.append((name, args))) for name in ("a", "b")}
    medians = diag.interleaved_medians(kernels, (1, "x"), rounds=3, calls=2)
    assert set(medians) == {"a", "b"} and all(m > 0 for m in medians.values())
    per_round = ["a"] * 4 + ["b"] * 4  # two warm-up calls and two timed ones each, a's turn then b's
    assert [name for name, _ in calls] == per_round * 3 and {args for _, args in calls} == {(1, "x")}
