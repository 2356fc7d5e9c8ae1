#!/bin/bash
# alternating before/after disagg sweeps at 40% long
C="--run disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1 --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100"
for i in 1 2; do
  for v in after before; do
    if [ $v = after ]; then cd /work/main; else cd /tmp/wt_before; fi
    echo "== $v $i $(uptime)"
    /work/main/.venv/bin/python -m services.cli bench compare $C --summary-json /tmp/d30/cmp/${v}_$i.json 2>&1 | grep -A4 "rate req/s"
  done
done
cd /work/main
echo "== agg $(uptime)"
/work/main/.venv/bin/python -m services.cli bench compare --run agg=configs/agg.yaml --workload mixed --short-len 32 --long-len 768 --long-fraction 0.4 --output-len 32 --num-requests 60 --arrival poisson --rates 1,2 --slo ttft_ms=3000 --slo tpot_ms=100 --summary-json /tmp/d30/cmp/agg.json 2>&1 | grep -A4 "rate req/s"
echo "== end $(uptime)"
