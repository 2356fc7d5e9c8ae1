#!/usr/bin/env bash
# The routing-on-whole-conversations comparison of docs/benchmarks.md, repeated: round
# robin, kv (default) and ttft, 8 mock workers in one process, real router/processor/frontend.
# Usage: run.sh TRACE_SAMPLE OUT_PREFIX RUNS   (TRACE_SAMPLE: sample_conversations(trace, 24, out))
set -euo pipefail
trace=$1; out=$2; runs=${3:-2}
W=decode.replicas=8,decode.replicas_per_process=8
for i in $(seq 1 "$runs"); do
  uptime >> "${out}_load.txt"
  .venv/bin/python -m services.cli bench compare \
    --run round_robin=configs/scale-mock.yaml@router.mode=round_robin,$W \
    --run kv=configs/scale-mock.yaml@router.mode=kv,$W --run ttft=configs/scale-mock.yaml@router.mode=ttft,$W \
    --workload mooncake --trace "$trace" --scale 0.03125 --arrival trace --speedup 30 \
    --num-requests 100000 --slo ttft_ms=2000 --summary-json "${out}_${i}.json" > "${out}_${i}.log" 2>&1
done
uptime >> "${out}_load.txt"
