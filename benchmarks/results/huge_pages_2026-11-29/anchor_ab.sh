#!/bin/bash
# tandem bench anchor, this code (after) and BASE's (before: a worktree of fea565e) alternating,
# with the 1-minute load before each. usage (repo root): anchor_ab.sh BASE LLAMA_SERVER PAIRS
BASE=$1; LS=$2; R=benchmarks/results/huge_pages_2026-11-29
load() { cut -d' ' -f1 /proc/loadavg; }
for i in $(seq 1 "${3:-3}"); do
  for code in after before; do
    dir=.; [ $code = before ] && dir=$BASE
    echo "anchor $code $i, load $(load)"
    (cd $dir && /work/main/.venv/bin/python -m services.cli bench anchor --threads 2 --llama-server $LS \
      --json /work/main/$R/anchor_${code}_$i.json > /work/main/$R/anchor_${code}_$i.txt 2>&1)
  done
done
echo done
