#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes; at most ~4.8 with every timeout hit): prefill v2 (pf2 kernels, kernels/gpu/source/prefill2.cu) against v1
# (pf_gemm): the GPU tests of v2 (tests/test_qmoe_gpu.py -k pf2: the v4 grid at 100 and 9 tokens against the reference
# and v1, ragged tokens per expert 0 / 1 / 15 / 17 / 64 / 100 / 129 through run_experts, launch configurations, nvfp4)
# and v1's prefill tests, then the A/B benchmark (v1 BM 32 / 64 / 128 and v2 BM 64 / 128 x stmatrix / st.shared at 512
# and 2048 tokens, shapes A and B, the fp16 matmul ceiling measured in the same run).
# Run from the repository root with OUT set; carry .whl (the wheels gpu_tests_run.sh installs) and kernels/gpu/_build
# (the prebuilt cubin for this source: `python -m kernels.gpu.build --arch 90`; without it NVRTC compiles the module
# on first use, several minutes).
#   OUT=... bash benchmarks/gpu_prefill_ab.sh
set -u
export PYTHONUNBUFFERED=1
log=$OUT/gpu-prefill-ab.log
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >> "$log"
fi
export PYTHONPATH=/tmp/site
{
  echo "== cubin"; ls -l kernels/gpu/_build/ 2>&1
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1 | tail -2
  # the small v2 cases first (ragged counts, launch configurations, nvfp4), then the grid; no -x: a failure's pattern
  # across the cases is the useful output
  echo "== GPU tests: prefill v2 (ragged, launch configurations, nvfp4)"; date -u
  timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py \
    -k "pf2_ragged or pf2_launch or pf2_converted" --maxfail=6 2>&1 | tail -30
  echo "== GPU tests: prefill v2 grid (v4 grid cases, v2 vs reference and v1)"; date -u
  timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py -k "pf2_matches" --maxfail=6 \
    2>&1 | tail -30
  echo "== GPU tests: v1 prefill unchanged (grid, launch configurations, run_experts, bf16)"; date -u
  timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py \
    -k "(test_gpu_matches_reference or test_gpu_launch_configs or test_gpu_run_experts_subsets or test_gpu_bf16) and not v5 and not pf2" \
    --maxfail=3 2>&1 | tail -15
  echo "== prefill A/B benchmark (v1 vs v2; shapes A and B; 512 and 2048 tokens)"; date -u
  # the benchmark copies its result JSON into $OUT itself (bench_qmoe_gpu._write)
  timeout 110 python3 benchmarks/bench_qmoe_gpu.py --prefill-ab --pf-tokens 2048 2>&1 | tail -60
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tail -1
  ls "$OUT"
  date -u
} > "$log" 2>&1
tail -c 11000 "$log"
