#!/usr/bin/env bash
# One call on the GPU machine (under its 10-minute limit): onnxruntime's pool spinning against blocking
# (bench_threads), the resource-record artefacts (record, sweep, contention) on a 4-layer model of
# gpt-oss-20b's dimensions, then the offload benchmark at full depth in the time left.
# Run from the repository root with OUT set; carry .whl (onnxruntime 1.32 CPU, psutil, platformdirs,
# nvidia-ml-py wheels) and kernels/gpu/_build (the prebuilt cubin). The machine has no PySide6: the
# sweep plot is drawn afterwards from sweep.json (app.sweep_plot.export_sweep_plot).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
log=$OUT/run.log
{
  echo "== onnxruntime pool spinning vs blocking"; date -u
  timeout 150 python3 benchmarks/bench_threads.py --layers 4 --decode-tokens 16 --folder /tmp/bt
  cp benchmarks/results/threads-*.json "$OUT/" 2>/dev/null
  model=/tmp/bt/model
  echo "== record"; date -u
  timeout 100 python3 -m app record $model --scenario short --device cuda --max-new-tokens 32 --json \
    --history /tmp/h.sqlite > "$OUT/record.json"
  echo "== sweep"; date -u
  timeout 120 python3 -m app sweep $model --device cuda --points 4 --max-new-tokens 16 --json \
    --history /tmp/h.sqlite > "$OUT/sweep.json"
  echo "== contention"; date -u
  timeout 90 python3 -m app contention $model --device cuda --workers 8 --max-new-tokens 32 > "$OUT/contention.md"
  left=$((575 - SECONDS))
  echo "== offload benchmark (${left} s left)"; date -u
  timeout $left python3 benchmarks/bench_offload.py --shape "${SHAPE:-gpt-oss-20b-like}" --folder /tmp/bench \
    --decode-tokens 12 --prefill-tokens 1024
  cp benchmarks/results/offload-*.json "$OUT/" 2>/dev/null
  date -u
} > "$log" 2>&1
tail -c 6000 "$log"
