#!/usr/bin/env bash
# One call on the GPU machine (~30 s): the kernels of one 512-token prefill forward at shapes B and A, each kernel's
# time under Nsight Compute at the card's own clocks without cache flushes, beside the forward's time by CUDA events
# (benchmarks/diag_prefill_forward.py). Run from the repository root with OUT set; carry .whl (or its small wheels)
# and kernels/gpu/_build (the cubin for this source).
#   OUT=... bash benchmarks/gpu_prefill_breakdown.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
for shape in B A; do
  timeout 60 python3 benchmarks/diag_prefill_forward.py --shape "$shape" --time
  timeout 90 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    python3 benchmarks/diag_prefill_forward.py --shape "$shape" > "$OUT/ncu-prefill-$shape.txt" 2>&1
  echo "ncu $shape rc $?"
  grep -E "^  [A-Za-z_][A-Za-z0-9_]* \(|gpu__time_duration" "$OUT/ncu-prefill-$shape.txt" | cut -c1-100
done
