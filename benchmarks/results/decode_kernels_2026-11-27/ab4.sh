#!/bin/bash
for isa in avx2; do
 for v in new old new old; do
   d=/work/main; [ $v = old ] && d=/tmp/oldwt
   r=$(cd $d && /work/main/.venv/bin/python -m services.cli bench engine --threads 2 --concurrency 32 --decode-steps 64 --decode-context 480 --set engine.cpu_isa=$isa --json /tmp/served/isa_${isa}_${v}_$RANDOM.json 2>&1 | tail -1 | awk '{print $5}')
   echo "$isa ctx 480 $v: $r load $(cut -d' ' -f1 /proc/loadavg)"
 done
done
