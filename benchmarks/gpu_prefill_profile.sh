#!/usr/bin/env bash
# One call on the GPU machine (~1 minute): where prefill_prep's and FC2's time goes at shape B (issue 3).
#   1. prefill_prep under Nsight Compute's warp-state, source-counter and occupancy sections, routed and with the
#      routed pairs given (diag_prefill_forward.py --pairs-given: no routing), so that its ~19 µs besides the
#      routing (twenty-fifth session) fall to the ranking atomics, the ticket's fences, the grouping block or the
#      conversion blocks;
#   2. FC2 (pf_gemmw_4_48_1) with the L2's reduction counters beside its time: whether its 8.4 M output reductions
#      weigh (NOTES-gpu-kernels.md, "FC2's output reductions in pairs").
# Run from the repository root with OUT set; carry .whl (or its small wheels) and kernels/gpu/_build (the cubin for
# this source). Full ncu outputs in $OUT/ncu-*.txt.
#   OUT=... bash benchmarks/gpu_prefill_profile.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
for given in "" "--pairs-given"; do
  name=prep${given:+-given}
  timeout 120 ncu --profile-from-start off --clock-control none --cache-control none --kernel-name prefill_prep \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SourceCounters python3 benchmarks/diag_prefill_forward.py --shape B $given > "$OUT/ncu-$name.txt" 2>&1
  echo "ncu $name rc $?"
  grep -E "Duration|Achieved Occupancy|Warp Cycles Per Issued|Stall|Registers Per Thread" "$OUT/ncu-$name.txt" \
    | head -20
done
timeout 90 ncu --profile-from-start off --clock-control none --cache-control none --kernel-name regex:pf_gemmw_4_48_1 \
  --metrics gpu__time_duration.sum,lts__t_requests_op_red.sum,lts__t_sectors_op_red.sum,lts__t_requests.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 benchmarks/diag_prefill_forward.py --shape B > "$OUT/ncu-fc2-red.txt" 2>&1
echo "ncu fc2 rc $?"
grep -E "gpu__time_duration|lts__" "$OUT/ncu-fc2-red.txt"
