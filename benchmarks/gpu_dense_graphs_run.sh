#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes): the engine's GPU tests with the dense graphs on (the default), the driver
# copies' GPU tests, then the dense graphs' tests again with every replay checked against onnxruntime's run of the
# same segment right after it (MOE_DENSE_GRAPHS_VERIFY=1: a replay that differs fails the test). Full failure output
# goes to $OUT/dense-graphs.log.
# Run after onnxruntime-gpu's five pieces are in /tmp/ortgpu (gpu_offload_run.sh installs it); carry .whl,
# kernels/gpu/_build, .numba-cache and .fixtures.
set -u
export PYTHONUNBUFFERED=1
SHAPE=qwen3-30b-a3b-like TESTS=0 BENCH=0 bash benchmarks/gpu_offload_run.sh > /dev/null 2>&1  # installs /tmp/site_gpu
export PYTHONPATH=/tmp/site_gpu NUMBA_CACHE_DIR=/tmp/numba MOE_WORKBENCH_FIXTURES=$PWD/.fixtures
log=$OUT/dense-graphs.log
{
  echo "== the engine's GPU tests, dense graphs on; the driver copies' GPU tests"; date -u
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_offload_cuda.py \
    tests/test_cuda_step.py tests/test_offload_layouts.py tests/test_dense_device.py tests/test_gpu_driver_copies.py \
    2>&1 | grep -v "plugin EP device" | cut -c1-3000
  echo "== the dense graphs' tests, every replay checked (MOE_DENSE_GRAPHS_VERIFY=1)"; date -u
  MOE_DENSE_GRAPHS_VERIFY=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
    tests/test_dense_device.py -k dense_graphs 2>&1 | grep -v "plugin EP device" | cut -c1-3000
  date -u
} > "$log" 2>&1
grep -E "passed|failed|FAILED|ERROR|^==" "$log" | cut -c1-400
