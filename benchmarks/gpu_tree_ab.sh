#!/usr/bin/env bash
# A/B of this tree's GPU kernels against another checkout's on the GPU machine: the same benchmark command, run
# alternately in both trees, ROUNDS times (this tree first), so that drift between the two shows. The other tree is
# a git-ignored folder carried with the call, holding kernels/, benchmarks/, tests/, engine/ and the cubin built for
# its source, e.g. main's:
#   git archive main kernels benchmarks tests engine | tar -x -C .ab_main; cp <main's cubin> .ab_main/kernels/gpu/_build/
#   OTHER=.ab_main ROUNDS=2 BENCH="benchmarks/bench_gpu_pdl.py --switch rank_route --no-write" OUT=... \
#     bash benchmarks/gpu_tree_ab.sh
# Carry .whl, kernels/gpu/_build and the other tree.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site
here=$PWD
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "$here" "$here/$OTHER"; do
    [ "$tree" = "$here" ] && name="this tree" || name="$OTHER"
    echo "== round $round: $name"; date -u
    (cd "$tree" && timeout 200 python3 $BENCH 2>&1 | grep -E "^\[|chain|single|HBM copy")
  done
done
