#!/usr/bin/env bash
# One call on the GPU machine (~2 minutes): the dense graphs' GPU tests two ways, full failure output each: as they
# are, and with every replay checked against onnxruntime's run of the same segment right after it
# (MOE_DENSE_GRAPHS_VERIFY=1: a replay that differs is listed). Then the engine's other GPU tests with graphs on.
# Run after onnxruntime-gpu's five pieces are in /tmp/ortgpu (gpu_offload_run.sh installs it); carry .whl,
# kernels/gpu/_build, .numba-cache and .fixtures.
set -u
export PYTHONUNBUFFERED=1
SHAPE=qwen3-30b-a3b-like TESTS=0 BENCH=0 bash benchmarks/gpu_offload_run.sh > /dev/null 2>&1  # installs /tmp/site_gpu
export PYTHONPATH=/tmp/site_gpu NUMBA_CACHE_DIR=/tmp/numba MOE_WORKBENCH_FIXTURES=$PWD/.fixtures
log=$OUT/dense-graphs.log
run() {
  echo "== $*"; date -u
  env "$@" timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_dense_device.py \
    -k "dense_graphs or expert_nodes_take" 2>&1 | grep -v "plugin EP device" | cut -c1-3000 | tail -40
}
{
  run MOE_DENSE_GRAPHS=1
  run MOE_DENSE_GRAPHS=1 MOE_DENSE_GRAPHS_VERIFY=1
  echo "== the engine's other GPU tests, graphs on"; date -u
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line tests/test_offload_cuda.py \
    tests/test_cuda_step.py tests/test_offload_layouts.py 2>&1 | grep -v "plugin EP device" | tail -8
  date -u
} > "$log" 2>&1
cat "$log"
