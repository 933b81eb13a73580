#!/usr/bin/env bash
# One call on the GPU machine's 16-core Xeon: the fused CPU decode kernel (kernels/cpu moe_gemv) for shapes A
# (gpt-oss-20b-like) and B (Qwen3-30B-A3B-like) with cold routing (every expert comes back only after all the
# others), against the streaming read bandwidth and onnxruntime's CPU QMoE measured in the same run; each run's
# sweep also times both chunk orders (one shared counter, own spans then stealing) in alternating blocks.
# Log in $OUT/cpu-kernel.log, JSON results copied to $OUT.
# Run from the repository root with OUT set; carry .whl (the onnxruntime 1.32 CPU, psutil, platformdirs wheels).
# Numba compiles cold there (~1 min, in the shape B run; shape A reuses its cache): about 3 minutes in all.
set -u
export PYTHONUNBUFFERED=1
log=$OUT/cpu-kernel.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
{
  for shape in B A; do
    echo "== decode, shape $shape, cold routing"; date -u
    PYTHONPATH=/tmp/site timeout 170 python3 benchmarks/bench_qmoe_cpu.py --shape $shape --routing cold --quick \
      --no-prefill --no-generic --sweep --sweep-only "shared counter" --sweep-only "own spans" 2>&1 | tail -25
  done
  cp benchmarks/results/qmoe-cpu-int4-shape*-cold-*.json "$OUT/" 2>/dev/null
  date -u
} > "$log" 2>&1
tail -c 8000 "$log"
