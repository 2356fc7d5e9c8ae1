#!/bin/bash
W="--workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100"
for i in 2; do
 for lay in agg disagg; do
  for v in after before; do
    if [ $v = after ]; then cd /work/main; else cd /tmp/wt_before; fi
    if [ $lay = disagg ]; then R="--run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1"; else R="--run agg=configs/agg.yaml"; fi
    echo "== $lay $v $i $(uptime)"
    /work/main/.venv/bin/python -m services.cli bench compare $R $W --summary-json /tmp/d30/cmp/s_${lay}_${v}_$i.json 2>&1 | grep -A3 "rate req/s"
  done
 done
done
echo "== end $(uptime)"
