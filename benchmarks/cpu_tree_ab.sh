#!/usr/bin/env bash
# One call on the GPU machine: the CPU decode kernel of several source trees, in separate processes, alternating
# (bench_cpu_scaling at both goal shapes), for kernel changes that have no switch to A/B in one process.
# Run from the repository root with OUT set; carry .whl and the other trees (e.g. `mkdir .ab_old && git archive
# <commit> | tar -x -C .ab_old`, git-excluded), named by TREES (default ".ab_old ."). ROUNDS (2) rounds,
# THREADS (8,16).
set -u
export PYTHONUNBUFFERED=1
. benchmarks/numba_cache.sh
restore_numba_cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
{
  for shape in A B; do
    for round in $(seq "${ROUNDS:-2}"); do
      for tree in ${TREES:-.ab_old .}; do
        echo "== shape $shape, round $round, tree $tree"
        (cd "$tree" && PYTHONPATH=/tmp/site timeout 200 python3 benchmarks/bench_cpu_scaling.py --shape $shape \
          --threads "${THREADS:-8,16}" --calls 60 --no-write 2>&1 | tail -4)
      done
    done
  done
  date -u
} 2>&1 | tee "$OUT/cpu-tree-ab.log"
