"""The native CPU kernels of the suite's later tests compiled into Numba's cache beside the first ones.

With an empty cache (CI, a fresh clone) the suite compiles each distinct kernel where a test first calls it, in its
own process on one core; moe_gemv alone takes 20-60 s a type of scales. For a run of the whole suite, conftest.py
has the process of tests/haswell_check.py (Check(warm=...)) compile these first, on the VM's other core, then start
the Haswell check, which is read only near the end; the later tests load what they find in the cache. The parts come
in the order the tests reach them (the fp16-scale decode kernel first: test_dense_device), and leave out the float32
ones that test_bad_input's first generation compiles within a minute of the start, so that the two processes do not
compile one kernel at once; the host-part loop, which calls the float32 moe_gemv, comes last. Nothing here is
checked: a part that fails is printed and the next one runs (the tests that call the kernel report it).

    python -m tests.warm_kernels [part ...]     (all parts by default; NUMBA_CACHE_DIR as the tests have it)
"""

from __future__ import annotations

import sys
import time
import traceback

import numpy as np


def _node(attrs, t, x):
    from kernels.cpu import CpuQMoE
    from kernels.qmoe_spec import QMoESpec

    return CpuQMoE(QMoESpec.from_tensors("warm/QMoE", "QMoE", attrs, t, x.shape), t)


def _warm(node):
    from types import SimpleNamespace

    from engine.kernel_warmup import warm_cpu_kernels

    warm_cpu_kernels([SimpleNamespace(kernel=node)])


def fp16_scales():
    """fp16 / bf16 scales (uint16): the decode and prefill kernels (test_dense_device's fp16 node first)."""
    from tests.qmoe_oracle import make_case

    _warm(_node(*make_case(seed=1, E=4, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                           swiglu_fusion=1, dtype=np.float16)[:3]))


def host_parts():
    """The host-part loop for float32 scales and float16 / float32 activations (test_host_part_worker); it calls the
    float32 moe_gemv that the first tests compiled."""
    from engine.offload import host_part_worker
    from tests.qmoe_oracle import make_case

    if not host_part_worker.supported():
        return
    node = _node(*make_case(seed=3, E=8, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                            swiglu_fusion=1)[:3])
    for dtype in (np.float16, np.float32):
        host_part_worker.compile_loop(node, dtype)


def fp8_scales():
    """fp8 codes of MXFP4 / NVFP4 (uint8 scales): the decode and prefill kernels (test_offload_layouts' nvfp4 model);
    fp8 weights: the generic kernels (its fp8 model)."""
    from tests.qmoe_oracle import make_layout_case

    _warm(_node(*make_layout_case(seed=1, E=4, H=64, I=32, k=2, T=1, quant_type="nvfp4", packing="k_packed",
                                  activation="swiglu", swiglu_fusion=1)[:3]))
    _warm(_node(*make_layout_case(seed=1, E=4, H=64, I=32, k=2, T=1, quant_type="fp8", block_size=32,
                                  activation="swiglu", swiglu_fusion=1)[:3]))


def per_expert_gemv():
    """The per-expert GEMV and activation kernels for float32 and fp16 scales: what the batched paths run for nodes with
    FC3 (no fused decode kernel), and the older per-expert paths (CpuQMoE.batched = False) with their GEMM for float32
    scales, the only ones the suite runs (test_qmoe_cpu)."""
    from tests.qmoe_oracle import make_case

    for dtype in (np.float32, np.float16):
        _warm(_node(*make_case(seed=2, E=4, H=64, I=32, k=2, bits=4, block_size=32, T=1, activation="swiglu",
                               swiglu_fusion=0, dtype=dtype)[:3]))
    attrs, t, x, lg = make_case(seed=2, E=4, H=64, I=32, k=2, bits=4, block_size=32, T=9, activation="swiglu",
                                swiglu_fusion=1)
    node = _node(attrs, t, x)
    node.batched = False
    for decode_max_tokens, gemv_max_rows in ((0, 6), (10**9, 6), (0, 0)):  # GEMV and GEMM, as the test's
        node.decode_max_tokens, node.gemv_max_rows = decode_max_tokens, gemv_max_rows
        node.forward(x, lg)


def wide_rows():
    """Float32 fc1 scales beside fp16 fc2 ones (rows of more blocks than the row kernels convert up front: fc1 of a
    hidden size over 32 x simd.MAX_ROW_BLOCKS), a moe_gemv of its own (test_qmoe_cpu)."""
    from kernels.cpu import simd
    from tests.qmoe_oracle import make_case

    _warm(_node(*make_case(seed=4, E=2, H=32 * (simd.MAX_ROW_BLOCKS + 1), I=32, k=1, bits=4, block_size=32, T=1,
                           activation="swiglu", swiglu_fusion=1, dtype=np.float16)[:3]))


PARTS = {"fp16-scales": fp16_scales, "fp8-scales": fp8_scales, "per-expert-gemv": per_expert_gemv,
         "wide-rows": wide_rows, "host-parts": host_parts}


def main(names) -> None:
    from kernels.cpu.threads import use_threads

    use_threads(1)  # compiles on one core: the other is the tests'
    for name in names or PARTS:
        started = time.perf_counter()
        try:
            PARTS[name]()
            print(f"warm_kernels: {name} {time.perf_counter() - started:.1f} s", flush=True)
        except Exception:  # the test that calls the kernel reports it
            print(f"warm_kernels: {name} failed:\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
