#!/bin/bash
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/w}; mkdir -p $OUT
for i in 1 2; do
 echo "run$i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/load.txt
 .venv/bin/tandem bench compare --run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1,decode.disagg.itl_weight=1 --run disagg_w05=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1,decode.disagg.itl_weight=0.5 --run agg=configs/agg.yaml --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100 --summary-json $OUT/compare$i.json > $OUT/compare$i.log 2>&1
done
echo "end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/load.txt
