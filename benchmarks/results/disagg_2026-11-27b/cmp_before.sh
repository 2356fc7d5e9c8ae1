#!/bin/bash
cd /tmp/wt_before
echo "== before $1 $(uptime)"
timeout 900 /work/main/.venv/bin/python -m services.cli bench compare --run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1 --run agg=configs/agg.yaml --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100 --summary-json /tmp/d31/cmp_before_$1.json 2>&1 | grep -B2 -A12 'rate req/s'
echo "== end $(uptime)"
