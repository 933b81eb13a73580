#!/usr/bin/env bash
# One call on the GPU machine: the offload benchmark at real
# dimensions, and the resource-record artefacts (record, sweep plot, contention) on that model.
# Run from the repository root with OUT set; carry .whl (onnxruntime 1.32 CPU, psutil,
# platformdirs, nvidia-ml-py wheels) and kernels/gpu/_build (the prebuilt cubin).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
log=$OUT/run.log
{
  echo "== offload benchmark"; date -u
  timeout 330 python3 benchmarks/bench_offload.py --shape "${SHAPE:-gpt-oss-20b-like}" --folder /tmp/bench --decode-tokens 24
  cp benchmarks/results/offload-*.json "$OUT/" 2>/dev/null
  echo "== record"; date -u
  timeout 60 python3 -m app record /tmp/bench/model --scenario short --device cuda --max-new-tokens 32 --json \
    --history /tmp/h.sqlite > "$OUT/record.json"
  echo "== sweep"; date -u
  timeout 90 python3 -m app sweep /tmp/bench/model --device cuda --points 3 --max-new-tokens 16 \
    --plot "$OUT/sweep.png" --json --history /tmp/h.sqlite > "$OUT/sweep.json"
  echo "== contention"; date -u
  timeout 60 python3 -m app contention /tmp/bench/model --device cuda --workers 8 --max-new-tokens 32 > "$OUT/contention.md"
  date -u
} > "$log" 2>&1
tail -c 6000 "$log"
