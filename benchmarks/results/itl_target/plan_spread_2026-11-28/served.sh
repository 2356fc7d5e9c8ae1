#!/bin/bash
for i in 1 2; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/wt_before
    echo "$side$i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab/load_served.txt
    (cd $dir && /work/main/.venv/bin/python -m services.cli bench anchor --phases served --threads 2 --itl-prompt 16 --itl-out 128 --itl-requests 2 --streams 32 --stream-requests 64 --json /tmp/ab/served_${side}$i.json > /tmp/ab/served_${side}$i.log 2>&1)
  done
done
