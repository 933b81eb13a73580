#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes expected): decode_prep's routing by ranks (route.cu, route_rank_block;
# GpuQMoE.dec_cfg["rank_route"]): its GPU tests (the routing tables against the reference, both routing paths), then
# bench_gpu_pdl.py --switch rank_route (one warp per token against ranks, alternating rounds, shapes A and B, x fp16
# and fp32), Nsight Compute on the decode kernels (gpu_ncu_decode.sh), then the whole GPU kernel suite.
# Run from the repository root with OUT set; carry .whl, kernels/gpu/_build (the cubin for this source) and
# .numba-cache (test_cuda_step runs CPU kernels: without a matching cache Numba compiles them first, for minutes).
#   OUT=... bash benchmarks/gpu_prep_run.sh
set -u
export PYTHONUNBUFFERED=1
. benchmarks/numba_cache.sh
restore_numba_cache
log=$OUT/gpu-prep.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site
{
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  echo "== GPU tests: decode_prep routing"; date -u
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py \
    -k "decode_prep_routing or routing_matches or router_weights" --maxfail=4 2>&1 | tail -20
  echo "== bench_gpu_pdl --switch rank_route"; date -u
  timeout 150 python3 benchmarks/bench_gpu_pdl.py --switch rank_route 2>&1 | tail -45
  echo "== ncu"; date -u
  bash benchmarks/gpu_ncu_decode.sh 2>&1 | tail -40
  echo "== GPU kernel suite"; date -u
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py \
    tests/test_cuda_step.py tests/test_gpu_pack_device.py tests/test_gpu_prefill_select.py --maxfail=6 2>&1 | tail -20
  date -u
} > "$log" 2>&1
cat "$log"
