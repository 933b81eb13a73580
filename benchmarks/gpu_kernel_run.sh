#!/usr/bin/env bash
# One call on the GPU machine (~4 minutes): the GPU kernel tests (v4 and v5 decode, prefill, FMA path), then the
# kernel benchmark (v4 and v5 decode + prefill at shapes A and B, HBM / matmul ceilings measured in the same run).
# Run from the repository root with OUT set; carry .whl (the wheels gpu_tests_run.sh installs) and kernels/gpu/_build
# (the prebuilt cubin for this source: `python -m kernels.gpu.build --arch 90`; without it NVRTC compiles the module
# on first use, several minutes).
#   OUT=... bash benchmarks/gpu_kernel_run.sh
set -u
export PYTHONUNBUFFERED=1
log=$OUT/gpu-kernel-run.log
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >> "$log"
fi
export PYTHONPATH=/tmp/site
{
  echo "== cubin"; ls -l kernels/gpu/_build/ 2>&1
  python3 -c "from kernels.gpu._module import cubin_path; p = cubin_path('90'); print(p, 'present' if p.is_file() else 'MISSING (NVRTC will compile)')"
  # the v5 decode tests first, on their own: the rest of the file (v4, prefill, FMA, the converted layouts not yet
  # run on a GPU either) must not use up --maxfail before them
  echo "== GPU kernel tests: decode v5"; date -u
  timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py -k v5 -x --maxfail=5 2>&1 | tail -40
  echo "== GPU kernel tests: the rest of tests/test_qmoe_gpu.py"; date -u
  timeout 85 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmoe_gpu.py -k "not v5" -x --maxfail=5 2>&1 \
    | tail -40
  echo "== kernel benchmark (v4 vs v5 decode, prefill; shapes A and B)"; date -u
  # the benchmark copies its result JSON into $OUT itself (bench_qmoe_gpu._write)
  timeout 70 python3 benchmarks/bench_qmoe_gpu.py --gpu-only --quick 2>&1 | tail -40
  ls "$OUT"
  date -u
} > "$log" 2>&1
tail -c 9000 "$log"
