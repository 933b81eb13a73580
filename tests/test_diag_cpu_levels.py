"""benchmarks/diag_cpu_levels.py: the bytes an expert call reads, and the calls its timing loop makes."""
import numpy as np

from benchmarks import diag_cpu_levels as levels
from benchmarks.bench_qmoe_cpu import make_layout_weights
from kernels.cpu import CpuQMoE
from kernels.qmoe_spec import QMoESpec


def _node(experts: int):
    attrs, tensors = make_layout_weights("int4", experts, levels.H, levels.I)
    attrs["k"] = 1
    spec = QMoESpec.from_tensors("diag/QMoE", "QMoE", attrs, tensors, (1, levels.H))
    return CpuQMoE(spec, tensors), tensors


def test_expert_bytes_are_one_experts_int4_codes_and_float32_block_scales():
    _, tensors = _node(3)
    H, I = levels.H, levels.I
    fc1 = 2 * I * H // 2 + 2 * I * (H // 32) * 4  # gate and up rows: 4-bit codes, a float32 scale per 32
    fc2 = H * I // 2 + H * (I // 32) * 4
    assert levels.expert_bytes(tensors, 3) == fc1 + fc2


def test_the_timing_loop_calls_each_expert_of_its_span_in_turn():
    """One pass over the span, then `runs` timed calls: expert i % span each time, all added into `out`."""
    node, _ = _node(3)
    x = np.random.default_rng(1).standard_normal((1, levels.H)).astype(np.float32)
    out = np.zeros((1, levels.H), np.float32)
    seconds = levels.median_call_s(node, x, out, span=3, runs=4)
    single = [node.run_experts(x, np.array([[e]]), np.ones((1, 1), np.float32)) for e in range(3)]
    expected = 3 * single[0] + 2 * single[1] + 2 * single[2]  # calls on experts 0,1,2 then 0,1,2,0
    assert seconds > 0
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
