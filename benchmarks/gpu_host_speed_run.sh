#!/usr/bin/env bash
# One call on the GPU machine (~3 minutes): is the host's work slower right after the CPU decode kernel because the
# calling core runs slower (its clock: AVX-512 licence; or OpenMP workers spinning beside it) or because of its caches?
# benchmarks/diag_host_after_kernel.py as the engine runs it (GOMP_SPINCOUNT=3M) and with OMP_WAIT_POLICY=PASSIVE
# (no spinning workers), ROUNDS times each, alternating (NOTES-overhead.md, nineteenth session, says how to read it).
# Carry .whl and, where an earlier run saved one for these kernel sources, .numba-cache.
set -u
export PYTHONUNBUFFERED=1
. benchmarks/numba_cache.sh
restore_numba_cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
{
  for round in $(seq "${ROUNDS:-2}"); do
    for policy in engine PASSIVE; do
      echo "== round $round, OpenMP wait: $policy"; date -u
      if [ "$policy" = PASSIVE ]; then
        OMP_WAIT_POLICY=PASSIVE PYTHONPATH=/tmp/site timeout 150 python3 benchmarks/diag_host_after_kernel.py \
          --threads "${THREADS:-16}" --rounds 300 2>&1 | tail -4
      else
        PYTHONPATH=/tmp/site timeout 150 python3 benchmarks/diag_host_after_kernel.py --threads "${THREADS:-16}" \
          --rounds 300 2>&1 | tail -4
      fi
    done
  done
} 2>&1 | tee "$OUT/host-speed.log"
save_numba_cache "$OUT"
