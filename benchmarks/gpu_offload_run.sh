#!/usr/bin/env bash
# One call on the GPU machine: the offload benchmark at full size with the dense part on onnxruntime-gpu's CUDA EP
# (float16 model: the CUDA EP's attention takes fp16 / bf16 KV caches only), optionally preceded by the offload
# engine's GPU tests (TESTS=1), the CPU decode kernels' knobs swept at both goal shapes on this machine's cores
# (CPUSWEEP=1), their scaling with threads (CPUSCALING=1) and an A/B of two configurations (AB="bench_offload_ab's
# arguments"), the decode path's trials step by step (TRIALS=fraction: diag_path_trials, with TRIALS_ARGS in place of
# its steps' arguments, e.g. "--steps 5 --then-both 80 --slowdown 30:150 --gate-ab"), where a "both" step's time goes
# (PARTS=fractions: diag_worker_parts, PARTS_ARGS). BENCH=0 leaves the offload benchmark out.
# Run from the repository root with OUT set and SHAPE one of bench_offload's shapes; carry .whl (onnxruntime 1.32
# CPU, psutil, platformdirs, nvidia-ml-py), kernels/gpu/_build (the prebuilt cubin), with TESTS=1 .fixtures, and
# .numba-cache where an earlier run's cache was saved.
# onnxruntime-gpu's wheel must already be in /tmp/ortgpu in pieces (see gpu_tests_run.sh): it is joined and
# installed into /tmp/site_gpu, apart from the CPU build, which it must never share a folder with.
set -u
export PYTHONUNBUFFERED=1
# Numba's compiled CPU kernels from an earlier run, where this machine's CPU and the sources match (numba_cache.sh)
. benchmarks/numba_cache.sh
restore_numba_cache
[ -d .fixtures ] && export MOE_WORKBENCH_FIXTURES=$PWD/.fixtures
shape=${SHAPE:-gpt-oss-20b-like}
log=$OUT/run-$shape.log
# Without the prebuilt cubin for this source (carry kernels/gpu/_build) NVRTC compiles the GPU module on first use, for
# minutes, and every step's time limit goes to it: say so at once rather than time out silently.
cubin_note=""
python3 -c "from kernels.gpu._module import cubin_path; import sys; sys.exit(not cubin_path('90').is_file())" \
  || cubin_note="WARNING: no prebuilt cubin for this source in kernels/gpu/_build: NVRTC will compile the module (minutes)"
[ -n "$cubin_note" ] && echo "$cubin_note"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
wheel=/tmp/ortgpu/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -d /tmp/site_gpu/onnxruntime ]; then
  [ -f "$wheel" ] || cat /tmp/ortgpu/ortgpu.part.* > "$wheel" || exit 1
  mkdir -p /tmp/site_gpu
  cp -r /tmp/site/. /tmp/site_gpu/ && rm -rf /tmp/site_gpu/onnxruntime /tmp/site_gpu/onnxruntime-*.dist-info
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_gpu "$wheel" || exit 1
fi
{
  date -u
  [ -n "$cubin_note" ] && echo "$cubin_note"
  if [ "${TESTS:-0}" = 1 ]; then
    echo "== offload engine GPU tests (onnxruntime-gpu for the dense part)"
    # (a fresh machine compiles the CPU kernels first: minutes, hence the long limit)
    PYTHONPATH=/tmp/site_gpu timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/test_offload_cuda.py tests/test_cuda_step.py tests/test_offload_layouts.py tests/test_dense_device.py 2>&1 | tail -40
    date -u
  fi
  if [ "${CPUSWEEP:-0}" = 1 ]; then
    for cpu_shape in B A; do
      echo "== CPU decode knobs on this machine's cores, shape $cpu_shape, cold routing (bench_qmoe_cpu --sweep)"
      PYTHONPATH=/tmp/site timeout 150 python3 benchmarks/bench_qmoe_cpu.py --shape $cpu_shape --routing cold --quick \
        --sweep --sweep-only decode --no-prefill --no-generic 2>&1 | tail -24
      cp "$(ls -t benchmarks/results/qmoe-cpu-int4-shape$cpu_shape-cold-*.json | head -1)" "$OUT/" 2>/dev/null
    done
    date -u
  fi
  if [ "${CPUSCALING:-0}" = 1 ]; then
    for cpu_shape in A B; do
      echo "== CPU decode kernel against threads, shape $cpu_shape (bench_cpu_scaling)"
      PYTHONPATH=/tmp/site timeout 120 python3 benchmarks/bench_cpu_scaling.py --shape $cpu_shape --calls 40 2>&1 | tail -9
      cp "$(ls -t benchmarks/results/cpu-scaling-shape$cpu_shape-*.json | head -1)" "$OUT/" 2>/dev/null
    done
    date -u
  fi
  if [ -n "${AB:-}" ]; then
    # an A/B of two offload configurations in one process (bench_offload_ab), e.g. AB="--fractions 0 --b
    # device_working_bytes=1" (the decode streaming slots off in B), or of GPU switches (--b gpu.driver_copies=0); the
    # model is written to the bench's folder (AB_LIMIT: its time limit, 240 s unless set)
    echo "== offload A/B, $shape, float16: $AB"
    PYTHONPATH=/tmp/site_gpu timeout "${AB_LIMIT:-240}" python3 benchmarks/bench_offload_ab.py --shape "$shape" --dtype float16 \
      --device cuda --folder /tmp/bench-$shape --decode-tokens "${DECODE:-16}" $AB 2>&1 | grep -v "plugin EP"
    cp "$(ls -t benchmarks/results/offload-ab-$shape-*.json | head -1)" "$OUT/" 2>/dev/null
    date -u
  fi
  if [ -n "${TRIALS:-}" ]; then
    # the decode path's trials step by step at one resident fraction (diag_path_trials), then "both" asked for
    echo "== path trials, $shape, float16, ${TRIALS} resident"
    PYTHONPATH=/tmp/site_gpu timeout "${TRIALS_LIMIT:-220}" python3 benchmarks/diag_path_trials.py --shape "$shape" \
      --folder /tmp/bench-$shape --fractions "$TRIALS" ${TRIALS_ARGS:---steps 100 --then-both 40} 2>&1 \
      | grep -v "plugin EP"
    date -u
  fi
  if [ -n "${PARTS:-}" ]; then
    # where a "both" step's time goes at these resident fractions (diag_worker_parts: the worker's CPU parts, its
    # waits, end_step and the accounts left for it), PARTS_ARGS in place of its other arguments, e.g. "--layers 24
    # --path tier"
    echo "== worker parts and the step's end, $shape, float16, ${PARTS} resident"
    PYTHONPATH=/tmp/site_gpu timeout "${PARTS_LIMIT:-300}" python3 benchmarks/diag_worker_parts.py --shape "$shape" \
      --folder /tmp/bench-$shape --fractions "$PARTS" ${PARTS_ARGS:---layers 24} 2>&1 | grep -v "plugin EP"
    date -u
  fi
  if [ "${BENCH:-1}" = 1 ]; then
    left=$((${BENCH_LIMIT:-580} - SECONDS))  # BENCH_LIMIT: where this call shares its time with others
    echo "== offload benchmark, $shape, float16, dense part on the GPU (${left} s left)"
    PYTHONPATH=/tmp/site_gpu timeout $left python3 benchmarks/bench_offload.py --shape "$shape" --dtype float16 \
      --folder /tmp/bench-$shape --decode-tokens "${DECODE:-16}" --prefill-tokens 2048 ${BENCH_ARGS:-}
    # the file this run wrote (the newest), not the committed ones of earlier runs
    cp "$(ls -t benchmarks/results/offload-$shape-*.json | head -1)" "$OUT/" 2>/dev/null
    date -u
  fi
} > "$log" 2>&1
save_numba_cache "$OUT"  # for the next session to carry in .numba-cache/
tail -c 9000 "$log"
