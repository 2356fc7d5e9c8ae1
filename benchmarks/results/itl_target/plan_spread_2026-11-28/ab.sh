#!/bin/bash
# alternating before (8bb9c88 worktree) / after (working tree), the budget bench's default point
set -e
for i in ${RUNS:-1 2}; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/wt_before
    echo "$side$i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab/load.txt
    (cd $dir && /work/main/.venv/bin/python -m services.cli bench budget --budgets 1024 --itl-targets 100 --json /tmp/ab/${side}$i.json > /tmp/ab/${side}$i.log 2>&1)
  done
done
