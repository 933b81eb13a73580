#!/usr/bin/env bash
# One call on the GPU machine (~6-8 minutes): does the CPU decode kernel's traffic through the caches of the thread
# that runs the engine's host work slow that work? (NOTES-overhead.md, "Eighteenth session")
# 1. benchmarks/diag_host_after_kernel.py (the host's work timed after a busy gap, after the kernel, after the kernel
#    with the calling thread spared), in this tree and in the prefetchnta tree (.ab_nta), alternating, ROUNDS times;
# 2. the engine, Qwen3-30B-A3B-like at LAYERS layers, float16, dense part on onnxruntime-gpu, 0 / 25 / 50% resident:
#    bench_offload_ab with B = cpu.gemv_spare_caller=1 (one process, alternating rounds);
# 3. bench_offload in this tree and in .ab_nta, alternating (separate processes: compare the host components).
# Run after onnxruntime-gpu's five pieces are in /tmp/ortgpu. Carry .whl, kernels/gpu/_build and .ab_nta
# (`mkdir .ab_nta && git archive nta-prefetch | tar -x -C .ab_nta`; its cubin is this tree's: cp kernels/gpu/_build/*
# .ab_nta/kernels/gpu/_build/), and .numba-cache where an earlier run saved one for these sources.
set -u
export PYTHONUNBUFFERED=1
shape=qwen3-30b-a3b-like
SHAPE=$shape TESTS=0 BENCH=0 bash benchmarks/gpu_offload_run.sh > /dev/null 2>&1  # installs /tmp/site, /tmp/site_gpu
export NUMBA_CACHE_DIR=/tmp/numba
here=$PWD
layers=${LAYERS:-24}

# `in_both_trees LABEL COMMAND`: COMMAND (a shell line) in this tree and in .ab_nta, alternating, ROUNDS times; each
# tree its own Numba cache (the prefetch locality is a constant of the compiled code)
in_both_trees() {
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in . .ab_nta; do
      echo "== $1, round $round, tree $tree"
      (cd "$tree" && NUMBA_CACHE_DIR=$([ "$tree" = . ] && echo /tmp/numba || echo /tmp/numba-nta) bash -c "$2")
    done
  done
  date -u
}

{
  date -u
  in_both_trees diag_host_after_kernel "PYTHONPATH=/tmp/site timeout 150 python3 benchmarks/diag_host_after_kernel.py \
    --threads 16 --rounds 300 2>&1 | tail -3"
  echo "== engine A/B in one process: B = the calling thread spared from the CPU kernel's chunks"
  PYTHONPATH=/tmp/site_gpu timeout 300 python3 benchmarks/bench_offload_ab.py --shape $shape --dtype float16 \
    --device cuda --folder /tmp/bench-$shape-l$layers --layers $layers --decode-tokens 12 \
    --fractions 0,0.25,0.5 --rounds "${ROUNDS:-2}" --b cpu.gemv_spare_caller=1 2>&1 | grep -v "plugin EP" | tail -16
  cp "$(ls -t benchmarks/results/offload-ab-$shape-*.json | head -1)" "$OUT/" 2>/dev/null
  date -u
  in_both_trees bench_offload "PYTHONPATH=/tmp/site_gpu timeout 200 python3 benchmarks/bench_offload.py \
    --shape $shape --dtype float16 --folder /tmp/bench-$shape-l$layers --layers $layers --decode-tokens 12 \
    --prefill-tokens 256 --trace-tokens 0 --fractions 0,0.25,0.5 2>&1 | grep -E 'decode .*tok/s|per layer µs' \
    | cut -c1-400"
} > "$OUT/host-cache.log" 2>&1
cd "$here" && . benchmarks/numba_cache.sh && save_numba_cache "$OUT"
cat "$OUT/host-cache.log" | cut -c1-400
