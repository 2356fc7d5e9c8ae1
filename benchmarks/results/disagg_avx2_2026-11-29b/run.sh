#!/usr/bin/env bash
# agg vs disagg at 1 req/s with 150 requests (p99 = the 2nd-worst TTFT, not the worst), N runs.
set -euo pipefail
out=benchmarks/results/disagg_avx2_2026-11-29b; runs=${1:-2}
for i in $(seq 1 "$runs"); do
  uptime >> $out/load.txt
  .venv/bin/python -m services.cli bench compare --preset real-disagg --long-fraction 0.4 \
    --num-requests 150 --rate 1 --summary-json $out/compare_$i.json > $out/compare_$i.log 2>&1
done
uptime >> $out/load.txt
