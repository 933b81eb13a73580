#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes expected): one switch of the v5 decode, off against on. SWITCH=pdl (the
# default): FC1 / FC2 launched through programmatic dependent launch (GpuQMoE.dec5_cfg["pdl"]); SWITCH=rank_route:
# decode_prep routing by ranks counted by the whole block (GpuQMoE.dec_cfg["rank_route"]). First the switch's GPU
# tests (pdl: 24 forwards in a row against the reference and plain launches, CUDA-graph replays; rank_route: the
# routing tables against the reference, both routing paths), then bench_gpu_pdl.py --switch (alternating rounds,
# shapes A and B, x fp16 and fp32), with NCU=1 Nsight Compute on the decode kernels (gpu_ncu_decode.sh), then the
# whole GPU kernel suite.
# Run from the repository root with OUT set; carry .whl and kernels/gpu/_build (the cubin for this source) and
# .numba-cache (test_cuda_step runs CPU kernels: without a matching cache Numba compiles them first, for minutes).
#   OUT=... [SWITCH=pdl|rank_route] [NCU=1] bash benchmarks/gpu_pdl_run.sh
set -u
export PYTHONUNBUFFERED=1
. benchmarks/numba_cache.sh
restore_numba_cache
switch=${SWITCH:-pdl}
case "$switch" in
  pdl) tests="pdl or graph" ;;
  rank_route) tests="decode_prep_routing or routing_matches or router_weights" ;;
  *) echo "SWITCH must be pdl or rank_route, not '$switch'"; exit 2 ;;
esac
log=$OUT/gpu-$switch.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site
{
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  echo "== GPU tests: $switch"; date -u
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py -k "$tests" \
    --maxfail=4 2>&1 | tail -20
  echo "== bench_gpu_pdl --switch $switch"; date -u
  timeout 150 python3 benchmarks/bench_gpu_pdl.py --switch "$switch" 2>&1 | tail -45
  if [ "${NCU:-0}" = 1 ]; then
    echo "== ncu"; date -u
    bash benchmarks/gpu_ncu_decode.sh 2>&1 | tail -40
  fi
  echo "== GPU kernel suite"; date -u
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_qmoe_gpu.py \
    tests/test_cuda_step.py tests/test_gpu_pack_device.py tests/test_gpu_prefill_select.py --maxfail=6 2>&1 | tail -20
  date -u
} > "$log" 2>&1
cat "$log"
