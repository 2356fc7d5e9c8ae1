#!/bin/bash
cd /work/main
for i in 3 4; do
  for w in 1.0 0.5; do
    C="--run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1,decode.disagg.itl_weight=$w --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100"
    echo "== w=$w $i $(uptime)"
    .venv/bin/python -m services.cli bench compare $C --summary-json /tmp/d30/cmp/w${w}_$i.json 2>&1 | grep -A3 "rate req/s"
  done
done
echo "== end $(uptime)"
