#!/usr/bin/env bash
# One call on the GPU machine: every test marked `gpu`, with its outcome in $OUT/gpu-tests.log, then two
# host-side micro-benchmarks that need the machine's 16 cores.
# Run from the repository root with OUT set; carry .whl (onnxruntime 1.32 CPU, psutil, platformdirs,
# nvidia-ml-py wheels) and kernels/gpu/_build (the prebuilt cubin).
#
# The dense-part tests (tests/test_dense_device.py) need onnxruntime-gpu. Its wheel (256 MB) is larger
# than one call carries: earlier calls, seconds apart while the machine stays warm, each carry one
# piece of .ortgpu/ (made by `split -b 50M -d <wheel> ortgpu.part.`) and copy it into /tmp/ortgpu.
# When all pieces are there this script joins them and runs those tests in a separate interpreter
# path: onnxruntime and onnxruntime-gpu install the same module and must never share one.
# The genai fixture folders do not travel with the checkout (they live beside it): copy them into the
# git-excluded .fixtures/ and carry it too (`cp -r ../shared/fixtures/genai/* .fixtures/`).
set -u
export PYTHONUNBUFFERED=1
[ -d .fixtures ] && export MOE_WORKBENCH_FIXTURES=$PWD/.fixtures
log=$OUT/gpu-tests.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
{
  echo "== GPU kernels, offload engine (onnxruntime CPU for the dense part)"; date -u
  PYTHONPATH=/tmp/site timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_qmoe_gpu.py tests/test_offload_cuda.py tests/test_offload_layouts.py 2>&1 | tail -80
  wheel=/tmp/ortgpu/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
  if ls /tmp/ortgpu/ortgpu.part.* >/dev/null 2>&1; then
    echo "== dense part on onnxruntime-gpu"; date -u
    [ -f "$wheel" ] || cat /tmp/ortgpu/ortgpu.part.* > "$wheel"
    mkdir -p /tmp/site_gpu
    cp -r /tmp/site/. /tmp/site_gpu/ && rm -rf /tmp/site_gpu/onnxruntime /tmp/site_gpu/onnxruntime-*.dist-info
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_gpu "$wheel" \
      && PYTHONPATH=/tmp/site_gpu timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dense_device.py 2>&1 | tail -80
  else
    echo "== dense part on onnxruntime-gpu: skipped (no pieces in /tmp/ortgpu)"
  fi
  echo "== host-side micro-benchmarks on this machine's cores (packing an expert, gathering a wave)"
  PYTHONPATH=/tmp/site timeout 120 python3 benchmarks/bench_pack_host.py 2>&1 | tail -6
  PYTHONPATH=/tmp/site timeout 60 python3 benchmarks/bench_host_copy.py 2>&1 | tail -3
  cp benchmarks/results/pack-host-*h200*.json benchmarks/results/host-copy-*h200*.json "$OUT/" 2>/dev/null
  date -u
} > "$log" 2>&1
tail -c 8000 "$log"
