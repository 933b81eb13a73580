#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes expected): the v5 decode with FC1 / FC2 launched through programmatic
# dependent launch (GpuQMoE.dec5_cfg["pdl"]): its GPU tests first (24 forwards in a row against the reference and
# plain launches, CUDA-graph replays), then the whole GPU kernel suite with pdl the default, then bench_gpu_pdl.py
# (pdl against plain launches, alternating rounds, shapes A and B, x fp16 and fp32).
# Run from the repository root with OUT set; carry .whl and kernels/gpu/_build (the cubin for this source) and
# .numba-cache (test_cuda_step runs CPU kernels: without a matching cache Numba compiles them first, for minutes).
#   OUT=... bash benchmarks/gpu_pdl_run.sh
set -u
export PYTHONUNBUFFERED=1
. benchmarks/numba_cache.sh
restore_numba_cache
log=$OUT/gpu-pdl.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site
{
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  echo "== GPU tests: pdl"; date -u
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py -k "pdl or graph" \
    --maxfail=4 2>&1 | tail -20
  echo "== bench_gpu_pdl"; date -u
  timeout 150 python3 benchmarks/bench_gpu_pdl.py 2>&1 | tail -45
  echo "== GPU kernel suite, pdl the default"; date -u
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py \
    tests/test_cuda_step.py tests/test_gpu_pack_device.py tests/test_gpu_prefill_select.py --maxfail=6 2>&1 | tail -20
  date -u
} > "$log" 2>&1
cat "$log"
