#!/bin/bash
for rep in 1 2; do
 for v in var new; do
   d=/work/main; [ $v = var ] && d=/tmp/varwt
   r=$(cd $d && /work/main/.venv/bin/python -m services.cli bench engine --threads 2 --concurrency 32 --decode-steps 96 --decode-context 480 --json /tmp/served/ab2_${v}_${rep}.json 2>&1 | tail -1 | awk '{print $5}')
   echo "rep $rep ctx 480 $v: $r load $(cut -d' ' -f1 /proc/loadavg)"
 done
done
