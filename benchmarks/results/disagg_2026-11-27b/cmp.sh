#!/bin/bash
# disagg and agg side by side at 1 and 2 req/s; $1 tag; $2 extra --set-all args
cd /work/main
echo "== $1 $(uptime)"
timeout 900 .venv/bin/python -m services.cli bench compare --run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1 --run agg=configs/agg.yaml --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100 --summary-json /tmp/d31/cmp_$1.json $2 2>&1 | grep -B2 -A12 'rate req/s'
echo "== end $(uptime)"
