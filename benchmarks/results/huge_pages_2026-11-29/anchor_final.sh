#!/bin/bash
# The final code (final_N) and fea565e (before_4) alternating, after the lone-head path was dropped.
BASE=$1; LS=$2; R=benchmarks/results/huge_pages_2026-11-29
load() { cut -d' ' -f1 /proc/loadavg; }
for run in final_1 before_4 final_2; do
  dir=.; [ $run = before_4 ] && dir=$BASE
  echo "anchor $run, load $(load)"
  (cd $dir && /work/main/.venv/bin/python -m services.cli bench anchor --threads 2 --llama-server $LS \
    --json /work/main/$R/anchor_$run.json > /work/main/$R/anchor_$run.txt 2>&1)
done
echo done
