#!/bin/bash
# tandem bench engine with the kernel weights on huge pages (the default) and off, alternating.
# usage (repo root): bash benchmarks/results/huge_pages_2026-11-29/engine_ab.sh ROUNDS
set -e
out=benchmarks/results/huge_pages_2026-11-29
for i in $(seq 1 "${1:-3}"); do
  for hp in true false; do
    echo "round $i cpu_huge_pages=$hp load $(cut -d' ' -f1 /proc/loadavg)"
    .venv/bin/python -m services.cli bench engine --threads 2 --prompt-len 850 --concurrency 1,32 \
      --decode-steps 64 --set engine.cpu_huge_pages=$hp --json $out/engine_${hp}_$i.json 2>&1 | grep -E '^torch'
  done
done
