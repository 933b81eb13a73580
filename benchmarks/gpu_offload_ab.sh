#!/usr/bin/env bash
# One call on the GPU machine: bench_offload at a few resident fractions once per variant, in turn, to compare the
# engine's choices in one hold of the machine (each variant is one flag of bench_offload; "default" is none, run first
# and last to show the drift between runs). Run after gpu_offload_run.sh in the same warm machine: it uses the
# onnxruntime-gpu that script installed in /tmp/site_gpu and the model it wrote in /tmp/bench-$SHAPE.
#   SHAPE=gpt-oss-20b-like FRACTIONS=0,0.25,0.5 VARIANTS="--dense-pool|--cpu-threads 15|OMP_WAIT_POLICY=ACTIVE" \
#     bash benchmarks/gpu_offload_ab.sh
set -u
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba} PYTHONPATH=/tmp/site_gpu
shape=${SHAPE:-gpt-oss-20b-like}
log=$OUT/ab-$shape.log
IFS='|' read -r -a variants <<< "default|${VARIANTS:-}|default"
for variant in "${variants[@]}"; do
  [ -n "$variant" ] || continue
  # a variant's KEY=VALUE words are the process's environment (OpenMP's wait policy: set before Numba's runtime
  # starts, so one process each), its other words bench_offload flags
  envs=() flags=()
  if [ "$variant" != default ]; then
    for word in $variant; do
      if [[ "$word" == *=* && "$word" != --* ]]; then envs+=("$word"); else flags+=("$word"); fi
    done
  fi
  left=$((590 - SECONDS))
  [ "$left" -gt 60 ] || { echo "== $variant: skipped, ${left} s left" >> "$log"; continue; }
  echo "== $shape, variant: $variant (${left} s left)" >> "$log"
  # shellcheck disable=SC2086 # the variant's flags are separate words
  timeout "$left" env "${envs[@]}" python3 benchmarks/bench_offload.py --shape "$shape" --dtype float16 \
    --folder "/tmp/bench-$shape" --fractions "${FRACTIONS:-0,0.25,0.5}" --decode-tokens "${DECODE:-16}" \
    --prefill-tokens 512 --trace-tokens 0 "${flags[@]}" 2>&1 | grep -v "plugin EP" >> "$log"
done
grep -E "^==|decode .*tok/s|per layer" "$log" | cut -c1-400
