"""Every kernel the GPU module's Python launches by a literal name is defined in the CUDA source (CPU only: a
misspelt or removed kernel would otherwise show only on a GPU, at the first launch of that path)."""
from __future__ import annotations

import re
from pathlib import Path

from kernels.gpu._module import source_text

GPU_PY = sorted((Path(__file__).resolve().parents[1] / "kernels" / "gpu").glob("*.py"))


def defined_kernels(source: str) -> set[str]:
    """Names of the extern "C" kernels written out in `source` (with or without launch bounds; the prefill kernels
    that macros paste together are not among them)."""
    return set(re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(?!__launch_bounds__)(\w+)\(',
                          source))


def test_the_pattern_reads_both_declarations():
    src = ('extern "C" __global__ void route_topk(const void* logits) {}\n'
           'extern "C" __global__ void __launch_bounds__(512)\nprefill_prep(int route_mode) {}\n')
    assert defined_kernels(src) == {"route_topk", "prefill_prep"}
    macro = 'extern "C" __global__ void __launch_bounds__(128) pf_gemm_##B##_##BM##_##M(QM_PF_ARGS) {}'
    assert defined_kernels(macro) == set()


def test_launched_kernels_are_defined():
    launched = {name for path in GPU_PY
                for name in re.findall(r'(?:_f|get_function)\("(\w+)"\)', path.read_text())}
    assert {"decode_prep", "merge_sum", "pack_expert", "qm_features"} <= launched  # the pattern finds the launches
    defined = defined_kernels(source_text())
    assert launched <= defined, sorted(launched - defined)
