"""Which prefill kernels GpuQMoE launches (``GpuQMoE._pf_name``), and that the CUDA source defines each of them. CPU
only: GpuQMoE's constructor needs CuPy, so the attributes ``_pf_name`` reads are set by hand. The kernels themselves
run in tests/test_qmoe_gpu.py (GPU)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kernels.gpu import layout
from kernels.gpu._module import nvcc_arch, source_text
from kernels.gpu.qmoe import GpuQMoE, default_prefill_bm
from kernels.qmoe_spec import QMoESpec
from tests.qmoe_oracle import make_case


def _names(kernel: str, bits: int, block: int, zp: bool, BM: int, dtype=np.float32, wgmma: bool = True) -> tuple:
    """(FC1, FC2) prefill kernels of a swiglu node with this layout and tile height under ``prefill_kernel``, on a
    module with wgmma kernels or without."""
    attrs, t, x, _ = make_case(seed=3, E=2, H=128, I=128, k=1, bits=bits, block_size=block, zero_points=zp,
                               activation="swiglu", swiglu_fusion=1, dtype=dtype, T=1)
    spec = QMoESpec.from_tensors("test/QMoE", "QMoE", attrs, t, x.shape)
    m = object.__new__(GpuQMoE)
    m.prefill_kernel = kernel
    m.has_wgmma = wgmma
    return tuple(m._pf_name(p, mode, BM) for mode, p in enumerate(layout.make_layouts(spec, t)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("BM", [32, 48, 64])
def test_common_case_takes_pf_gemmw_or_pf_gemmc(BM, dtype):
    """int4, block 32, no zero points: pf_gemmw by default where the module has wgmma, else pf_gemmc; pf_gemmc when
    "v1c" is asked for, pf_gemm when "v1" is."""
    assert _names("v1w", 4, 32, False, BM, dtype) == (f"pf_gemmw_4_{BM}_0", f"pf_gemmw_4_{BM}_1")
    assert _names("v1w", 4, 32, False, BM, dtype, wgmma=False) == (f"pf_gemmc_4_{BM}_0", f"pf_gemmc_4_{BM}_1")
    assert _names("v1c", 4, 32, False, BM, dtype) == (f"pf_gemmc_4_{BM}_0", f"pf_gemmc_4_{BM}_1")
    assert _names("v1", 4, 32, False, BM, dtype) == (f"pf_gemm_4_{BM}_0", f"pf_gemm_4_{BM}_1")


@pytest.mark.parametrize("bits,block,zp,BM", [(4, 32, True, 32), (4, 64, False, 32), (4, 16, False, 64),
                                              (4, 0, False, 32), (8, 32, False, 32), (4, 32, False, 128)])
def test_other_cases_take_pf_gemm(bits, block, zp, BM):
    """Zero points, other blocks, per-row scales, int8, or BM 128 (no pf_gemmc / pf_gemmw instance): the general
    kernels."""
    for kernel in ("v1w", "v1c"):
        assert _names(kernel, bits, block, zp, BM) == (f"pf_gemm_{bits}_{BM}_0", f"pf_gemm_{bits}_{BM}_1")


def test_unknown_prefill_kernel_refused():
    with pytest.raises(ValueError, match="prefill_kernel"):
        _names("v2", 4, 32, False, 32)


def test_source_defines_every_prefill_kernel():
    """Every name _pf_name can return is instantiated in the CUDA source (QM_PF_KERNEL / QM_PFC_KERNEL /
    QM_PFW_KERNEL in prefill.cu)."""
    src = source_text()
    defined = {f"pf_gemm_{b}_{bm}_{mode}" for b, bm, mode in re.findall(r"^QM_PF_KERNEL\((\d+), (\d+), (\d)\)", src,
                                                                        re.M)}
    for kind, macro in (("c", "QM_PFC_KERNEL"), ("w", "QM_PFW_KERNEL")):
        defined |= {f"pf_gemm{kind}_4_{bm}_{mode}" for bm, mode in re.findall(rf"^{macro}\((\d+), (\d)\)", src, re.M)}
    wanted = {name for kernel in ("v1", "v1c", "v1w") for bits in (4, 8) for BM in (32, 48, 64, 128)
              for name in _names(kernel, bits, 32 if bits == 4 else 0, False, BM)}
    assert {n for n in wanted if n.startswith("pf_gemmc_")}, "no pf_gemmc kernel selected"
    assert {n for n in wanted if n.startswith("pf_gemmw_")}, "no pf_gemmw kernel selected"
    assert wanted <= defined, sorted(wanted - defined)


@pytest.mark.parametrize("pairs, resident, bm", [
    (512 * 8, 128, 48),   # shape B at 512 tokens: 32 pairs an expert, where 48 was fastest (0.248 ms against 0.259)
    (512 * 4, 32, 32),    # shape A at 512 tokens: 64 an expert (32 and 64 within 1%, 48 10% slower)
    (2048 * 8, 128, 32),  # 128 an expert: still one tile of 32 rows per 32 pairs
    (2049 * 8, 128, 64),  # past 128 an expert
    (140, 6, 32),         # 23 an expert: mostly one tile of 32
    (150, 6, 48),         # 25
    (288, 6, 48),         # 48
    (294, 6, 32),         # 49
    (16, 0, 32),          # no resident expert counted: the pairs as one expert's
])
def test_default_prefill_tile_follows_the_pairs_per_resident_expert(pairs, resident, bm):
    assert default_prefill_bm(pairs, resident) == bm


def test_the_cubin_for_9_0_is_built_for_sm_90a():
    """wgmma (pf_gemmw) exists only in arch-specific sm_90a code; other capabilities build for their plain sm_XX."""
    assert nvcc_arch("90") == "sm_90a"
    assert nvcc_arch("89") == "sm_89"
    assert nvcc_arch("100") == "sm_100"
