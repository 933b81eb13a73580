#!/usr/bin/env bash
# One call on the GPU machine (~1.5 minutes expected; < 4 with every timeout hit): prefill v1c (pf_gemmc: pf_gemm
# compiled for int4 / block 32 / no zero point, GpuQMoE's default where the layout allows) against v1 (the general
# pf_gemm): the v1c GPU tests (ragged tokens per expert and launch configurations, then the v4 grid at 100 and 9 tokens
# against the reference and v1, each checking which kernels ran), the prefill tests of the default path, then the
# A/B benchmark at 512 tokens, shapes A and B: v1c and v1 at BM 32 / 64 / 128 next to the fp16 matmul ceiling of the
# same run.
# Run from the repository root with OUT set; carry .whl (the wheels gpu_tests_run.sh installs) and kernels/gpu/_build
# (the prebuilt cubin for this source: `python -m kernels.gpu.build --arch 90`; without it NVRTC compiles the module
# on first use, for minutes, and the timeouts below go to that).
#   OUT=... bash benchmarks/gpu_prefill_v1c_run.sh
set -u
export PYTHONUNBUFFERED=1
log=$OUT/gpu-prefill-v1c.log
install_note=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || install_note="wheel install failed"
fi
export PYTHONPATH=/tmp/site
{
  [ -n "$install_note" ] && echo "$install_note"
  echo "== cubin"; ls -l kernels/gpu/_build/ 2>&1
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1 | tail -2
  # no -x: a failure's pattern across the cases is the useful output
  echo "== GPU tests: v1c ragged, launch configurations"; date -u
  timeout 35 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py \
    -k "v1c_ragged or v1c_launch" --maxfail=6 2>&1 | tail -30
  echo "== GPU tests: v1c grid (v4 grid cases, v1c and v1 vs the reference, pf_gemmc only where it applies)"; date -u
  timeout 55 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py -k "v1c_matches" --maxfail=6 \
    2>&1 | tail -30
  echo "== GPU tests: the default prefill path (grid, launch configurations, run_experts)"; date -u
  timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py \
    -k "(test_gpu_matches_reference or test_gpu_launch_configs or test_gpu_run_experts_subsets) and not v5 and not v1c" \
    --maxfail=3 2>&1 | tail -15
  echo "== prefill A/B benchmark at 512 tokens (v1c, v1; shapes A and B)"; date -u
  # the benchmark copies its result JSON into $OUT itself (bench_qmoe_gpu._write)
  timeout 75 python3 benchmarks/bench_qmoe_gpu.py --prefill-ab --pf-rounds 3 2>&1 | tail -20
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tail -1
  ls "$OUT"
  date -u
} > "$log" 2>&1
tail -c 11000 "$log"
