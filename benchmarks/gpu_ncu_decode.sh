#!/usr/bin/env bash
# One call on the GPU machine (~15 s): Nsight Compute on one launch of each GPU decode kernel (decode_prep, the fp16
# dec5h FC1 and FC2) at shapes A and B, one token, after two warm-up forwards per shape
# (bench_gpu_decode_parts.py --eager-once), with the sections that say what limits them (issue slots, warp states,
# instruction counts, excess global sectors and shared-memory wavefronts), and the SASS of the shape-A kernels.
# Run from the repository root with OUT set; carry .whl and kernels/gpu/_build (the cubin for this source).
#   OUT=... bash benchmarks/gpu_ncu_decode.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
for kernel in dec5h_4_2_0_0 dec5h_4_2_0_1 dec5h_4_2_0_1p; do
  cuobjdump -sass -fun "$kernel" kernels/gpu/_build/*.cubin > "$OUT/sass-$kernel.txt" 2>&1
done
# per shape: 2 warm-up forwards x 3 kernels skipped, then one forward (3 kernels) per shape profiled
timeout 200 ncu --clock-control none --kernel-name regex:'^(dec5h_|decode_prep)' --launch-skip 12 --launch-count 6 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section SourceCounters --import-source no \
  python3 benchmarks/bench_gpu_decode_parts.py --eager-once --shapes A,B --l2-prefetch 0 --ncu-warmup 2 \
  --dtype float16 > "$OUT/ncu-decode.txt" 2>&1
echo "ncu rc $?"
grep -E "^  (dec5h_|decode_prep)|Duration  |Issued Warp Per|No Eligible|Executed Instructions  |Achieved Occupancy|excessive" \
  "$OUT/ncu-decode.txt"
