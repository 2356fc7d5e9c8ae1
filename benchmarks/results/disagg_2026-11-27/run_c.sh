#!/bin/bash
cd /work/main
for i in 1 2; do
  for c in 0.1 0; do
    C="--run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1,decode.disagg.prediction_correction=$c --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100"
    echo "== c=$c $i $(uptime)"
    .venv/bin/python -m services.cli bench compare $C --summary-json /tmp/d30/cmp/c${c}_$i.json 2>&1 | grep -A3 "rate req/s"
  done
done
echo "== end $(uptime)"
