#!/bin/bash
# The engine's decode at 1 and 32 sequences, the code before the greedy change (a worktree
# of 210ea03 at $BEFORE) and after (this checkout), alternating. Usage (repo root):
#   BEFORE=/tmp/wt_before benchmarks/results/greedy_isa_2026-11-28/engine_ab.sh N
set -u
N=${1:-2}; OUT=benchmarks/results/greedy_isa_2026-11-28; ROOT=$PWD
for i in $(seq 1 $N); do
  for code in before after; do
    dir=$ROOT; [ $code = before ] && dir=$BEFORE
    echo "$code $i: $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=$dir $ROOT/.venv/bin/python -m services.cli bench engine --threads 2 --concurrency 1,32 \
      --decode-steps 96 --runners torch --json $ROOT/$OUT/engine_${code}_$i.json 2>&1 | tail -3)
  done
done
