"""engine/kernel_warmup.py: each distinct CPU kernel of a model run once, before a timed run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from engine.kernel_warmup import warm_cpu_kernels
from kernels.cpu import CpuQMoE
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case


def _kernel(dtype) -> CpuQMoE:
    attrs, t, x, _ = make_case(seed=2, E=6, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                               swiglu_fusion=1, swiglu_limit=7.0, alpha=1.702, dtype=dtype)
    return CpuQMoE(QMoESpec.from_tensors("t", "QMoE", attrs, t, x.shape), t)


def test_each_layout_is_run_once_for_a_decode_step_and_a_prefill(monkeypatch):
    calls, gemm = [], []
    forward, gemm_batched = CpuQMoE.forward, CpuQMoE._gemm_batched

    def counted_forward(self, x, logits, router_weights=None):
        calls.append((id(self), x.shape[0]))
        return forward(self, x, logits, router_weights)

    monkeypatch.setattr(CpuQMoE, "forward", counted_forward)
    monkeypatch.setattr(CpuQMoE, "_gemm_batched",
                        lambda self, *args: gemm.append(id(self)) or gemm_batched(self, *args))
    fp32, fp32_again, fp16 = _kernel(np.float32), _kernel(np.float32), _kernel(np.float16)
    dense = SimpleNamespace()  # a dense segment: no kernel
    seconds = warm_cpu_kernels([dense, SimpleNamespace(kernel=fp32), dense, SimpleNamespace(kernel=fp32_again),
                                SimpleNamespace(kernel=fp16)])
    prefill = CpuQMoE.gemv_max_rows + 1
    # fp32_again shares fp32's layout (the same compiled kernels); fp16's scales are another type
    assert calls == [(id(fp32), 1), (id(fp32), prefill), (id(fp16), 1), (id(fp16), prefill)]
    assert gemm == [id(fp32), id(fp16)] and seconds > 0  # the prefill's tokens reached the GEMM path
