"""A pair split by rows between the CPU and the GPU (kernels/cold_split.py): the CPU kernel's part of an expert over
some of its intermediate rows (CpuQMoE.run_experts' spans, moe_gemv) against the NumPy reference's
(kernels/reference.py: expert_ffn's rows), and the two parts of a pair adding up to the whole pair."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cold_split import cpu_spans, device_spans, split_cold_rows
from kernels.cpu import CpuQMoE
from kernels.reference import expert_ffn, route
from tests.qmoe_oracle import make_case
from tests.test_qmoe_cpu import _spec

LAYOUTS = {  # make_case's arguments: the layouts and activations the fused decode kernel runs
    "int4 block 32, swiglu interleaved, biases": dict(bits=4, block_size=32, activation="swiglu", swiglu_fusion=1,
                                                      bias=True, swiglu_limit=7.0, alpha=1.702, beta=1.0),
    "int4 block 16, swiglu concatenated, zero points": dict(bits=4, block_size=16, activation="swiglu",
                                                            swiglu_fusion=2, zero_points=True),
    "int8 per row, gelu, biases": dict(bits=8, block_size=0, activation="gelu", bias=True),
    "int4 block 64, silu": dict(bits=4, block_size=64, activation="silu"),
}


def _node(seed: int, **layout):
    attrs, tensors, x, logits = make_case(seed=seed, E=8, H=128, I=192, k=3, T=2, **layout)
    return CpuQMoE(_spec(attrs, tensors, x), tensors), tensors, x.astype(np.float32), logits


def _reference(x, ids, w, spec, tensors, spans):
    out = np.zeros((x.shape[0], spec.hidden_size))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                rows = None if spans is None else tuple(int(v) for v in spans[e])
                out[t] += w[t, j] * expert_ffn(x[t:t + 1], e, spec, tensors, rows)[0]
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_cpus_part_of_an_expert_over_its_rows_equals_the_references(name):
    kernel, tensors, x, logits = _node(11, **LAYOUTS[name])
    spec = kernel.spec
    # FC2 read from the part's first row on: int4 rows of whole 16-byte chunks, scale blocks of <= 64 codes
    assert kernel.reads_rows_in_part == name.startswith(("int4 block 32", "int4 block 64"))
    ids, w = route(logits, spec)
    rng = np.random.default_rng(5)
    for tokens in (1, 2):
        for _ in range(3):
            spans = np.zeros((spec.num_experts, 2), np.int64)
            spans[:, 1] = spec.inter_size
            for e in np.unique(ids[:tokens])[:3]:  # routed experts in part, from either end
                # any row, or a multiple of 64 (kernels/cold_split.py's ROW_STEP: FC2 read from there on)
                r = int(rng.integers(1, spec.inter_size)) if rng.random() < 0.4 else 64 * int(rng.integers(1, 3))
                spans[e] = (r, spec.inter_size) if rng.random() < 0.5 else (0, r)
            got = kernel.run_experts(x[:tokens], ids[:tokens], w[:tokens],
                                     out=np.zeros((tokens, spec.hidden_size), np.float32), spans=spans)
            want = _reference(x[:tokens], ids[:tokens], w[:tokens], spec, tensors, spans)
            assert np.allclose(got, want, rtol=2e-3, atol=2e-4), name
            assert not np.allclose(got, _reference(x[:tokens], ids[:tokens], w[:tokens], spec, tensors, None),
                                   rtol=2e-3, atol=2e-4)  # (the parts are not the whole experts)


def test_the_two_parts_of_a_split_pair_add_up_to_the_whole_pair():
    """A step of one token whose GPU's last cold pair is split at row 64: the device's part (the other pairs the GPU
    takes, rows [0, 64) of the split one) plus the CPU's (its pairs, rows [64, I) of the split one) is the node's
    output, FC2's bias counted once."""
    kernel, tensors, x, logits = _node(4, **LAYOUTS["int4 block 32, swiglu interleaved, biases"])
    spec = kernel.spec
    ids, w = route(logits[:1], spec)
    cold = np.array([[True, True, False]])  # rank 2 resident; ranks 0, 1 cold: the CPU takes rank 1
    codes = split_cold_rows(cold, np.array([0, 0, 1, 1]), np.array([0, 0, 64, 0]))
    assert codes.tolist() == [[65, 1, 0]]  # rank 0, the GPU's last cold pair, split at row 64
    gpu_part = kernel.run_experts(x[:1], np.where(codes == 1, -1, ids), w, out=np.zeros((1, 128), np.float32),
                                  spans=device_spans(ids, codes, spec.num_experts, spec.inter_size))
    cpu_part = kernel.run_experts(x[:1], np.where(codes != 0, ids, -1), w, out=np.zeros((1, 128), np.float32),
                                  spans=cpu_spans(ids, codes, spec.num_experts, spec.inter_size))
    whole = kernel.run_experts(x[:1], ids, w, out=np.zeros((1, 128), np.float32))
    assert np.allclose(gpu_part + cpu_part, whole, rtol=1e-4, atol=1e-5)
    assert np.allclose(whole, _reference(x[:1], ids, w, spec, tensors, None), rtol=2e-3, atol=2e-4)


def test_run_experts_refuses_spans_it_cannot_compute():
    kernel, _, x, logits = _node(2, **LAYOUTS["int4 block 64, silu"])
    spec = kernel.spec
    ids, w = route(logits, spec)
    out = np.zeros((2, spec.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"spans: int64 \[8, 2\], not int32 \[8, 2\]"):
        kernel.run_experts(x, ids, w, out=out, spans=np.zeros((8, 2), np.int32))
    with pytest.raises(ValueError, match="spans: row ranges within 0..192"):
        kernel.run_experts(x, ids, w, out=out, spans=np.array([[0, 193]] * 8, np.int64))
    fc3, tensors3, x3, logits3 = _node(2, bits=4, block_size=32, activation="swiglu", swiglu_fusion=0)
    ids3, w3 = route(logits3, fc3.spec)
    whole = np.tile(np.array([[0, 192]], np.int64), (8, 1))
    with pytest.raises(ValueError, match="node 'test/QMoE': a part of an expert's rows needs the fused decode kernel"):
        fc3.run_experts(x3, ids3, w3, out=out, spans=whole)
