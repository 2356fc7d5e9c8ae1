#!/bin/bash
# The disaggregated-vs-aggregated rate sweep, the code before (96545eb, in a worktree at
# /tmp/wt_before) and after (/work/main) alternating; results in $OUT.
OUT=${OUT:-/tmp/ab2}; mkdir -p $OUT
for i in ${RUNS:-1}; do
  for side in after before; do
    dir=/work/main; [ $side = before ] && dir=/tmp/wt_before
    echo "$side$i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/load.txt
    (cd $dir && /work/main/.venv/bin/python -m services.cli bench compare --preset real-disagg \
        --long-fraction 0.4 --num-requests 60 --rates 0.5,1,2 \
        --summary-json $OUT/sweep_${side}$i.json > $OUT/sweep_${side}$i.log 2>&1)
  done
done
echo "end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/load.txt
