#!/usr/bin/env bash
# A/B of this tree's offload engine against another checkout's on the GPU machine: bench_offload.py (dense part on
# onnxruntime-gpu, float16) in both trees, alternately, ROUNDS times (this tree first), each tree with its own Numba
# cache. Separate processes: runs move ±15-25% between processes at 25-50% resident (RESULTS.md, nineteenth session),
# so read the rounds side by side. The other tree is a git-ignored folder carried with the call, e.g. a commit's:
#   mkdir .ab_old && git archive <commit> | tar -x -C .ab_old && cp kernels/gpu/_build/* .ab_old/kernels/gpu/_build/
#   OTHER=.ab_old SHAPE=qwen3-30b-a3b-like ARGS="--fractions 0.25,0.5 --repeats 2" OUT=... \
#     bash benchmarks/gpu_engine_tree_ab.sh
# Run after onnxruntime-gpu's five pieces are in /tmp/ortgpu; carry .whl, kernels/gpu/_build and the other tree
# (its cubin must be built for its GPU source: the one in kernels/gpu/_build where that source is unchanged).
# An other tree without kernels/ (an engine change alone: rm -r .ab_old/kernels) runs this tree's kernels, from
# this tree's Numba cache: no second compile of the CPU kernels (minutes on a fresh machine).
set -u
export PYTHONUNBUFFERED=1
shape=${SHAPE:-qwen3-30b-a3b-like}
SHAPE=$shape TESTS=0 BENCH=0 bash benchmarks/gpu_offload_run.sh > /dev/null 2>&1  # installs /tmp/site_gpu
here=$PWD
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "$here" "$here/$OTHER"; do
    [ "$tree" = "$here" ] && name="this tree" || name="$OTHER"
    echo "== round $round: $name"; date -u
    # this tree's kernels: the cache gpu_offload_run.sh restored from .numba-cache; the other tree's own: its own
    cache=/tmp/numba
    [ "$tree" != "$here" ] && [ -d "$tree/kernels" ] && cache=/tmp/numba-other
    (cd "$tree" && NUMBA_CACHE_DIR=$cache PYTHONPATH=/tmp/site_gpu:$here timeout "${LIMIT:-280}" \
      python3 benchmarks/bench_offload.py --shape "$shape" --dtype float16 --folder "/tmp/bench-$shape" \
      --decode-tokens "${DECODE:-16}" --prefill-tokens 256 --trace-tokens 0 ${ARGS:-} 2>&1 \
      | grep -E "decode .*tok/s|per layer µs" | cut -c1-420)
  done
done
date -u
