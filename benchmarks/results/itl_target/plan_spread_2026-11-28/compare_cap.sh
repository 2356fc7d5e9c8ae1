#!/bin/bash
for i in ${RUNS:-4 5}; do
  echo "cap$i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab/load_compare.txt
  (cd /work/main && /work/main/.venv/bin/python -m services.cli bench compare --run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1 --run agg=configs/agg.yaml --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100 --summary-json /tmp/ab/compare_cap$i.json > /tmp/ab/compare_cap$i.log 2>&1)
done
